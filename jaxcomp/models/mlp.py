"""A small MLP cut into stages: the model of the README example and the executor tests."""
import flax.linen as nn

from jaxcomp.pipeline import FlaxStage


class MLPStage(nn.Module):
  """relu(Dense(hidden)) layers, then an optional Dense(out) head."""
  hidden: int
  layers: int = 1
  out: int = 0

  @nn.compact
  def __call__(self, x, train: bool = False):
    for _ in range(self.layers):
      x = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(self.out)(x) if self.out else x


def mlp_stages(hidden: int, num_classes: int, num_stages: int, layers_per_stage: int = 1) -> tuple:
  """`num_stages` MLP stages; the last one ends in a `num_classes` head."""
  if num_stages < 1:
    raise ValueError(f"num_stages must be >= 1, got {num_stages}")
  return tuple(FlaxStage(MLPStage(hidden, layers_per_stage, num_classes if s == num_stages - 1 else 0))
               for s in range(num_stages))
