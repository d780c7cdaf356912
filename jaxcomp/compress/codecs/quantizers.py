"""Quantizers: every entry as a B-bit code on a grid, bit-packed, with the grid's range or scales.

`MinMaxQuant` spans the tensor's [min, max] (Rudakov et al.); `MaxAbsQuant` a symmetric grid of max|x|
per tensor, channel or group (AQ-SGD's family), with a zero or mid-rise grid, or per scale the better
of both, and an optional clip. Why these grids and defaults, with the figures: docs/results/quantizer_grids.md.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.arguments import is_integer, is_number
from jaxcomp.compress import packing
from jaxcomp.compress.codecs.base import Codec, checked, compiled, num_entries, ratio
from jaxcomp.compress.codecs.wire import Payload, Quantized


def _nan_where_nan(v, x, axis=None):
  """v, NaN where the entries of x that v summarises (over `axis`) hold a NaN.

  XLA's min/max reductions may skip NaN (XLA:CPU does on larger arrays), so a range or scale
  taken by them alone would hide it from the receiver; `any(isnan)` is an OR, which cannot.
  """
  return jnp.where(jnp.any(jnp.isnan(x), axis=axis), jnp.nan, v)


def _round(y, stochastic: bool, key):
  """Nearest rounding, or floor(y + u), u ~ U[0,1) (unbiased: E = y)."""
  if not stochastic:
    return jnp.round(y)
  if key is None:
    raise ValueError("stochastic rounding needs a PRNG key, got key=None")
  return jnp.floor(y + jax.random.uniform(key, y.shape, jnp.float32))


def _power_of_two(k):
  """2.0^k in float32, exactly, for integers k in [-126, 127] (built from its bits)."""
  return jax.lax.bitcast_convert_type((k + 127) << 23, jnp.float32)


def unit_scaled(x32, s, expand=lambda v: v):
  """(x, s) both times 2^-E, E the exponent of s (s = m 2^E, 1 <= m < 2; E = 0 for s = 0, inf or NaN): s / 2^E
  in [1, 2). Multiplying by a power of two is exact, and done in two halves so every factor is a normal fp32."""
  biased = (jax.lax.bitcast_convert_type(s, jnp.int32) >> 23) & 0xFF
  k = jnp.where((biased > 0) & (biased < 255), 127 - biased, 0)  # -E
  half = k // 2
  times = lambda v, kk: v * _power_of_two(kk)
  return (times(times(x32, expand(half)), expand(k - half)), times(times(s, half), k - half))


def _tiny_range_factor(lo, hi):
  """2^64 when |lo|, |hi| < 2^-40, else 1: an exact rescaling that keeps tiny ranges (down to
  fp32's smallest normal spacing) out of the denormals that XLA flushes to zero."""
  return jnp.where(jnp.maximum(jnp.abs(lo), jnp.abs(hi)) < 2.0**-40, 2.0**64, 1.0)


@dataclasses.dataclass(frozen=True)
class MinMaxQuant(Codec):
  """Min-max k-bit quantization of the whole tensor (Rudakov et al.).

  levels = 2^bits - 1, codes c = round((x - lo) / (hi - lo) * levels) in [0, levels],
  x_hat = lo + c * (hi - lo) / levels, so |x - x_hat| <= (hi - lo) / (2 levels).
  Sends the packed codes plus (lo, hi) in fp32. Arithmetic on halves avoids overflow for
  |x| up to the fp32 maximum, and tiny tensors are rescaled by 2^64 so ranges below 1e-37
  keep the bound; a constant tensor decodes exactly; a NaN makes lo and hi NaN (x_hat all NaN).
  """
  bits: int = 8
  stochastic: bool = False

  def __post_init__(self):
    packing.check_bits(self.bits)

  @property
  def levels(self) -> int:
    return (1 << self.bits) - 1

  @checked
  @compiled
  def encode(self, x, key=None):
    x32 = x.astype(jnp.float32)
    lo, hi = _nan_where_nan(jnp.min(x32), x32), _nan_where_nan(jnp.max(x32), x32)
    up = _tiny_range_factor(lo, hi)
    half_range = 0.5 * (hi * up) - 0.5 * (lo * up)
    y = ratio(0.5 * (x32 * up) - 0.5 * (lo * up), half_range) * self.levels
    codes = jnp.clip(_round(y, self.stochastic, key), 0, self.levels)
    packed = packing.pack(codes, self.bits)
    return Payload(Quantized(packed, lo=lo, hi=hi), x.shape, x.dtype)

  @compiled
  def decode(self, payload):
    a = payload.arrays
    codes = packing.unpack(a.codes, self.bits, tuple(payload.shape))
    up = _tiny_range_factor(a.lo, a.hi)
    half_step = (0.5 * (a.hi * up) - 0.5 * (a.lo * up)) * (codes.astype(jnp.float32) / self.levels)
    return (((a.lo * up + half_step) + half_step) / up).astype(payload.dtype)

  def wire_bytes(self, shape, dtype):
    return packing.packed_size(num_entries(shape), self.bits) + 2 * 4


_SCALE_DTYPES = ("float32", "bfloat16", "float16")
_CLIP_CANDIDATES = tuple(1.0 - 0.75 * (j / 24) ** 2 for j in range(25))  # clip="mse": r in [0.25, 1], dense near 1
MAXABS_GRIDS = ("zero", "midrise")
AUTO_GRID = "auto"  # per scale, whichever of MAXABS_GRIDS errs least; flagged in the sign bit of the scale
# bits -> (grid, clip) that a MaxAbsQuant takes where it names none (else the zero grid, unclipped); how each
# was chosen: docs/results/quantizer_grids.md
MAXABS_DEFAULTS = {2: (AUTO_GRID, "mse"), 3: (AUTO_GRID, "mse"), 4: (AUTO_GRID, 1.0)}


def maxabs_defaults(bits: int) -> tuple[str, float | str]:
  """(grid, clip) of `maxabs:BITS` when the spec names neither."""
  return MAXABS_DEFAULTS.get(bits, ("zero", 1.0))


@dataclasses.dataclass(frozen=True)
class MaxAbsQuant(Codec):
  """Max-abs B-bit quantization on a symmetric grid (AQ-SGD's quantizer family).

  s = max|x| per tensor, per channel (last axis; shared over batch and sequence), or per
  group (granularity="group": one scale per `group` consecutive features of each row, the
  "tile" scales of TAH-Quant). The grid is {-D, -D+1, ..., D} * s/D (`levels` = D):
  * grid="zero": D = 2^(B-1) - 1, 2^B - 1 points, one code unused (B >= 2). 0 decodes to exactly
    0 (ReLU zeros, TopK-style sparsity and AQ-SGD's unchanged entries cost no error).
  * grid="midrise": D = (2^B - 1)/2, all 2^B codes: the points +-(2j-1) s/(2^B-1), j = 1..2^(B-1)
    (B >= 1; 1 bit is sign(x) s). One level more, symmetric (so unbiased under stochastic rounding,
    unlike the AQ-SGD authors' {-2^(B-1)..2^(B-1)-1} s/2^(B-1)), but no point at 0: nearest rounding
    sends 0 to +s/(2^B-1), and stochastic rounding gives an entry near 0 the variance (s/(2^B-1))^2
    (the zero grid: about |x| s/D).
  * grid="auto": per scale, whichever of the two errs least (squared error, deterministic rounding;
    ties: zero). A scale holding an outlier takes the zero grid, whose 0 keeps the scale's small
    entries at 0 instead of +-s/(2^B-1); an outlier-free scale takes midrise's extra level. The
    choice travels in the sign bit of the scale, which max|x| >= 0 leaves free: no byte.
  Code c = clip(round(x/s D - f) + f + D, 0, 2D), f = D - floor(D), x_hat = (c - D)/D s: nearest
  point, |x - x_hat| <= s/(2D) for |x| <= s, x_hat(-x) = -x_hat(x) but at exact midrise ties
  (0 included). Codes are bit-packed in B bits. `clip` < 1 sends s = clip * max|x| instead
  (entries beyond saturate at +-s); clip="mse" picks, per scale, the ratio in [0.25, 1] with
  the least squared error (deterministic rounding decides), computed on x / 2^E (2^E the power of
  two of max|x|), so the same ratio at any magnitude. The receiver only sees the scale.
  `grid` and `clip` left out (None) take the bit width's default, `maxabs_defaults(B)`. Scales are fp32 by default (any
  finite magnitude round-trips); bf16/fp16 scales are rounded up so nothing clips unasked
  (fp16 overflows above 65504: the inf shows in the output). Stochastic rounding: E[x_hat] = x
  for |x| <= s. +-inf decodes to +-inf (other entries of its scale group become NaN); NaN
  makes its whole scale group NaN. Measured errors of each grid and default: docs/results/quantizer_grids.md.
  """
  bits: int = 4
  granularity: str = "channel"
  stochastic: bool = False
  scale_dtype: str = "float32"
  clip: float | str | None = None  # None: the bit width's default
  group: int | None = None  # features per scale, with granularity="group"
  grid: str | None = None  # "zero" | "midrise" | "auto"; None: the bit width's default

  def __post_init__(self):
    packing.check_bits(self.bits)
    for name, default in zip(("grid", "clip"), maxabs_defaults(self.bits)):
      if getattr(self, name) is None:
        object.__setattr__(self, name, default)  # frozen: resolved once, so equal codecs compare equal
    if self.grid not in (*MAXABS_GRIDS, AUTO_GRID):
      raise ValueError(f"maxabs grid must be one of {(*MAXABS_GRIDS, AUTO_GRID)}, got {self.grid!r}")
    if self.bits < 2 and self.grid in ("zero", AUTO_GRID):
      raise ValueError(f"maxabs needs bits >= 2 on the zero grid and with grid=auto (a symmetric grid with 0 has "
                       f"3 levels), got {self.bits}; use grid=midrise (1 bit: sign(x) s) or quant:1 for 1-bit min-max")
    if self.granularity not in ("tensor", "channel", "group"):
      raise ValueError(f"granularity must be 'tensor', 'channel' or 'group', got {self.granularity!r}")
    if (self.granularity == "group") != (self.group is not None):
      raise ValueError(f"group={self.group!r} goes with granularity='group' only (got {self.granularity!r})")
    if self.group is not None and (not is_integer(self.group) or self.group < 1):
      raise ValueError(f"group must be a positive number of features, got {self.group!r}")
    if self.scale_dtype not in _SCALE_DTYPES:
      raise ValueError(f"scale_dtype must be one of {_SCALE_DTYPES}, got {self.scale_dtype!r}")
    if self.clip != "mse" and (not is_number(self.clip) or not 0.0 < self.clip <= 1.0):
      raise ValueError(f"clip must be a ratio in (0, 1] or 'mse', got {self.clip!r}")

  @property
  def levels(self) -> float:
    """D of a fixed grid: {-D, -D+1, ..., D} * s / D (an integer on the zero grid, a half-integer on midrise).
    grid="auto" has one per scale (`grids`)."""
    if self.grid == AUTO_GRID:
      raise ValueError("grid='auto' picks D per scale: read the grids of a payload with `grids`")
    return self._levels(self._offset)

  def _levels(self, f):
    """D = 2^(B-1) - 1 + f for the grid offset f (0: zero grid, 1/2: midrise; a float or an array of them)."""
    return (1 << (self.bits - 1)) - 1 + f

  @property
  def _offset(self) -> float:
    """f = D - floor(D) of a fixed grid: 0 on the zero grid, 1/2 on midrise."""
    return 0.0 if self.grid == "zero" else 0.5

  def _scale_shape(self, shape):
    if self.granularity == "group":
      return self.view_shape(shape)[:-1]
    return (shape[-1],) if self.granularity == "channel" else ()

  def view_shape(self, shape):
    """The shape scales reduce over: groups split the last axis into [F/G, G]."""
    if self.granularity != "group":
      return tuple(shape)
    if shape[-1] % self.group:
      raise ValueError(f"maxabs group={self.group} does not divide the {shape[-1]} features of the last axis; "
                       f"pick a divisor of {shape[-1]}")
    return (*shape[:-1], shape[-1] // self.group, self.group)

  def _reduce_axes(self, x):
    if self.granularity == "group":
      return (x.ndim - 1,)
    return tuple(range(x.ndim - 1)) if self.granularity == "channel" else None

  def _expand(self, s):
    """A scale array broadcast against the (viewed) tensor."""
    return s[..., None] if self.granularity == "group" else s

  def _codes(self, x32, s32, f, stochastic, key):
    """Codes c in [0, 2D] of x on the grid of scale s and offset f: point (c - D)/D s."""
    d = self._levels(f)
    y = jnp.where(jnp.isinf(x32), jnp.sign(x32), ratio(x32, s32)) * d
    return jnp.clip(_round(y - f, stochastic, key) + (f + d), 0, 2 * d)

  def _grid(self, codes, s32, f):
    """(c - D)/D s; an interior point of an infinite scale is NaN (it is no number), its ends +-inf."""
    d = self._levels(f)
    k = codes - d
    return jnp.where(jnp.isinf(s32) & (jnp.abs(k) < d), jnp.nan, (k / d) * s32)

  def _least_error(self, x32, s, ratios, offsets):
    """(ratio, offset) per scale whose grid, deterministically rounded, errs least in squared error.

    The errors are summed over x / 2^E and s / 2^E, 2^E the power of two of s (`unit_scaled`): exact
    rescalings, so the choice is the same for x and x * c at any magnitude (at fp32's extremes the squares
    of x itself would overflow to inf or flush to 0, and every candidate would tie). Ties take the first
    ratio, then the zero grid."""
    axes = self._reduce_axes(x32)
    u, s_u = unit_scaled(x32, s, self._expand)

    def errors(f):
      def error(r):
        rs = self._expand(r * s_u)
        return jnp.sum(jnp.square(self._grid(self._codes(u, rs, f, False, None), rs, f) - u), axis=axes)
      # every ratio at once on GPU and TPU (one fused read of x instead of a pass per ratio); ratio by ratio on
      # CPU, where the loop keeps x in cache and runs about 2x faster (docs/results/codecs_compiled.md)
      return jax.lax.platform_dependent(jnp.asarray(ratios), cpu=lambda r: jax.lax.map(error, r),
                                        default=jax.vmap(error))

    per_grid = [errors(f) for f in offsets]  # each [ratios, scales]
    best = [jnp.argmin(e, axis=0) for e in per_grid]
    ratio = [jnp.asarray(ratios)[b] for b in best]
    if len(offsets) == 1:
      return ratio[0], offsets[0]
    least = [jnp.take_along_axis(e, b[None], axis=0)[0] for e, b in zip(per_grid, best)]
    midrise = least[1] < least[0]
    return jnp.where(midrise, ratio[1], ratio[0]), jnp.where(midrise, 0.5, 0.0)

  def choose_scale(self, x32):
    """(scale in `scale_dtype`, grid offset f) the sender picks for fp32 x in `view_shape`: s = max|x| times a fixed
    clip ratio or the least-error one; f the fixed grid's, or per scale (grid="auto") the grid of least error."""
    axes = self._reduce_axes(x32)
    s = _nan_where_nan(jnp.max(jnp.abs(x32), axis=axes), x32, axes)
    ratios = _CLIP_CANDIDATES if self.clip == "mse" else (self.clip,)
    offsets = (0.0, 0.5) if self.grid == AUTO_GRID else (self._offset,)
    if len(ratios) * len(offsets) > 1:
      ratio, f = self._least_error(x32, s, ratios, offsets)
      s = s * ratio
    else:
      f = offsets[0]
      if self.clip != 1.0:
        s = s * self.clip
    stored = s.astype(self.scale_dtype)
    return jnp.where(stored.astype(jnp.float32) < s, jnp.nextafter(stored, jnp.inf), stored), f

  def rounded(self, x32, scale, f, key=None) -> tuple[jax.Array, jax.Array]:
    """(codes c in [0, 2D] as fp32, the fp32 values (c - D)/D s they decode to) of fp32 x in `view_shape` on the
    grids of `choose_scale`'s (scale, f), or of any scales and offsets that broadcast against x alike."""
    f_x = self._expand(f) if self.grid == AUTO_GRID else f
    s32 = self._expand(scale.astype(jnp.float32))
    codes = self._codes(x32, s32, f_x, self.stochastic, key)
    return codes, self._grid(codes, s32, f_x)

  def sent_scale(self, scale, f):
    """The scale as the message holds it: grid="auto" flags midrise (f > 0) in its sign bit."""
    return jnp.where(f > 0, -scale, scale) if self.grid == AUTO_GRID else scale

  def grids(self, payload: Payload) -> tuple[jax.Array, jax.Array | float]:
    """(scales as fp32, grid offset f per scale) of a payload: f = 0 on the zero grid, 1/2 on midrise
    (grid="auto" sends f in the sign bit of each scale, which max|x| leaves 0: a set bit means midrise)."""
    stored = jax.lax.bitcast_convert_type(payload.arrays.scale, jnp.dtype(self.scale_dtype))
    if self.grid != AUTO_GRID:
      return stored.astype(jnp.float32), self._offset
    return jnp.abs(stored).astype(jnp.float32), jnp.where(jnp.signbit(stored), 0.5, 0.0)

  @checked
  @compiled
  def encode(self, x, key=None):
    x32 = x.astype(jnp.float32).reshape(self.view_shape(x.shape))
    scale, f = self.choose_scale(x32)
    codes, _ = self.rounded(x32, scale, f, key)
    return Payload(Quantized(packing.pack(codes, self.bits), scale=packing.as_bits(self.sent_scale(scale, f))),
                   x.shape, x.dtype)

  @compiled
  def decode(self, payload):
    a = payload.arrays
    codes = packing.unpack(a.codes, self.bits, self.view_shape(payload.shape))
    s32, f = self.grids(payload)
    f_x = self._expand(f) if self.grid == AUTO_GRID else f
    return self._grid(codes.astype(jnp.float32), self._expand(s32), f_x).reshape(payload.shape).astype(payload.dtype)

  def wire_bytes(self, shape, dtype):
    scales = num_entries(self._scale_shape(shape)) * np.dtype(jnp.dtype(self.scale_dtype)).itemsize
    return packing.packed_size(num_entries(shape), self.bits) + scales
