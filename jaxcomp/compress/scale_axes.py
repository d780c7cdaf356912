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
from jaxcomp.compress.channel_scale import ChannelScale, ChannelScaled, channel_scales
from jaxcomp.compress.codecs import AUTO_GRID, MAXABS_GRIDS, Codec, MaxAbsQuant, Payload, checked, compiled
from jaxcomp.compress.codecs.base import ratio
from jaxcomp.compress.codecs.quantizers import unit_scaled
from jaxcomp.compress.codecs.wire import Quantized


class AxisChosen(NamedTuple):
  """`ScaleAxes`' message: `codes`, the B-bit codes of the chosen code; `channel`, fp32 [F] bit patterns (P's
  scales, or G's channel RMS); `groups`, G's group scales (zeros when P is sent); `grouped`, uint8 [1]: 1 for G."""
  codes: jax.Array
  channel: jax.Array
  groups: jax.Array
  grouped: jax.Array


def _summed(terms, axes):
  """Each term summed over `axes`, in one reduction (one read of what the terms are computed from): on TPU the
  terms as one variadic reduce (XLA:TPU lays a stack of them out apart), elsewhere their stack, one reduction of
  [K, ...] (XLA:GPU fuses the terms' computation into it; a variadic reduce there, or K sums, moves more).
  docs/results/codecs_compiled.md has the traffic of each."""
  one = lambda: jax.lax.reduce(tuple(terms), (jnp.float32(0),) * len(terms),
                               lambda a, b: tuple(p + q for p, q in zip(a, b)), axes)
  stacked = lambda: tuple(jnp.sum(jnp.stack(terms), axis=tuple(a + 1 for a in axes)))
  return jax.lax.platform_dependent(tpu=one, default=stacked)


def _channel_mean_errors(x32, values, axes):
  """For each decoded y in `values`: the mean over channels (every axis but `axes`) of ||y_c - x_c||^2 / ||x_c||^2,
  each channel taken over its own x_c / 2^E_c and y_c / 2^E_c, 2^E_c the power of two of max|x_c|
  (`unit_scaled`: exact, so no square overflows or flushes to 0 at any magnitude). A channel of zeros counts 0
  if decoded as zeros, else inf."""
  top = jnp.max(jnp.abs(x32), axis=axes)
  x_u, _ = unit_scaled(x32, top)
  *error_KxC, energy = _summed([jnp.square(unit_scaled(y, top)[0] - x_u) for y in values] + [jnp.square(x_u)], axes)
  error_KxC = jnp.stack(error_KxC)
  ratio_KxC = jnp.where(energy > 0, error_KxC / jnp.where(energy > 0, energy, 1.0),
                        jnp.where(error_KxC > 0, jnp.inf, 0.0))
  return jnp.mean(ratio_KxC.reshape(len(values), -1), axis=1)


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

  def _grouped_candidates(self) -> list[MaxAbsQuant]:
    """G's inner codes the sender tries, ties to the first: G's own; with grid=auto, G on each fixed grid too (G
    picks a grid per group by its error on x / c, which weighs the group's channels unlike x's own error, so a
    fixed grid can err less in x). P is tried last."""
    if self.grouped.grid != AUTO_GRID:
      return [self.grouped]
    return [self.grouped] + [dataclasses.replace(self.grouped, grid=grid) for grid in MAXABS_GRIDS]

  @checked
  @compiled
  def encode(self, x, key=None) -> Payload:
    """Every candidate's scales from one look at x, each decoded in G's view of x (one layout throughout), their
    errors summed together, and the chosen one's codes sent (under :stoch, drawn for that one alone)."""
    view, x32 = self.grouped.view_shape(x.shape), x.astype(jnp.float32)
    c = channel_scales(x)
    u_v = ratio(x32, c).astype(x.dtype).astype(jnp.float32).reshape(view)  # G's input, as ChannelScale codes it
    x_v, c_v = x32.reshape(view), c.reshape(view[-2:])
    per_channel = self.per_channel
    p_scale, p_f = per_channel.choose_scale(x32)
    in_view = lambda a: a.reshape(view[-2:]) if isinstance(a, jax.Array) else a  # P's [F] scales over G's view
    grouped = [(g, *g.choose_scale(u_v)) for g in self._grouped_candidates()]
    nearest = lambda q: dataclasses.replace(q, stochastic=False)  # the choice's rounding
    near = [nearest(g).rounded(u_v, s, f) for g, s, f in grouped]
    p_near = nearest(per_channel).rounded(x_v, in_view(p_scale), in_view(p_f))
    as_sent = lambda v: v.astype(x.dtype).astype(jnp.float32)  # each decoded as its own decode does
    values = [as_sent(as_sent(y) * c_v) for _, y in near] + [as_sent(p_near[1])]
    errors = _channel_mean_errors(x_v, values, tuple(range(len(view) - 2)))
    errors = jnp.where(jnp.isfinite(errors), errors, jnp.inf)
    finite = (jnp.sum(jnp.isfinite(x32), axis=tuple(range(x.ndim - 1)))  # the counts channel_scales takes
              == x.size // x.shape[-1])
    pick = jnp.where(jnp.all(finite), jnp.argmin(errors), len(values) - 1)  # non-finite: P
    narrow = lambda codes: codes.astype(packing.code_dtype(self.grouped.bits))
    if self.grouped.stochastic:  # only the chosen code is drawn, on the shape it is drawn on alone
      codes = jax.lax.switch(pick, [lambda g=g, s=s, f=f: narrow(g.rounded(u_v, s, f, key)[0]) for g, s, f in grouped]
                             + [lambda: narrow(per_channel.rounded(x32, p_scale, p_f, key)[0]).reshape(view)])
    else:
      codes = jnp.select([pick == k for k in range(len(grouped))], [narrow(codes) for codes, _ in near],
                         narrow(p_near[0]))
    group_scales = [packing.as_bits(self.grouped.sent_scale(s, f)) for _, s, f in grouped]  # in G's own form
    channel = packing.as_bits(per_channel.sent_scale(p_scale, p_f).astype(jnp.float32))
    groups = jnp.stack(group_scales + [jnp.zeros_like(group_scales[0])])[pick]
    channel = jnp.where(pick < len(grouped), packing.as_bits(c), channel)
    return Payload(AxisChosen(packing.pack(codes, self.grouped.bits), channel, groups,
                              (pick < len(grouped)).astype(jnp.uint8)[None]), tuple(x.shape), x.dtype)

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
