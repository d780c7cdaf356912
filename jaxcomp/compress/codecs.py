"""Stateless compressors C: encode to the bytes that travel, decode back.

Every codec is a frozen dataclass (hashable, so it is static under `jax.jit`: see `compiled`) with
  encode(x, key) -> Payload      the arrays that cross the link, nothing else
  decode(payload) -> x_hat       what the receiver reconstructs from those arrays alone
  wire_bytes(shape, dtype) -> int exact size of the payload, computed without running it
`codec(x, key)` is the round trip decode(encode(x)), i.e. the C(x) of the papers' math.
Tensors are [B, ...] with a leading example axis: non-empty and real floating-point, else
`encode` raises a ValueError naming the shape and dtype (`check_encodable`; integers would be
rounded, complex numbers would lose their imaginary part). NaN and +-inf reach the decoded
message on every codec, compiled or not: a NaN makes its scale, range or sent row NaN.
"""
import abc
import dataclasses
import functools
import math
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.compress import packing, selection

_CAST_DTYPES = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")


class Dense(NamedTuple):
  """Identity's message: `x`, the tensor itself."""
  x: jax.Array


class Narrow(NamedTuple):
  """Cast's and ScaledCast's message. `bits`: the narrow floats as their bit patterns, [shape] uint8 (fp8) or
  uint16 (16-bit); `scale` (ScaledCast): the fp32 scales' bit patterns, uint32 [] per tensor or [C] per channel."""
  bits: jax.Array
  scale: jax.Array | None = None


class Quantized(NamedTuple):
  """A quantizer's message. `codes`: the B-bit codes of every entry, packed into uint8 [ceil(n B / 8)];
  MinMaxQuant: `lo`, `hi`, the tensor's fp32 range; MaxAbsQuant: `scale`, the bit patterns of its scales (one per
  tensor, channel, example or group; uint32 for fp32, uint16 for 16-bit scales)."""
  codes: jax.Array
  lo: jax.Array | None = None
  hi: jax.Array | None = None
  scale: jax.Array | None = None


class Sparse(NamedTuple):
  """TopK's and RandK's message: `values` [R, k] of the kept entries of each of R rows (native dtype, bf16, or
  int8 codes with `scale`, each row's fp32 max |value|, for q8). Where they sit: `indices` [R, k] (uint8/16/32, the
  narrowest that holds F), or `mask`, a packed bitmask [R, ceil(F / 8)] (TopK, whichever is smaller); or `seed`, the
  uint32 [2] PRNG seed that regenerates them (RandK)."""
  values: jax.Array
  scale: jax.Array | None = None
  indices: jax.Array | None = None
  mask: jax.Array | None = None
  seed: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Payload:
  """A message on the wire: `arrays` travel (a typed NamedTuple per codec family: `Dense`, `Narrow`, `Quantized`,
  `Sparse`, or a composite codec's own); `shape`/`dtype` are static (known to both ends)."""
  arrays: NamedTuple
  shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  dtype: Any = dataclasses.field(metadata=dict(static=True))

  def parts(self) -> dict[str, Any]:
    """The fields of `arrays` that travel in this message, by name (fields that are None send nothing)."""
    return {name: a for name, a in self.arrays._asdict().items() if a is not None}


def nbytes(tree) -> int:
  """Bytes of every array leaf in a pytree (payloads, tuples of payloads)."""
  return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def _size(shape) -> int:
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


def _checked(encode):
  @functools.wraps(encode)
  def checked_encode(self, x, key=None):
    check_encodable(self, x)
    return encode(self, x, key)
  return checked_encode


def _nan_where_nan(v, x, axis=None):
  """v, NaN where the entries of x that v summarises (over `axis`) hold a NaN.

  XLA's min/max reductions may skip NaN (XLA:CPU does on larger arrays), so a range or scale
  taken by them alone would hide it from the receiver; `any(isnan)` is an OR, which cannot.
  """
  return jnp.where(jnp.any(jnp.isnan(x), axis=axis), jnp.nan, v)


class Codec(abc.ABC):
  """The codec contract: `encode`, `decode`, `wire_bytes` (abstract); `__call__` is
  C(x) = decode(encode(x)); every subclass's `encode` first runs `check_encodable` on its input."""

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if "encode" in vars(cls):
      cls.encode = _checked(vars(cls)["encode"])

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

  def indices(self, payload: Payload) -> jax.Array:
    """Positions [R, k] (int32) of the payload's values in their rows."""

  def values_at(self, x, idx_RxK) -> Payload:
    """x's values at known positions: a payload of values alone."""

  def scatter(self, payload: Payload, idx_RxK) -> jax.Array:
    """The dense tensor from values at known positions (the inverse of `values_at`)."""

  def value_bytes(self, shape, dtype) -> int:
    """Exact bytes of `values_at`'s payload."""


@dataclasses.dataclass(frozen=True)
class Identity(Codec):
  """Sends the dense tensor: C(x) = x."""

  @compiled
  def encode(self, x, key=None):
    return Payload(Dense(x), x.shape, x.dtype)

  @compiled
  def decode(self, payload):
    return payload.arrays.x

  def wire_bytes(self, shape, dtype):
    return _size(shape) * np.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Cast(Codec):
  """Sends x in a narrower float type: C(x) = float(dtype(x)).

  The narrow floats travel as their bit patterns (uint8 for fp8, uint16 for 16-bit), so no
  backend widens them on the wire (XLA:CPU moves f8 as f16 in a collective-permute).
  """
  dtype: str = "bfloat16"

  def __post_init__(self):
    if self.dtype not in _CAST_DTYPES:
      raise ValueError(f"Cast dtype must be one of {_CAST_DTYPES}, got {self.dtype!r}")

  @compiled
  def encode(self, x, key=None):
    return Payload(Narrow(packing.as_bits(x.astype(self.dtype))), x.shape, x.dtype)

  @compiled
  def decode(self, payload):
    narrow = jax.lax.bitcast_convert_type(payload.arrays.bits, jnp.dtype(self.dtype))
    return narrow.astype(payload.dtype)

  def wire_bytes(self, shape, dtype):
    return _size(shape) * np.dtype(jnp.dtype(self.dtype)).itemsize


_FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")


@dataclasses.dataclass(frozen=True)
class ScaledCast(Codec):
  """fp8 with an amax scale, as fp8 training recipes send tensors: C(x) = s * fp8(x / s).

  s = amax / FMAX per tensor (granularity="tensor") or per channel (last axis), amax = max|x|
  and FMAX the format's largest finite value (448 for e4m3fn, 57344 for e5m2), so the
  largest entry maps to FMAX and small ones (activation gradients) stay out of fp8's
  subnormals. The fp8 values travel as their uint8 bit patterns (as `Cast`), s in fp32:
  size + 4 bytes per scale. An all-zero scale group decodes to 0; a NaN makes its group NaN;
  +-inf decodes to +-inf and the other entries of its group to NaN (s is inf, as in
  MaxAbsQuant). fp32 scales hold amax / FMAX for any finite amax down to ~FMAX 2^-126 (about
  5e-36 for e4m3fn); below that s is subnormal, which XLA flushes to zero, and the group
  decodes to 0.
  """
  dtype: str = "float8_e4m3fn"
  granularity: str = "tensor"

  def __post_init__(self):
    if self.dtype not in _FP8_DTYPES:
      raise ValueError(f"ScaledCast dtype must be one of {_FP8_DTYPES}, got {self.dtype!r}")
    if self.granularity not in ("tensor", "channel"):
      raise ValueError(f"ScaledCast granularity must be 'tensor' or 'channel', got {self.granularity!r}")

  @property
  def fmax(self) -> float:
    return float(jnp.finfo(jnp.dtype(self.dtype)).max)

  def _axes(self, ndim):
    return tuple(range(ndim - 1)) if self.granularity == "channel" else None

  @compiled
  def encode(self, x, key=None):
    x32 = x.astype(jnp.float32)
    s = jnp.max(jnp.abs(x32), axis=self._axes(x.ndim)) / self.fmax
    y = jnp.where(jnp.isinf(x32), jnp.sign(x32) * self.fmax, _ratio(x32, s))
    narrow = y.astype(self.dtype)  # |y| <= FMAX up to fp32 rounding, which the cast rounds to FMAX
    return Payload(Narrow(packing.as_bits(narrow), packing.as_bits(s)), x.shape, x.dtype)

  @compiled
  def decode(self, payload):
    a = payload.arrays
    y = packing.from_bits(a.bits, jnp.dtype(self.dtype)).astype(jnp.float32)
    return (y * packing.from_bits(a.scale, jnp.float32)).astype(payload.dtype)  # beside an inf, y = 0 and 0 * inf = NaN

  def wire_bytes(self, shape, dtype):
    scales = shape[-1] if self.granularity == "channel" else 1
    return _size(shape) * np.dtype(jnp.dtype(self.dtype)).itemsize + 4 * scales


def _round(y, stochastic: bool, key):
  """Nearest rounding, or floor(y + u), u ~ U[0,1) (unbiased: E = y)."""
  if not stochastic:
    return jnp.round(y)
  if key is None:
    raise ValueError("stochastic rounding needs a PRNG key, got key=None")
  return jnp.floor(y + jax.random.uniform(key, y.shape, jnp.float32))


def _ratio(v, d):
  """v / d for a scalar or broadcast d >= 0 (0 where d == 0), exact up to fp32 max.

  XLA turns v / d into v * (1/d); for d > 2^126 that reciprocal is denormal and flushed
  to zero, so huge divisors are pre-scaled by 2^-64 on both sides.
  """
  c = jnp.where(d >= 2.0**64, 2.0**-64, 1.0)
  safe = jnp.where(d > 0, d * c, 1.0)
  return jnp.where(d > 0, (v * c) * (1.0 / safe), 0.0)


def _power_of_two(k):
  """2.0^k in float32, exactly, for integers k in [-126, 127] (built from its bits)."""
  return jax.lax.bitcast_convert_type((k + 127) << 23, jnp.float32)


def _unit_scaled(x32, s, expand):
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


def _check_fraction(fraction) -> float:
  if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
    raise ValueError(f"fraction K must be in (0, 1], got {fraction!r}")
  return float(fraction)


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

  @compiled
  def encode(self, x, key=None):
    x32 = x.astype(jnp.float32)
    lo, hi = _nan_where_nan(jnp.min(x32), x32), _nan_where_nan(jnp.max(x32), x32)
    up = _tiny_range_factor(lo, hi)
    half_range = 0.5 * (hi * up) - 0.5 * (lo * up)
    y = _ratio(0.5 * (x32 * up) - 0.5 * (lo * up), half_range) * self.levels
    codes = jnp.clip(_round(y, self.stochastic, key), 0, self.levels)
    packed = packing.pack(codes.reshape(-1).astype(jnp.uint32), self.bits)
    return Payload(Quantized(packed, lo=lo, hi=hi), x.shape, x.dtype)

  @compiled
  def decode(self, payload):
    a = payload.arrays
    codes = packing.unpack(a.codes, self.bits, _size(payload.shape)).reshape(payload.shape)
    up = _tiny_range_factor(a.lo, a.hi)
    half_step = (0.5 * (a.hi * up) - 0.5 * (a.lo * up)) * (codes.astype(jnp.float32) / self.levels)
    return (((a.lo * up + half_step) + half_step) / up).astype(payload.dtype)

  def wire_bytes(self, shape, dtype):
    return packing.packed_size(_size(shape), self.bits) + 2 * 4


_SCALE_DTYPES = ("float32", "bfloat16", "float16")
_CLIP_CANDIDATES = tuple(1.0 - 0.75 * (j / 24) ** 2 for j in range(25))  # clip="mse": r in [0.25, 1], dense near 1
MAXABS_GRIDS = ("zero", "midrise")
AUTO_GRID = "auto"  # per scale, whichever of MAXABS_GRIDS errs least; flagged in the sign bit of the scale
# bits -> (grid, clip) that a MaxAbsQuant takes where it names none (else the zero grid, unclipped): the clips
# chosen by eval loss on the tiny GPT-2 frontier budget, 3 seeds; the grid per scale, so that a scale holding an
# outlier keeps 0 (docs/grids.md)
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
    (B >= 1; 1 bit is sign(x) s). At 2 bits that is 4 points instead of 3: relative MSE on
    N(0,1) 0.46 instead of 0.75 unclipped, 0.12 instead of 0.19 with clip="mse". It is the
    grid of the earlier `maxabs` (commit 3b95a27). We take it over the AQ-SGD authors' grid
    {-2^(B-1)..2^(B-1)-1} s/2^(B-1), which keeps 0 but is lopsided: its largest positive
    point is below s, so E[x_hat] != x for x near s even under stochastic rounding, a bias
    that AQ-SGD's buffer and error-free schemes would accumulate. The price: no point at 0,
    so nearest rounding sends 0 to +s/(2^B-1), and stochastic rounding gives an entry near 0
    the variance (s/(2^B-1))^2 (the zero grid: about |x| s/D).
  * grid="auto": per scale, whichever of the two errs least (squared error, deterministic rounding;
    ties: zero). A scale holding an outlier takes the zero grid, whose 0 keeps the scale's small
    entries at 0 instead of +-s/(2^B-1) (N(0,1) with 4 features x 50, 3 bits, one scale per 64
    features: relative MSE 0.412 on midrise, 0.020 auto); an outlier-free scale takes midrise's extra
    level. The choice travels in the sign bit of the scale, which max|x| >= 0 leaves free: no byte.
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
  makes its whole scale group NaN.
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
    if self.group is not None and (isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 1):
      raise ValueError(f"group must be a positive number of features, got {self.group!r}")
    if self.scale_dtype not in _SCALE_DTYPES:
      raise ValueError(f"scale_dtype must be one of {_SCALE_DTYPES}, got {self.scale_dtype!r}")
    if self.clip != "mse" and (isinstance(self.clip, bool) or not isinstance(self.clip, (int, float))
                               or not 0.0 < self.clip <= 1.0):
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
      return self._view_shape(shape)[:-1]
    return (shape[-1],) if self.granularity == "channel" else ()

  def _view_shape(self, shape):
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
    y = jnp.where(jnp.isinf(x32), jnp.sign(x32), _ratio(x32, s32)) * d
    return jnp.clip(_round(y - f, stochastic, key) + (f + d), 0, 2 * d)

  def _grid(self, codes, s32, f):
    """(c - D)/D s; an interior point of an infinite scale is NaN (it is no number), its ends +-inf."""
    d = self._levels(f)
    k = codes - d
    return jnp.where(jnp.isinf(s32) & (jnp.abs(k) < d), jnp.nan, (k / d) * s32)

  def _least_error(self, x32, s, ratios, offsets):
    """(ratio, offset) per scale whose grid, deterministically rounded, errs least in squared error.

    The errors are summed over x / 2^E and s / 2^E, 2^E the power of two of s (`_unit_scaled`): exact
    rescalings, so the choice is the same for x and x * c at any magnitude (at fp32's extremes the squares
    of x itself would overflow to inf or flush to 0, and every candidate would tie). Ties take the first
    ratio, then the zero grid."""
    axes = self._reduce_axes(x32)
    u, s_u = _unit_scaled(x32, s, self._expand)

    def errors(f):
      def error(r):
        rs = self._expand(r * s_u)
        return jnp.sum(jnp.square(self._grid(self._codes(u, rs, f, False, None), rs, f) - u), axis=axes)
      return jax.lax.map(error, jnp.asarray(ratios))

    per_grid = [errors(f) for f in offsets]  # each [ratios, scales]
    best = [jnp.argmin(e, axis=0) for e in per_grid]
    ratio = [jnp.asarray(ratios)[b] for b in best]
    if len(offsets) == 1:
      return ratio[0], offsets[0]
    least = [jnp.take_along_axis(e, b[None], axis=0)[0] for e, b in zip(per_grid, best)]
    midrise = least[1] < least[0]
    return jnp.where(midrise, ratio[1], ratio[0]), jnp.where(midrise, 0.5, 0.0)

  def _scale(self, x32):
    """(scale, grid offset f) the sender picks: s = max|x| times a fixed clip ratio or the least-error one;
    f the fixed grid's, or per scale (grid="auto") the grid of least error."""
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

  def grids(self, payload: Payload) -> tuple[jax.Array, jax.Array | float]:
    """(scales as fp32, grid offset f per scale) of a payload: f = 0 on the zero grid, 1/2 on midrise
    (grid="auto" sends f in the sign bit of each scale, which max|x| leaves 0: a set bit means midrise)."""
    stored = jax.lax.bitcast_convert_type(payload.arrays.scale, jnp.dtype(self.scale_dtype))
    if self.grid != AUTO_GRID:
      return stored.astype(jnp.float32), self._offset
    return jnp.abs(stored).astype(jnp.float32), jnp.where(jnp.signbit(stored), 0.5, 0.0)

  @compiled
  def encode(self, x, key=None):
    x32 = x.astype(jnp.float32).reshape(self._view_shape(x.shape))
    scale, f = self._scale(x32)
    f_x = self._expand(f) if self.grid == AUTO_GRID else f
    codes = self._codes(x32, self._expand(scale.astype(jnp.float32)), f_x, self.stochastic, key)
    packed = packing.pack(codes.reshape(-1).astype(jnp.uint32), self.bits)
    if self.grid == AUTO_GRID:
      scale = jnp.where(f > 0, -scale, scale)
    return Payload(Quantized(packed, scale=packing.as_bits(scale)), x.shape, x.dtype)

  @compiled
  def decode(self, payload):
    a = payload.arrays
    codes = packing.unpack(a.codes, self.bits, _size(payload.shape)).reshape(self._view_shape(payload.shape))
    s32, f = self.grids(payload)
    f_x = self._expand(f) if self.grid == AUTO_GRID else f
    return self._grid(codes.astype(jnp.float32), self._expand(s32), f_x).reshape(payload.shape).astype(payload.dtype)

  def wire_bytes(self, shape, dtype):
    scales = _size(self._scale_shape(shape)) * np.dtype(jnp.dtype(self.scale_dtype)).itemsize
    return packing.packed_size(_size(shape), self.bits) + scales


def _rows(shape, per: str) -> tuple[int, int]:
  """(R, F): the tensor viewed as R selection rows of F features."""
  if per == "example":
    return shape[0], _size(shape[1:])
  return _size(shape[:-1]), shape[-1]


def _check_per(per):
  if per not in ("example", "row"):
    raise ValueError(f"per must be 'example' or 'row', got {per!r}")


def _k(fraction: float, f: int) -> int:
  """Entries kept per row: ceil(fraction * F), at least 1 (float noise in the product ignored)."""
  return max(1, min(f, math.ceil(round(fraction * f, 6))))


def _index_dtype(f: int):
  return np.uint16 if f <= 1 << 16 else np.int32


TOPK_VALUE_FORMATS = ("native", "bf16", "q8")


def _flag_nonfinite_rows(values_RxK, x_RxF):
  """The values selected from each row of x, their finite ones NaN where the row holds a NaN or
  +-inf: a selection (random, approximate, or of the gradient at reused positions) that skips
  the non-finite entry still shows the receiver that the row had one."""
  bad_Rx1 = ~jnp.all(jnp.isfinite(x_RxF), axis=1, keepdims=True)
  return jnp.where(bad_Rx1 & jnp.isfinite(values_RxK), jnp.nan, values_RxK)


def _scatter_rows(values_RxK, idx_RxK, f):
  rows = jnp.arange(values_RxK.shape[0])[:, None]
  return jnp.zeros((values_RxK.shape[0], f), values_RxK.dtype).at[rows, idx_RxK].set(values_RxK)


def _selected_positions(selector, x_RxF, k):
  return selection.top_k_positions(x_RxF, k, selector)


def _selected_mask(selector, x_RxF, k):
  """Packed bitmask of the k largest |x| per row, selected by `selector`."""
  if selector == "threshold":
    return packing.pack_mask(selection.top_k_mask(x_RxF, k))
  idx = _selected_positions(selector, x_RxF, k)
  rows = jnp.arange(x_RxF.shape[0])[:, None]
  return packing.pack_mask(jnp.zeros(x_RxF.shape, bool).at[rows, idx].set(True))


# `python -m benchmarks.topk_selection` on CPU ([8, 98304]): the threshold round trip is ~6x
# faster than lax.top_k at K = 10%, equal near 1%, ~2.4x slower at 0.1%
THRESHOLD_FROM_FRACTION_CPU = 0.01


@dataclasses.dataclass(frozen=True)
class TopK(Codec):
  """Keeps the ceil(K*F) entries of largest |x| in each row, zeroes the rest.

  Rows are examples (F = all features of one example, as in the reference code) or the
  last axis. Exactly k entries are selected per row, the set `lax.top_k(|x|, k)` returns
  (ties by lowest position; NaN ranks above inf), so ties never drop the count below k.
  Sends the k values plus their positions as uint16/int32 indices or as an F-bit mask per
  row, whichever is smaller; values travel in the order of the positions.
  `values`: "native" (the input dtype), "bf16", or "q8": int8 codes c = round(127 v / s) on
  the symmetric grid {-127..127} (0 included) with one fp32 scale s = max|v| per row,
  v_hat = s c / 127, |v - v_hat| <= s / 254. A row holding a NaN or +-inf sends NaN in place
  of its finite selected values (q8: a NaN scale).
  `select`: "threshold" (counting passes + prefix-sum compaction, `jaxcomp.compress.selection`),
  "sort" (`lax.top_k`), "approx" (`lax.approx_max_k`), or "auto": the fastest measured on
  the platform the program is compiled for (`jax.lax.platform_dependent`; CPU: threshold from
  K = THRESHOLD_FROM_FRACTION_CPU up, sort below; sort elsewhere until measured).
  """
  fraction: float = 0.1
  per: str = "example"
  select: str = "auto"
  values: str = "native"

  def __post_init__(self):
    _check_fraction(self.fraction)
    _check_per(self.per)
    if self.values not in TOPK_VALUE_FORMATS:
      raise ValueError(f"values must be one of {TOPK_VALUE_FORMATS}, got {self.values!r}")
    if self.select not in ("auto", *selection.SELECTORS):
      raise ValueError(f"select must be one of {('auto', *selection.SELECTORS)}, got {self.select!r}")

  def k(self, shape) -> int:
    return _k(self.fraction, _rows(shape, self.per)[1])

  def uses_mask(self, shape) -> bool:
    _, f = _rows(shape, self.per)
    return f / 8 < self.k(shape) * np.dtype(_index_dtype(f)).itemsize

  def selector(self, platform: str) -> str:
    """The selection method on `platform` ("cpu", "tpu", "cuda", ...): `select`, or for "auto"
    the threshold selection on CPU from K = THRESHOLD_FROM_FRACTION_CPU up, `lax.top_k` elsewhere."""
    if self.select != "auto":
      return self.select
    return "threshold" if platform == "cpu" and self.fraction >= THRESHOLD_FROM_FRACTION_CPU else "sort"

  def _selected(self, how, x_RxF, k):
    """how(selector, x, k) with the selector of the platform the program is lowered for (not the
    host's default backend: a program compiled for a TPU from a CPU host selects as on the TPU)."""
    on_cpu, elsewhere = self.selector("cpu"), self.selector("tpu")
    if on_cpu == elsewhere:
      return how(on_cpu, x_RxF, k)
    return jax.lax.platform_dependent(x_RxF, cpu=lambda x: how(on_cpu, x, k), default=lambda x: how(elsewhere, x, k))

  def positions(self, x) -> jax.Array:
    """Int32 [R, k]: positions of the largest-magnitude entries of each row."""
    r, f = _rows(x.shape, self.per)
    return self._selected(_selected_positions, x.reshape(r, f), self.k(x.shape))

  def _mask(self, x_RxF, k) -> jax.Array:
    """Packed bitmask [R, ceil(F/8)] of the selected entries."""
    return self._selected(_selected_mask, x_RxF, k)

  def _pack_values(self, v_RxK) -> Sparse:
    """The selected values in the wire format `values` (positions not yet filled in)."""
    if self.values == "bf16":
      return Sparse(v_RxK.astype(jnp.bfloat16))
    if self.values == "q8":
      v32 = v_RxK.astype(jnp.float32)
      scale = _nan_where_nan(jnp.max(jnp.abs(v32), axis=1), v32, axis=1)
      codes = jnp.clip(jnp.round(_ratio(v32, scale[:, None]) * 127.0), -127, 127)
      return Sparse(codes.astype(jnp.int8), scale=scale)
    return Sparse(v_RxK)

  def _unpack_values(self, arrays: Sparse, dtype) -> jax.Array:
    v = arrays.values
    if self.values == "q8":
      v = (v.astype(jnp.float32) / 127.0) * arrays.scale[:, None]
    return v.astype(dtype)

  def value_bytes(self, shape, dtype) -> int:
    """Bytes of the values part alone (all that index reuse sends backward)."""
    r, _ = _rows(shape, self.per)
    itemsize = {"native": np.dtype(dtype).itemsize, "bf16": 2, "q8": 1}[self.values]
    return r * self.k(shape) * itemsize + (r * 4 if self.values == "q8" else 0)

  def values_at(self, x, idx_RxK) -> Payload:
    """The values of x at given per-row indices (index reuse: the receiver knows them)."""
    r, f = _rows(x.shape, self.per)
    x_RxF = x.reshape(r, f)
    values = _flag_nonfinite_rows(jnp.take_along_axis(x_RxF, idx_RxK, axis=1), x_RxF)
    return Payload(self._pack_values(values), x.shape, x.dtype)

  def scatter(self, payload: Payload, idx_RxK) -> jax.Array:
    """Dense tensor from values at known indices: inverse of `values_at`."""
    _, f = _rows(payload.shape, self.per)
    values = self._unpack_values(payload.arrays, payload.dtype)
    return _scatter_rows(values, idx_RxK, f).reshape(payload.shape)

  @compiled
  def encode(self, x, key=None):
    r, f = _rows(x.shape, self.per)
    x_RxF = x.reshape(r, f)
    if self.uses_mask(x.shape):
      mask = self._mask(x_RxF, self.k(x.shape))
      values = self._pack_values(_flag_nonfinite_rows(packing.compact(mask, f, self.k(x.shape), x_RxF), x_RxF))
      return Payload(values._replace(mask=mask), x.shape, x.dtype)
    idx = self.positions(x)
    values = self._pack_values(_flag_nonfinite_rows(jnp.take_along_axis(x_RxF, idx, axis=1), x_RxF))
    return Payload(values._replace(indices=idx.astype(_index_dtype(f))), x.shape, x.dtype)

  def indices(self, payload: Payload) -> jax.Array:
    """Selected positions [R, k] (int32) recovered from a payload, either encoding."""
    a = payload.arrays
    if a.indices is not None:
      return a.indices.astype(jnp.int32)
    _, f = _rows(payload.shape, self.per)
    return packing.compact(a.mask, f, a.values.shape[1])

  @compiled
  def decode(self, payload):
    if payload.arrays.indices is not None:
      return self.scatter(payload, self.indices(payload))
    _, f = _rows(payload.shape, self.per)
    values = self._unpack_values(payload.arrays, payload.dtype)
    return packing.expand(payload.arrays.mask, f, values).reshape(payload.shape)

  def wire_bytes(self, shape, dtype):
    r, f = _rows(shape, self.per)
    where = min(self.k(shape) * np.dtype(_index_dtype(f)).itemsize, -(-f // 8))
    return self.value_bytes(shape, dtype) + r * where


@dataclasses.dataclass(frozen=True)
class RandK(Codec):
  """Keeps ceil(K*F) uniformly random entries per row (unscaled, so contractive like TopK).

  Positions come from a PRNG seed that travels with the values (8 bytes), so the receiver
  regenerates them and no indices are sent. The seed is the message's key folded with the bits
  of its first entry: known to the sender alone, so no compiler can drop it from the message as
  a value the receiver could compute itself (XLA:TPU does that to a seed drawn from a key both
  ends derive, and the bytes sent would no longer be the bytes counted). A row holding a NaN or
  +-inf sends NaN in place of its finite kept values.
  """
  fraction: float = 0.1
  per: str = "example"

  def __post_init__(self):
    _check_fraction(self.fraction)
    _check_per(self.per)

  def _positions(self, seed, shape):
    r, f = _rows(shape, self.per)
    noise = jax.random.uniform(jax.random.wrap_key_data(seed), (r, f))
    return jax.lax.top_k(noise, _k(self.fraction, f))[1]

  @compiled
  def encode(self, x, key=None):
    if key is None:
      raise ValueError("RandK needs a PRNG key, got key=None")
    key = key if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else jax.random.wrap_key_data(key)
    first = jax.lax.bitcast_convert_type(x.reshape(-1)[0].astype(jnp.float32), jnp.uint32)
    seed = jax.random.key_data(jax.random.fold_in(key, first))
    r, f = _rows(x.shape, self.per)
    x_RxF = x.reshape(r, f)
    values = _flag_nonfinite_rows(jnp.take_along_axis(x_RxF, self._positions(seed, x.shape), axis=1), x_RxF)
    return Payload(Sparse(values, seed=seed), x.shape, x.dtype)

  @compiled
  def decode(self, payload):
    a = payload.arrays
    _, f = _rows(payload.shape, self.per)
    idx = self._positions(a.seed, payload.shape)
    return _scatter_rows(a.values, idx, f).reshape(payload.shape)

  def wire_bytes(self, shape, dtype):
    r, f = _rows(shape, self.per)
    return r * _k(self.fraction, f) * np.dtype(dtype).itemsize + 8
