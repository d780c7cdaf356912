"""Stateful compression schemes with explicit pytree state, one link direction each.

A scheme wraps a codec C. Its state is a table of rows (NamedTuple of arrays [rows, ...]):
one row per example slot of a batch for EF/EF21/EF-mixed (the "global buffer" of a whole
batch), or one per training example for AQ-SGD. The executor gathers the rows a message
touches, and the scheme works on those rows only:
  send(x, s_state, key) -> (payload, s_state')      on the sending device
  receive(payload, r_state) -> (x_hat, r_state')    on the receiving device, from the payload
                                                    and its own state alone
Sender and receiver states that mirror each other are updated by identical arithmetic, so
they stay bitwise equal. During warm-up (AQ-SGD's first epochs) every scheme sends the
dense tensor; only AQ-SGD records it.
"""
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp.arguments import is_integer
from jaxcomp.compress import codecs

_IDENTITY = codecs.Identity()


class EmptyState(NamedTuple):
  """The state of a scheme that keeps none (as optax.EmptyState): no arrays."""


class EFState(NamedTuple):
  """Error buffer e of EF."""
  error: jax.Array


class EF21State(NamedTuple):
  """Shared estimate g of EF21 (held identically by sender and receiver)."""
  estimate: jax.Array


class AQSGDState(NamedTuple):
  """Per-example activation buffer m(xi) of AQ-SGD (held identically by both ends)."""
  buffer: jax.Array


def _zeros(num_rows, row_shape, dtype):
  return jnp.zeros((num_rows, *row_shape), dtype)


@dataclasses.dataclass(frozen=True)
class Scheme:
  """Base: the plain scheme m = C(x), no state."""
  codec: codecs.Codec
  keyed_by_example = False  # state rows indexed by example id instead of batch slot

  def __post_init__(self):
    if not isinstance(self.codec, codecs.Codec):
      raise ValueError(f"{type(self).__name__} needs a Codec, got {self.codec!r}")

  def init_sender(self, num_rows, row_shape, dtype):
    """The sender's state for `num_rows` rows of `row_shape` (EmptyState: none)."""
    return EmptyState()

  def init_receiver(self, num_rows, row_shape, dtype):
    """The receiver's state (EmptyState: none)."""
    return EmptyState()

  def send(self, x, state, key=None):
    return self.codec.encode(x, key), state

  def receive(self, payload, state):
    return self.codec.decode(payload), state

  def warmup_send(self, x, state):
    return _IDENTITY.encode(x), state

  def warmup_receive(self, payload, state):
    return _IDENTITY.decode(payload), state

  def wire_bytes(self, shape, dtype) -> int:
    return self.codec.wire_bytes(shape, dtype)


class Plain(Scheme):
  """m = C(x)."""


def sender_only(scheme) -> bool:
  """Whether `scheme` keeps no receiver state (Plain, EF): what an exchange that only decodes what it receives
  (the data-parallel and the tied-parameter exchanges) can run."""
  return isinstance(scheme, Scheme) and type(scheme) in (Plain, EF)


@dataclasses.dataclass(frozen=True)
class EF(Scheme):
  """Error feedback (Seide): m = C(x + e); e' = x + e - m. Sender-only fp32 state."""

  def init_sender(self, num_rows, row_shape, dtype):
    return EFState(_zeros(num_rows, row_shape, jnp.float32))

  def send(self, x, state, key=None):
    v = x.astype(jnp.float32) + state.error
    payload = self.codec.encode(v.astype(x.dtype), key)
    return payload, EFState(v - self.codec.decode(payload).astype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class EF21(Scheme):
  """EF21 (Richtarik): c = C(x - g); g' = g + c on both ends; the receiver outputs g'."""

  def init_sender(self, num_rows, row_shape, dtype):
    return EF21State(_zeros(num_rows, row_shape, jnp.float32))

  init_receiver = init_sender

  def send(self, x, state, key=None):
    payload = self.codec.encode((x.astype(jnp.float32) - state.estimate).astype(x.dtype), key)
    return payload, EF21State(state.estimate + self.codec.decode(payload).astype(jnp.float32))

  def receive(self, payload, state):
    g = state.estimate + self.codec.decode(payload).astype(jnp.float32)
    return g.astype(payload.dtype), EF21State(g)


@dataclasses.dataclass(frozen=True)
class EFMixed(Scheme):
  """EF-mixed: m = TopK_a(x) + TopK_b(e); e' = x + e - m, with a + b = ceil(K*F) non-zeros per row.

  a = ceil(k/2) entries come from x, b = floor(k/2) from the error buffer (none when k = 1).
  """

  def __post_init__(self):
    super().__post_init__()
    if not isinstance(self.codec, codecs.TopK):
      raise ValueError(f"EF-mixed needs a TopK codec, got {self.codec!r}")

  def parts(self, shape) -> tuple[codecs.TopK, codecs.TopK | None]:
    """TopK of x keeping ceil(k/2) entries per row, TopK of e keeping floor(k/2) (None if 0)."""
    k = self.codec.k(shape)
    f = dataclasses.replace(self.codec, fraction=1.0).k(shape)  # features per row
    exactly = lambda n: dataclasses.replace(self.codec, fraction=n / f) if n else None
    return exactly(k - k // 2), exactly(k // 2)

  def init_sender(self, num_rows, row_shape, dtype):
    return EFState(_zeros(num_rows, row_shape, jnp.float32))

  def send(self, x, state, key=None):
    of_x, of_e = self.parts(x.shape)
    payload = (of_x.encode(x),) + ((of_e.encode(state.error.astype(x.dtype)),) if of_e else ())
    m = self._decode(payload)
    return payload, EFState(x.astype(jnp.float32) + state.error - m)

  def _decode(self, payload):
    of_x, of_e = self.parts(payload[0].shape)
    return sum(c.decode(p).astype(jnp.float32) for c, p in zip((of_x, of_e), payload))

  def receive(self, payload, state):
    return self._decode(payload).astype(payload[0].dtype), state

  def wire_bytes(self, shape, dtype):
    return sum(c.wire_bytes(shape, dtype) for c in self.parts(shape) if c is not None)


@dataclasses.dataclass(frozen=True)
class AQSGD(Scheme):
  """AQ-SGD (Wang et al.): compress the change of each example's activation.

  Both ends hold m(xi). Warm-up (first visit): send a, m(xi) = a. Afterwards send
  Q(a - m(xi)), m(xi) <- m(xi) + Q(a - m(xi)); the receiver uses the updated m(xi).
  Rows are example ids; the table has `num_examples` rows stored in `buffer_dtype`.
  """
  num_examples: int = 0
  buffer_dtype: str = "float16"
  keyed_by_example = True

  def __post_init__(self):
    super().__post_init__()
    if not is_integer(self.num_examples) or self.num_examples < 1:
      raise ValueError(f"AQ-SGD needs num_examples >= 1 (size of the training set), got {self.num_examples!r}")

  def buffer_bytes(self, row_shape) -> int:
    """Bytes of one end's table: num_examples x prod(row_shape) x itemsize."""
    n = self.num_examples
    for d in row_shape:
      n *= d
    return n * jnp.dtype(self.buffer_dtype).itemsize

  def init_sender(self, num_rows, row_shape, dtype):
    return AQSGDState(_zeros(self.num_examples, row_shape, self.buffer_dtype))

  init_receiver = init_sender

  def _update(self, m, delta_hat):
    return (m.astype(jnp.float32) + delta_hat.astype(jnp.float32)).astype(self.buffer_dtype)

  def send(self, x, state, key=None):
    delta = (x.astype(jnp.float32) - state.buffer.astype(jnp.float32)).astype(x.dtype)
    payload = self.codec.encode(delta, key)
    return payload, AQSGDState(self._update(state.buffer, self.codec.decode(payload)))

  def receive(self, payload, state):
    m = self._update(state.buffer, self.codec.decode(payload))
    return m.astype(payload.dtype), AQSGDState(m)

  def warmup_send(self, x, state):
    return _IDENTITY.encode(x), AQSGDState(x.astype(self.buffer_dtype))

  def warmup_receive(self, payload, state):
    x = _IDENTITY.decode(payload)
    return x, AQSGDState(x.astype(self.buffer_dtype))
