"""Randomized Hadamard rotation around any codec: spreads outliers before quantizing.

Along the last (feature) axis, in blocks of n = 2^m features, the sender sends
C(R x) with R = H D: D = diag(+-1) random signs, H the orthonormal Walsh-Hadamard matrix
(H = H^T = H^-1, entries +-n^-1/2). The receiver decodes and undoes it: x_hat = D H C(R x).
R is orthogonal, so ||x - x_hat||_2 = ||R x - C(R x)||_2: any error bound of the inner codec
in the 2-norm holds unchanged, while a max-abs scale now sees max|R x| ~ ||x||_2 sqrt(2 ln n / n)
instead of one outlier. H is applied as two small matmuls of Sylvester's factors (`fwht`), not
an n x n matrix. The signs come from a seed in the spec that both ends know: nothing extra is sent.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.compress.codecs import Codec, Payload, checked, compiled


def sylvester(n: int) -> np.ndarray:
  """The n x n Walsh-Hadamard matrix of +-1 entries (n a power of two): H_1 = [1], H_2k = [[H_k, H_k], [H_k, -H_k]]."""
  h = np.ones((1, 1), np.float32)
  while len(h) < n:
    h = np.block([[h, h], [h, -h]])
  return h


def fwht(x: jax.Array) -> jax.Array:
  """Orthonormal Walsh-Hadamard transform of the last axis (a power of two n = a b): H x, H = H^-1.

  Sylvester's H_n = H_a (x) H_b, so with x viewed as an a x b matrix X (row-major), H_n x = H_a X H_b: two
  small matmuls (a, b ~ sqrt(n); 2 (a + b) FLOPs per element) that compile to two passes over memory, where the
  m = log2 n butterfly stages of the fast transform would each be one. Full-precision products (an fp32 matmul is
  otherwise bf16 or tf32 on TPU and GPU), so that the receiver's H undoes the sender's to fp32 rounding."""
  n = x.shape[-1]
  if n & (n - 1) or n == 0:
    raise ValueError(f"the Hadamard transform needs a power-of-two length, got {n}")
  a = 1 << ((n.bit_length() - 1) // 2)
  b = n // a
  h_a, h_b = (jnp.asarray(sylvester(k) * k ** -0.5, jnp.float32) for k in (a, b))
  y = jnp.einsum("ij,...jk,kl->...il", h_a, x.reshape(*x.shape[:-1], a, b), h_b,
                 precision=jax.lax.Precision.HIGHEST)
  return y.reshape(x.shape).astype(x.dtype)


def _laid_out(x):
  """x materialised in its own shape between the rotation and the inner codec: otherwise XLA:TPU lays the inner
  codec's work out in the rotation's [..., a, b] view, whose minor axis of b = 16 or 32 it pads to 128 lanes
  (`hadamard+maxabs:4:group=64:stoch` compiled for v5e: a decode of 29 passes over GPT-2 small's activation)."""
  return jax.lax.optimization_barrier(x)


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
    return self.inner.encode(_laid_out(self.rotate(x).astype(x.dtype)), key)

  @compiled
  def decode(self, payload: Payload) -> jax.Array:
    return self.unrotate(_laid_out(self.inner.decode(payload))).astype(payload.dtype)

  def wire_bytes(self, shape, dtype) -> int:
    self.block_for(shape[-1])
    return self.inner.wire_bytes(shape, dtype)
