"""Per-channel scaling around any codec: a scale per channel, then the inner codec's own scales.

The sender measures c_f = max |x[..., f]| over every leading axis (finite entries; 1 where a channel
has none or is all zero), sends c (one fp32 per feature of the last axis) beside C(x / c), and the
receiver decodes x_hat = c * C^-1(C(x / c)). Inside, every channel has max |x / c| = 1, so a scale
per token or per group of features (`maxabs:B:group=G`) no longer follows the few channels that are
tens of times larger than the rest (outlier channels): with the inner codec's per-token scales the
code has a scale along both axes. Non-finite entries pass to the inner codec unchanged (inf / c = inf).
"""
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp.compress import packing
from jaxcomp.compress.codecs import Codec, Payload, compiled


class ChannelScaled(NamedTuple):
  """`channel+CODEC`'s message: `inner`, the inner codec's payload of x / c; `scale`, the bit patterns of
  c, fp32 [F] (uint32)."""
  inner: Payload
  scale: jax.Array


def channel_scales(x) -> jax.Array:
  """c_f = max over finite |x[..., f]| (float32 [F]), 1 where that is 0 or there is no finite entry."""
  a = jnp.abs(x.astype(jnp.float32))
  c = jnp.max(jnp.where(jnp.isfinite(a), a, 0.0), axis=tuple(range(x.ndim - 1)))
  return jnp.where(c > 0, c, 1.0)


@dataclasses.dataclass(frozen=True)
class ChannelScale(Codec):
  """C'(x) = c * C(x / c), c the per-channel max |x| (sent: 4 bytes per feature); wire bytes are the
  inner codec's plus 4 F."""
  inner: Codec

  def __post_init__(self):
    if not isinstance(self.inner, Codec):
      raise ValueError(f"ChannelScale wraps a Codec, got {self.inner!r}")

  @compiled
  def encode(self, x, key=None) -> Payload:
    c = channel_scales(x)
    inner = self.inner.encode((x.astype(jnp.float32) / c).astype(x.dtype), key)
    return Payload(ChannelScaled(inner, packing.as_bits(c)), tuple(x.shape), x.dtype)

  @compiled
  def decode(self, payload: Payload) -> jax.Array:
    c = packing.from_bits(payload.arrays.scale, jnp.float32)
    return (self.inner.decode(payload.arrays.inner).astype(jnp.float32) * c).astype(payload.dtype)

  def wire_bytes(self, shape, dtype) -> int:
    return self.inner.wire_bytes(shape, dtype) + 4 * shape[-1]
