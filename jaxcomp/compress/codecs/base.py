"""The codec contract, and what every family shares: the input check, compiling a method, exact ratios.

A codec is a frozen dataclass (hashable, so it is static under `jax.jit`: see `compiled`) with
  encode(x, key) -> Payload      the arrays that cross the link, nothing else (`wire`)
  decode(payload) -> x_hat       what the receiver reconstructs from those arrays alone
  wire_bytes(shape, dtype) -> int exact size of the payload, computed without running it
and `codec(x, key)` = decode(encode(x)), the C(x) of the papers' math.
"""
import abc
import functools
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.compress.codecs.wire import Payload


def num_entries(shape) -> int:
  """Entries of an array of `shape` (int64 product: no overflow)."""
  return int(np.prod(shape, dtype=np.int64))


def compiled(method):
  """A codec method under `jax.jit` with the codec itself static (codecs are hashable).

  Called eagerly, the method compiles as one program instead of one per operation inside it;
  under an enclosing `jit` it inlines. Every codec's `encode` and `decode` carry it.
  """
  return jax.jit(method, static_argnums=0)


def check_encodable(codec, x):
  """ValueError unless `x` is a non-empty real floating-point array with a leading example axis."""
  shape, dtype = tuple(np.shape(x)), jnp.result_type(x)
  if not jnp.issubdtype(dtype, jnp.floating) or not shape or 0 in shape:
    raise ValueError(f"{type(codec).__name__} cannot encode an array of shape {shape} and dtype {dtype}: codecs "
                     "encode non-empty real floating-point arrays [B, ...] (cast integers to a float dtype; send "
                     "complex numbers as their real and imaginary parts)")


def checked(encode):
  """`encode` that first refuses what no codec encodes (`check_encodable`, on every call, traced or not): every
  codec's `encode` carries it, outside `compiled`."""
  @functools.wraps(encode)
  def checked_encode(self, x, key=None):
    check_encodable(self, x)
    return encode(self, x, key)
  return checked_encode


def ratio(v, d):
  """v / d for a scalar or broadcast d >= 0 (0 where d == 0), exact up to fp32 max.

  XLA turns v / d into v * (1/d); for d > 2^126 that reciprocal is denormal and flushed
  to zero, so huge divisors are pre-scaled by 2^-64 on both sides.
  """
  c = jnp.where(d >= 2.0**64, 2.0**-64, 1.0)
  safe = jnp.where(d > 0, d * c, 1.0)
  return jnp.where(d > 0, (v * c) * (1.0 / safe), 0.0)


class Codec(abc.ABC):
  """The codec contract: `encode`, `decode`, `wire_bytes` (abstract); `__call__` is
  C(x) = decode(encode(x)); every subclass's `encode` is `@checked` (it first runs `check_encodable`)."""

  @abc.abstractmethod
  def encode(self, x, key=None) -> Payload:
    """The arrays that cross the link for `x` [B, ...] (`key`: randomness of stochastic codecs)."""

  @abc.abstractmethod
  def decode(self, payload: Payload) -> jax.Array:
    """What the receiver reconstructs from the payload alone."""

  @abc.abstractmethod
  def wire_bytes(self, shape, dtype) -> int:
    """Exact bytes of the payload of an array of `shape` and `dtype`, computed without running it."""

  def __call__(self, x, key=None):
    return self.decode(self.encode(x, key))


@runtime_checkable
class Positional(Protocol):
  """The sparse-codec extras: a codec whose message says where its values sit, so that a backward can send values
  alone at the forward message's positions (index reuse). TopK is one."""

  def where(self, payload: Payload) -> jax.Array:
    """Where the payload's values sit in their rows, in the form its message carries (TopK: a mask or indices)."""

  def values_at(self, x, where) -> Payload:
    """x's values at the positions `where` (as `where` gives them): a payload of values alone."""

  def scatter(self, payload: Payload, where) -> jax.Array:
    """The dense tensor from values at the positions `where` (the inverse of `values_at`)."""

  def value_bytes(self, shape, dtype) -> int:
    """Exact bytes of `values_at`'s payload."""
