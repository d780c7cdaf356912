"""QuantizedAdam (AQ-SGD paper): data parallelism that exchanges Adam's first moment, compressed.

Warm-up steps run plain Adam (as optax.adam / optax.adamw) on the dense mean gradient g,
updating both moments. Afterwards Adam's second moment v is frozen and each replica i forms
its local first moment from its own gradient g_i:
  m_i = b1 m + (1 - b1) g_i,   sends C(m_i + e_i),   e_i' = m_i + e_i - C(m_i + e_i),
  m' = mean_i C(m_i + e_i)     (every replica decodes every message: m' is the same on all).
The paper's server also keeps an error buffer for the averaged message it sends back; with an
all-gather there is no server and no second compression, so worker EF is all there is.
Update, with bias corrections as optax.adam (t counts all steps, t_v the warm-up steps):
  p' = p - lr(t - 1) (m_hat / (sqrt(v_hat) + eps) + weight_decay p),
  m_hat = m' / (1 - b1^t),   v_hat = v / (1 - b2^t_v)   (fixed after warm-up).
The exchange itself lives in the GPipe executor; this module holds the state and the math.
"""
import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp.arguments import is_number


class QuantizedAdamState(NamedTuple):
  """Adam's moments and step counts; `nu` and `nu_count` stop changing after warm-up."""
  count: jax.Array  # steps taken: t of m's bias correction
  nu_count: jax.Array  # steps that updated v (the warm-up steps): t_v of v's bias correction
  mu: Any
  nu: Any


def _check_decay(name, value):
  if not is_number(value) or not 0.0 <= value < 1.0:
    raise ValueError(f"QuantizedAdam {name} must be in [0, 1), got {value!r}")


@dataclasses.dataclass(frozen=True)
class QuantizedAdam:
  """Pass as the optimizer of a `sharded.ShardedExecutor` whose `grad_scheme` compresses the momentum.

  `learning_rate` is a float or an optax schedule of the step count; `weight_decay` is
  decoupled (optax.adamw). Only the GPipe executor can run it (it needs the data axis).
  """
  learning_rate: float | Callable = 1e-3
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  weight_decay: float = 0.0

  def __post_init__(self):
    _check_decay("b1", self.b1)
    _check_decay("b2", self.b2)
    for name in ("eps", "weight_decay"):
      value = getattr(self, name)
      if not is_number(value) or value < 0:
        raise ValueError(f"QuantizedAdam {name} must be a number >= 0, got {value!r}")
    if not callable(self.learning_rate) and not is_number(self.learning_rate):
      raise ValueError(f"QuantizedAdam learning_rate must be a number or a schedule, got {self.learning_rate!r}")

  def init(self, params) -> QuantizedAdamState:
    """Zero moments shaped like `params`, zero step counts."""
    zeros = lambda: jax.tree.map(jnp.zeros_like, params)
    return QuantizedAdamState(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32), zeros(), zeros())

  def update(self, updates, state, params=None):
    """Refuses: called by an executor that treats this as an optax optimizer."""
    raise ValueError("QuantizedAdam exchanges Adam's first moment between data-parallel replicas and only "
                     "runs inside sharded.ShardedExecutor(mesh, grad_scheme=...); use optax.adam with other executors")

  def local_momentum(self, grads, state):
    """m_i = b1 m + (1 - b1) g_i."""
    return (1 - self.b1) * grads + self.b1 * state.mu

  def dense_update(self, grads, state, params):
    """Warm-up: Adam on the mean gradient g, v = b2 v + (1 - b2) g^2. Returns (params', state')."""
    nu = (1 - self.b2) * jnp.square(grads) + self.b2 * state.nu
    return self._apply(params, state._replace(mu=self.local_momentum(grads, state), nu=nu,
                                              nu_count=state.nu_count + 1))

  def frozen_update(self, mu, state, params):
    """After warm-up: the exchanged first moment m', v frozen. Returns (params', state')."""
    return self._apply(params, state._replace(mu=mu))

  def _apply(self, params, state):
    """p' = p - lr (m_hat / (sqrt(v_hat) + eps) + weight_decay p), count + 1."""
    lr = self.learning_rate(state.count) if callable(self.learning_rate) else self.learning_rate
    count = state.count + 1
    mu_hat = state.mu / (1 - self.b1**count)
    nu_hat = state.nu / (1 - self.b2**state.nu_count)
    direction = mu_hat / (jnp.sqrt(nu_hat) + self.eps) + self.weight_decay * params
    return params - lr * direction, state._replace(count=count)
