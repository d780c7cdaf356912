"""Max-abs scales along the axis that errs less, chosen by the sender for each message.

Two B-bit max-abs codes of the same grid and clip rules:
  P = `maxabs:B`, one scale per channel (last axis) over every token;
  G = `maxabs:B:group=G:scales=both`, each channel divided by its RMS c, then one scale per group of G
      features of each token (scales along both axes).
Neither wins everywhere (docs/results/quantizer_grids.md): G keeps the small channels beside outlier channels and follows
each token on gradients; P fits each channel's own range on activations without outliers at 2-3 bits,
where no per-token code can match it. The sender decodes each (nearest rounding) and sends the one whose
error is least by the mean over channels of each channel's relative error,
  e(y) = mean_c ||y_c - x_c||^2 / ||x_c||^2,
G on a tie; a byte says which. Every channel weighs the same, as for a next stage that rescales its channels
(LayerNorm's gains; the outlier model reads its outlier channels divided by their gain): the total squared
error lets the few large channels decide, and on the outlier model it sent codes that lost small channels'
token-to-token variation (errors up to 269x it, by the channel mean) and a seed stalled (docs/results/quantizer_grids.md).
With grid=auto, G is also tried on each fixed grid (its per-group grid is chosen on x / c, weighed unlike e),
sent in grid=auto's form (the sign bits). Both codes are B bits an entry, so the message has one size: the
codes, F fp32 channel words (P's scales or G's c), G's group scales (zeros under P) and the byte. Each
channel's error is taken on x_c / 2^E_c (2^E_c the power of two of max|x_c|), so the choice is the same for x
and x * 2^k; a message with a non-finite entry takes P.
"""
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp.compress import packing
from jaxcomp.compress.channel_scale import ChannelScale, ChannelScaled
from jaxcomp.compress.codecs import AUTO_GRID, MAXABS_GRIDS, Codec, MaxAbsQuant, Payload, checked, compiled
from jaxcomp.compress.codecs.quantizers import unit_scaled
from jaxcomp.compress.codecs.wire import Quantized


class AxisChosen(NamedTuple):
  """`ScaleAxes`' message: `codes`, the B-bit codes of the chosen code; `channel`, fp32 [F] bit patterns (P's
  scales, or G's channel RMS); `groups`, G's group scales (zeros when P is sent); `grouped`, uint8 [1]: 1 for G."""
  codes: jax.Array
  channel: jax.Array
  groups: jax.Array
  grouped: jax.Array


def _channel_mean_error(x32, y32):
  """Mean over channels (the last axis) of ||y_c - x_c||^2 / ||x_c||^2, each channel taken over its own
  x_c / 2^E_c and y_c / 2^E_c, 2^E_c the power of two of max|x_c| (`unit_scaled`: exact, so no square overflows
  or flushes to 0 at any magnitude). A channel of zeros counts 0 if decoded as zeros, else inf."""
  top_F = jnp.max(jnp.abs(x32.reshape(-1, x32.shape[-1])), axis=0)
  x_u, _ = unit_scaled(x32, top_F)
  y_u, _ = unit_scaled(y32, top_F)
  axes = tuple(range(x32.ndim - 1))
  error_F, energy_F = jnp.sum(jnp.square(y_u - x_u), axis=axes), jnp.sum(jnp.square(x_u), axis=axes)
  ratio_F = jnp.where(energy_F > 0, error_F / jnp.where(energy_F > 0, energy_F, 1.0),
                      jnp.where(error_F > 0, jnp.inf, 0.0))
  return jnp.mean(ratio_F)


@dataclasses.dataclass(frozen=True)
class ScaleAxes(Codec):
  """`maxabs:B:group=G` (`scales=auto`, the default): per message, G = RMS per channel times a scale per group
  of G features, or P = one scale per channel, whichever errs less (mean over channels of each channel's
  relative error; module docstring).
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

  def _candidates(self) -> list[Codec]:
    """The codes the sender tries, G first (ties go to G): G; with grid=auto, G on each fixed grid too (G
    picks a grid per group by its error on x / c, which weighs the group's channels unlike x's own error,
    so a fixed grid can err less in x); P last."""
    grids = [self.grouped]
    if self.grouped.grid == AUTO_GRID:
      grids += [dataclasses.replace(self.grouped, grid=grid) for grid in MAXABS_GRIDS]
    return [ChannelScale(g) for g in grids] + [self.per_channel]

  def _message(self, codec, payload, groups_like):
    """(codes, fp32 channel words, group scales as grid=auto reads them: midrise's sign bit set; zeros for P)
    of a candidate."""
    if isinstance(codec, MaxAbsQuant):
      channel = packing.from_bits(payload.arrays.scale, self._scale_dtype).astype(jnp.float32)
      return payload.arrays.codes, packing.as_bits(channel), jnp.zeros_like(groups_like)
    inner = payload.arrays.inner.arrays
    groups = packing.from_bits(inner.scale, self._scale_dtype)
    if codec.inner.grid == "midrise" and self.grouped.grid == AUTO_GRID:
      groups = -groups
    return inner.codes, payload.arrays.scale, packing.as_bits(groups)

  @checked
  @compiled
  def encode(self, x, key=None) -> Payload:
    codecs = self._candidates()
    near = ScaleAxes(dataclasses.replace(self.grouped, stochastic=False))._candidates()  # the choice's rounding
    tried = [c.encode(x) for c in near]
    x32 = x.astype(jnp.float32)
    errors = jnp.stack([_channel_mean_error(x32, c.decode(p).astype(jnp.float32)) for c, p in zip(near, tried)])
    errors = jnp.where(jnp.isfinite(errors), errors, jnp.inf)
    pick = jnp.where(jnp.all(jnp.isfinite(x32)), jnp.argmin(errors), len(codecs) - 1)  # non-finite: P
    groups_like = tried[0].arrays.inner.arrays.scale  # G's group scales' bits
    if self.grouped.stochastic:  # only the chosen code is drawn
      codes, channel, groups = jax.lax.switch(
          pick, [lambda c=c: self._message(c, c.encode(x, key), groups_like) for c in codecs])
    else:
      parts = [self._message(c, p, groups_like) for c, p in zip(codecs, tried)]
      codes, channel, groups = (jnp.stack([part[i] for part in parts])[pick] for i in range(3))
    return Payload(AxisChosen(codes, channel, groups, (pick < len(codecs) - 1).astype(jnp.uint8)[None]),
                   tuple(x.shape), x.dtype)

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
