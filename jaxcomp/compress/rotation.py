"""Randomized Hadamard rotation around any codec: spreads outliers before quantizing.

Along the last (feature) axis, in blocks of n = 2^m features, the sender sends
C(R x) with R = H D: D = diag(+-1) random signs, H the orthonormal Walsh-Hadamard matrix
(H = H^T = H^-1, entries +-n^-1/2). The receiver decodes and undoes it: x_hat = D H C(R x).
R is orthogonal, so ||x - x_hat||_2 = ||R x - C(R x)||_2: any error bound of the inner codec
in the 2-norm holds unchanged, while a max-abs scale now sees max|R x| ~ ||x||_2 sqrt(2 ln n / n)
instead of one outlier. H is applied by the fast transform (m butterfly stages, O(n log n), no
matrix). The signs come from a seed in the spec that both ends know: nothing extra is sent.
"""
import dataclasses

import jax
import jax.numpy as jnp

from jaxcomp.compress.codecs import Codec, Payload, checked, compiled


def fwht(x: jax.Array) -> jax.Array:
  """Orthonormal Walsh-Hadamard transform of the last axis (a power of two): H x, H = H^-1."""
  n = x.shape[-1]
  if n & (n - 1) or n == 0:
    raise ValueError(f"the Hadamard transform needs a power-of-two length, got {n}")
  lead = x.shape[:-1]
  h = 1
  while h < n:  # butterfly: pairs (i, i + h) inside blocks of 2h -> (a + b, a - b)
    pairs = x.reshape(*lead, n // (2 * h), 2, h)
    a, b = pairs[..., 0, :], pairs[..., 1, :]
    x = jnp.stack([a + b, a - b], axis=-2).reshape(*lead, n)
    h *= 2
  return x * (n ** -0.5)


def largest_power_of_two_dividing(f: int) -> int:
  return f & -f


@dataclasses.dataclass(frozen=True)
class Hadamard(Codec):
  """C'(x) = D H C(H D x) blockwise on the last axis; wire bytes are the inner codec's.

  `block` features per rotation (a power of two dividing the last axis; None: the largest
  such); `seed` fixes the signs D (one per feature, shared by both ends, never sent).
  """
  inner: Codec
  block: int | None = None
  seed: int = 0

  def __post_init__(self):
    if not isinstance(self.inner, Codec):
      raise ValueError(f"Hadamard wraps a Codec, got {self.inner!r}")
    if self.block is not None and (self.block < 2 or self.block & (self.block - 1)):
      raise ValueError(f"Hadamard block must be a power of two >= 2, got {self.block}")

  def block_for(self, features: int) -> int:
    n = self.block or largest_power_of_two_dividing(features)
    if features % n:
      raise ValueError(f"Hadamard block {n} does not divide the {features} features of the last axis; "
                       f"use a power of two dividing {features} (e.g. hadamard:{largest_power_of_two_dividing(features)})")
    return n

  def _signs(self, features: int) -> jax.Array:
    return jnp.where(jax.random.bernoulli(jax.random.key(self.seed), 0.5, (features,)), 1.0, -1.0)

  def rotate(self, x) -> jax.Array:
    """R x = H D x in float32, blockwise."""
    f = x.shape[-1]
    n = self.block_for(f)
    y = x.astype(jnp.float32) * self._signs(f)
    return fwht(y.reshape(*x.shape[:-1], f // n, n)).reshape(x.shape)

  def unrotate(self, y) -> jax.Array:
    """R^T y = D H y."""
    f = y.shape[-1]
    n = self.block_for(f)
    return fwht(y.astype(jnp.float32).reshape(*y.shape[:-1], f // n, n)).reshape(y.shape) * self._signs(f)

  @checked
  @compiled
  def encode(self, x, key=None) -> Payload:
    return self.inner.encode(self.rotate(x).astype(x.dtype), key)

  @compiled
  def decode(self, payload: Payload) -> jax.Array:
    return self.unrotate(self.inner.decode(payload)).astype(payload.dtype)

  def wire_bytes(self, shape, dtype) -> int:
    self.block_for(shape[-1])
    return self.inner.wire_bytes(shape, dtype)
