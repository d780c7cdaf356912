"""Per-channel scaling around any codec: a scale per channel, then the inner codec's own scales.

The sender measures c_f = sqrt(mean x[..., f]^2), the root mean square of each channel over every leading
axis (finite entries; 1 where a channel has none or is all zero), sends c (one fp32 per feature of the
last axis) beside C(x / c), and the receiver decodes x_hat = c * C^-1(C(x / c)). Inside, every channel
has unit RMS, so a scale per token or per group of features (`maxabs:B:group=G`) no longer follows the
few channels that are tens of times larger than the rest (outlier channels), while a token that is
large in a channel (a massive activation) stays large there and sets only its own token's scale: with
the inner codec's per-token scales the code has a scale along both axes. The RMS rather than the max:
a channel's max is set by its massive tokens, and dividing by it would shrink the channel's other
entries below the inner codec's step. Non-finite entries pass to the inner codec unchanged.
"""
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp.compress import packing
from jaxcomp.compress.codecs import Codec, Payload, checked, compiled
from jaxcomp.compress.codecs.base import ratio


class ChannelScaled(NamedTuple):
  """`channel+CODEC`'s message: `inner`, the inner codec's payload of x / c; `scale`, the bit patterns of
  c, fp32 [F] (uint32)."""
  inner: Payload
  scale: jax.Array


def channel_scales(x) -> jax.Array:
  """c_f = sqrt(mean of x[..., f]^2 over the finite entries) (float32 [F]); 1 where that is 0 or there is
  no finite entry."""
  a = x.astype(jnp.float32)
  finite = jnp.isfinite(a)
  axes = tuple(range(x.ndim - 1))
  top = jnp.max(jnp.where(finite, jnp.abs(a), 0.0), axis=axes)  # squares taken of a / top: no overflow
  unit = ratio(jnp.where(finite, a, 0.0), top)
  c = top * jnp.sqrt(jnp.sum(unit * unit, axis=axes) / jnp.maximum(jnp.sum(finite, axis=axes), 1))
  return jnp.where(c > 0, c, 1.0)


@dataclasses.dataclass(frozen=True)
class ChannelScale(Codec):
  """C'(x) = c * C(x / c), c the per-channel RMS of x (sent: 4 bytes per feature); wire bytes are the
  inner codec's plus 4 F."""
  inner: Codec

  def __post_init__(self):
    if not isinstance(self.inner, Codec):
      raise ValueError(f"ChannelScale wraps a Codec, got {self.inner!r}")

  @checked
  @compiled
  def encode(self, x, key=None) -> Payload:
    c = channel_scales(x)
    inner = self.inner.encode(ratio(x.astype(jnp.float32), c).astype(x.dtype), key)  # exact for c > 2^126 too
    return Payload(ChannelScaled(inner, packing.as_bits(c)), tuple(x.shape), x.dtype)

  @compiled
  def decode(self, payload: Payload) -> jax.Array:
    c = packing.from_bits(payload.arrays.scale, jnp.float32)
    return (self.inner.decode(payload.arrays.inner).astype(jnp.float32) * c).astype(payload.dtype)

  def wire_bytes(self, shape, dtype) -> int:
    return self.inner.wire_bytes(shape, dtype) + 4 * shape[-1]
