"""ResNet18, CIFAR variant (3x3 stem, no max-pool), cut into pipeline stages.

Stem conv3x3(64) + BN + relu, then layer1..layer4 of two BasicBlocks each (64/128/256/512
channels, strides 1/2/2/2), global average pool, Dense(classes). BatchNorm as PyTorch's
(momentum 0.1, i.e. Flax 0.9; eps 1e-5). S=4 cuts after layer1, layer2, layer3: boundary
activations [B,32,32,64], [B,16,16,128], [B,8,8,256].
"""
import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from jaxcomp.pipeline import FlaxStage

# which of stem, layer1..4, head each stage holds, for each supported stage count
_CUTS = {1: [("stem", 1, 2, 3, 4, "head")], 2: [("stem", 1, 2), (3, 4, "head")],
         4: [("stem", 1), (2,), (3,), (4, "head")]}
STAGE_COUNTS = tuple(sorted(_CUTS))


@dataclasses.dataclass(frozen=True)
class ResNet18Config:
  num_classes: int = 10
  width: int = 64  # channels of layer1; layers double it
  dtype: str = "float32"


def _bn(train, name=None):
  return nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5, name=name)


class BasicBlock(nn.Module):
  channels: int
  stride: int
  dtype: str

  @nn.compact
  def __call__(self, x, train):
    conv = lambda c, k, s, name: nn.Conv(c, (k, k), (s, s), padding=k // 2, use_bias=False, dtype=self.dtype,
                                         name=name)
    y = nn.relu(_bn(train, "bn1")(conv(self.channels, 3, self.stride, "conv1")(x)))
    y = _bn(train, "bn2")(conv(self.channels, 3, 1, "conv2")(y))
    if self.stride != 1 or x.shape[-1] != self.channels:
      x = _bn(train, "bn_shortcut")(conv(self.channels, 1, self.stride, "shortcut")(x))
    return nn.relu(x + y)


class ResNetStage(nn.Module):
  cfg: ResNet18Config
  parts: tuple

  @nn.compact
  def __call__(self, x, train: bool = False):
    cfg = self.cfg
    for part in self.parts:
      if part == "stem":
        x = nn.Conv(cfg.width, (3, 3), padding=1, use_bias=False, dtype=cfg.dtype, name="stem_conv")(x)
        x = nn.relu(_bn(train, "stem_bn")(x))
      elif part == "head":
        x = nn.Dense(cfg.num_classes, dtype=cfg.dtype, name="head")(jnp.mean(x, axis=(1, 2)))
      else:
        channels = cfg.width * 2 ** (part - 1)
        for b in range(2):
          x = BasicBlock(channels, 2 if part > 1 and b == 0 else 1, cfg.dtype, name=f"layer{part}_{b}")(x, train)
    return x


def resnet18_stages(cfg: ResNet18Config, num_stages: int = 4) -> tuple[FlaxStage, ...]:
  if num_stages not in STAGE_COUNTS:
    raise ValueError(f"ResNet18 splits into {list(STAGE_COUNTS)} stages, got num_stages={num_stages!r}")
  return tuple(FlaxStage(ResNetStage(cfg, parts)) for parts in _CUTS[num_stages])
