"""Max-abs scales along the axis that errs less, chosen by the sender for each message.

Two B-bit max-abs codes of the same grid and clip rules:
  P = `maxabs:B`, one scale per channel (last axis) over every token;
  G = `maxabs:B:group=G:scales=both`, each channel divided by its RMS c, then one scale per group of G
      features of each token (scales along both axes).
Neither wins everywhere (docs/grids.md): G keeps the small channels beside outlier channels and follows
each token on gradients; P fits each channel's own range on activations without outliers at 2-3 bits,
where no per-token code can match it. The sender decodes both (nearest rounding) and sends G's message
when its squared error ||x_hat - x||^2, summed over the tensor, is no more than P's, and P's otherwise; a
byte says which. Both codes are B bits an entry, so the message has one size: the codes, F fp32 channel
words (P's scales or G's c), G's group scales (zeros under P) and the byte. The errors are summed over
x / 2^E (2^E the power of two of max|x|), so the choice is the same for x and x * 2^k; a message with a
non-finite entry takes P. The total error decides, not the mean over channels of each channel's relative
error: where the two disagree (outlier channels and massive tokens together) G errs up to 1.2x more by
that mean and about 0.2-0.8x as much in total (docs/grids.md).
"""
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp.compress import packing
from jaxcomp.compress.channel_scale import ChannelScale, ChannelScaled
from jaxcomp.compress.codecs import Codec, MaxAbsQuant, Payload, compiled
from jaxcomp.compress.codecs.wire import Quantized


class AxisChosen(NamedTuple):
  """`ScaleAxes`' message: `codes`, the B-bit codes of the chosen code; `channel`, fp32 [F] bit patterns (P's
  scales, or G's channel RMS); `groups`, G's group scales (zeros when P is sent); `grouped`, uint8 [1]: 1 for G."""
  codes: jax.Array
  channel: jax.Array
  groups: jax.Array
  grouped: jax.Array


def _squared_error(x32, y32):
  """||y - x||^2 summed, taken on x / 2^E and y / 2^E, 2^E the power of two of max|x| (exact, so no square
  overflows or flushes to 0 at any magnitude; E kept within fp32's normal exponents)."""
  top = jnp.max(jnp.abs(x32))
  e = jnp.clip(jnp.floor(jnp.log2(jnp.where(top > 0, top, 1.0))), -126, 126)  # 2^-e a normal number
  unit = jnp.exp2(-e)
  d_u = (y32 - x32) * unit
  return jnp.sum(d_u * d_u)


@dataclasses.dataclass(frozen=True)
class ScaleAxes(Codec):
  """`maxabs:B:group=G` (`scales=auto`, the default): per message, G = RMS per channel times a scale per group
  of G features, or P = one scale per channel, whichever errs less (squared error; module docstring).
  `grouped` is G's inner code (a `MaxAbsQuant` with granularity="group"); P takes its bits and rules."""
  grouped: MaxAbsQuant

  def __post_init__(self):
    if not isinstance(self.grouped, MaxAbsQuant) or self.grouped.granularity != "group":
      raise ValueError(f"ScaleAxes chooses between channel scales and groups of a grouped MaxAbsQuant, got "
                       f"{self.grouped!r}")

  @property
  def per_channel(self) -> MaxAbsQuant:
    return dataclasses.replace(self.grouped, granularity="channel", group=None)

  @property
  def both_axes(self) -> ChannelScale:
    return ChannelScale(self.grouped)

  @property
  def _scale_dtype(self):
    """P's scales travel as fp32 words whatever their dtype (exact; the sign bit, grid=auto's choice, kept)."""
    return jnp.dtype(self.grouped.scale_dtype)

  def _nearest(self, codec):
    """The same code under nearest rounding (what the choice is measured with)."""
    if isinstance(codec, ChannelScale):
      return ChannelScale(dataclasses.replace(codec.inner, stochastic=False))
    return dataclasses.replace(codec, stochastic=False)

  @compiled
  def encode(self, x, key=None) -> Payload:
    p_codec, g_codec = self.per_channel, self.both_axes
    p, g = p_codec.encode(x, key), g_codec.encode(x, key)
    if self.grouped.stochastic:
      p_near, g_near = self._nearest(p_codec).encode(x), self._nearest(g_codec).encode(x)
    else:
      p_near, g_near = p, g
    x32 = x.astype(jnp.float32)
    e_p = _squared_error(x32, p_codec.decode(p_near).astype(jnp.float32))
    e_g = _squared_error(x32, g_codec.decode(g_near).astype(jnp.float32))
    use_g = (e_g <= e_p) & jnp.all(jnp.isfinite(x32))
    g_inner = g.arrays.inner.arrays
    p_channel = packing.as_bits(packing.from_bits(p.arrays.scale, self._scale_dtype).astype(jnp.float32))
    return Payload(AxisChosen(codes=jnp.where(use_g, g_inner.codes, p.arrays.codes),
                              channel=jnp.where(use_g, g.arrays.scale, p_channel),
                              groups=jnp.where(use_g, g_inner.scale, jnp.zeros_like(g_inner.scale)),
                              grouped=use_g.astype(jnp.uint8)[None]), tuple(x.shape), x.dtype)

  @compiled
  def decode(self, payload: Payload) -> jax.Array:
    a = payload.arrays
    shape, dtype = payload.shape, payload.dtype
    p_scale = packing.as_bits(packing.from_bits(a.channel, jnp.float32).astype(self._scale_dtype))
    p = Payload(Quantized(a.codes, scale=p_scale), shape, dtype)
    g = Payload(ChannelScaled(Payload(Quantized(a.codes, scale=a.groups), shape, dtype), a.channel), shape, dtype)
    return jnp.where(a.grouped[0] > 0, self.both_axes.decode(g), self.per_channel.decode(p))

  def wire_bytes(self, shape, dtype) -> int:
    return self.both_axes.wire_bytes(shape, dtype) + 1
