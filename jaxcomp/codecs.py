"""Stateless compressors C: encode to the bytes that travel, decode back.

Every codec is a frozen dataclass (hashable, so it is static under `jax.jit`) with
  encode(x, key) -> Payload      the arrays that cross the link, nothing else
  decode(payload) -> x_hat       what the receiver reconstructs from those arrays alone
  wire_bytes(shape, dtype) -> int exact size of the payload, computed without running it
`codec(x, key)` is the round trip decode(encode(x)), i.e. the C(x) of the papers' math.
Tensors are [B, ...] with a leading example axis.
"""
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp import packing

_CAST_DTYPES = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Payload:
  """A message on the wire: `arrays` travel; `shape`/`dtype` are static (known to both ends)."""
  arrays: dict[str, jax.Array]
  shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  dtype: Any = dataclasses.field(metadata=dict(static=True))


def nbytes(tree) -> int:
  """Bytes of every array leaf in a pytree (payloads, tuples of payloads)."""
  return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def _size(shape) -> int:
  return int(np.prod(shape, dtype=np.int64))


class Codec:
  """Base class: `__call__` is C(x) = decode(encode(x))."""

  def encode(self, x, key=None) -> Payload:
    raise NotImplementedError

  def decode(self, payload: Payload) -> jax.Array:
    raise NotImplementedError

  def wire_bytes(self, shape, dtype) -> int:
    raise NotImplementedError

  def __call__(self, x, key=None):
    return self.decode(self.encode(x, key))


@dataclasses.dataclass(frozen=True)
class Identity(Codec):
  """Sends the dense tensor: C(x) = x."""

  def encode(self, x, key=None):
    return Payload({"x": x}, x.shape, x.dtype)

  def decode(self, payload):
    return payload.arrays["x"]

  def wire_bytes(self, shape, dtype):
    return _size(shape) * np.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Cast(Codec):
  """Sends x in a narrower float type: C(x) = float(dtype(x))."""
  dtype: str = "bfloat16"

  def __post_init__(self):
    if self.dtype not in _CAST_DTYPES:
      raise ValueError(f"Cast dtype must be one of {_CAST_DTYPES}, got {self.dtype!r}")

  def encode(self, x, key=None):
    return Payload({"x": x.astype(self.dtype)}, x.shape, x.dtype)

  def decode(self, payload):
    return payload.arrays["x"].astype(payload.dtype)

  def wire_bytes(self, shape, dtype):
    return _size(shape) * np.dtype(jnp.dtype(self.dtype)).itemsize


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
  |x| up to the fp32 maximum; a constant tensor decodes exactly; NaN propagates to x_hat.
  """
  bits: int = 8
  stochastic: bool = False

  def __post_init__(self):
    packing.check_bits(self.bits)

  @property
  def levels(self) -> int:
    return (1 << self.bits) - 1

  def encode(self, x, key=None):
    x32 = x.astype(jnp.float32)
    lo, hi = jnp.min(x32), jnp.max(x32)
    half_range = 0.5 * hi - 0.5 * lo
    y = _ratio(0.5 * x32 - 0.5 * lo, half_range) * self.levels
    codes = jnp.clip(_round(y, self.stochastic, key), 0, self.levels)
    packed = packing.pack(codes.reshape(-1).astype(jnp.uint32), self.bits)
    return Payload({"codes": packed, "lo": lo, "hi": hi}, x.shape, x.dtype)

  def decode(self, payload):
    a = payload.arrays
    codes = packing.unpack(a["codes"], self.bits, _size(payload.shape)).reshape(payload.shape)
    half_step = (0.5 * a["hi"] - 0.5 * a["lo"]) * (codes.astype(jnp.float32) / self.levels)
    return ((a["lo"] + half_step) + half_step).astype(payload.dtype)

  def wire_bytes(self, shape, dtype):
    return packing.packed_size(_size(shape), self.bits) + 2 * 4


@dataclasses.dataclass(frozen=True)
class MaxAbsQuant(Codec):
  """Max-abs k-bit quantization on a uniform signed grid (AQ-SGD).

  s = max|x| per tensor, per channel (last axis; shared over batch and sequence), or per
  group (granularity="group": one scale per `group` consecutive features of each row, the
  "tile" scales of TAH-Quant), stored in `scale_dtype` and rounded up so |x| <= s. Grid of 2^bits points on [-s, s]:
  c = round((x/s + 1)/2 * levels), x_hat = s (2c/levels - 1), |x - x_hat| <= s / levels.
  Stochastic rounding makes E[x_hat] = x. A zero scale decodes to exactly 0.
  """
  bits: int = 4
  granularity: str = "channel"
  stochastic: bool = False
  scale_dtype: str = "float16"
  group: int | None = None  # features per scale, with granularity="group"

  def __post_init__(self):
    packing.check_bits(self.bits)
    if self.granularity not in ("tensor", "channel", "group"):
      raise ValueError(f"granularity must be 'tensor', 'channel' or 'group', got {self.granularity!r}")
    if (self.granularity == "group") != (self.group is not None):
      raise ValueError(f"group={self.group!r} goes with granularity='group' only (got {self.granularity!r})")
    if self.group is not None and (isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 1):
      raise ValueError(f"group must be a positive number of features, got {self.group!r}")
    if self.scale_dtype not in ("float16", "bfloat16", "float32"):
      raise ValueError(f"scale_dtype must be float16, bfloat16 or float32, got {self.scale_dtype!r}")

  @property
  def levels(self) -> int:
    return (1 << self.bits) - 1

  def _scale_shape(self, shape):
    if self.granularity == "group":
      return (*shape[:-1], shape[-1] // self._group_size(shape[-1]))
    return (shape[-1],) if self.granularity == "channel" else ()

  def _group_size(self, features: int) -> int:
    if features % self.group:
      raise ValueError(f"maxabs group={self.group} does not divide the {features} features of the last axis; "
                       f"pick a divisor of {features}")
    return self.group

  def _view(self, shape):
    """(shape the scale is a max over, its reduced axes): groups split the last axis."""
    if self.granularity == "group":
      g = self._group_size(shape[-1])
      return (*shape[:-1], shape[-1] // g, g), (len(shape),)
    return tuple(shape), tuple(range(len(shape) - 1)) if self.granularity == "channel" else None

  def encode(self, x, key=None):
    view, axes = self._view(x.shape)
    x32 = x.astype(jnp.float32).reshape(view)
    s = jnp.max(jnp.abs(x32), axis=axes, keepdims=True)
    s_stored = s.astype(self.scale_dtype)
    s_stored = jnp.where(s_stored.astype(jnp.float32) < s, jnp.nextafter(s_stored, jnp.inf), s_stored)
    s32 = s_stored.astype(jnp.float32)
    y = (_ratio(x32, s32) * 0.5 + 0.5) * self.levels
    codes = jnp.clip(_round(y, self.stochastic, key), 0, self.levels)
    packed = packing.pack(codes.reshape(-1).astype(jnp.uint32), self.bits)
    return Payload({"codes": packed, "scale": s_stored.reshape(self._scale_shape(x.shape))}, x.shape, x.dtype)

  def decode(self, payload):
    a = payload.arrays
    view, axes = self._view(payload.shape)
    codes = packing.unpack(a["codes"], self.bits, _size(payload.shape)).reshape(view)
    grid = codes.astype(jnp.float32) * (2.0 / self.levels) - 1.0
    scale = jnp.expand_dims(a["scale"].astype(jnp.float32), axes) if axes else a["scale"].astype(jnp.float32)
    return (grid * scale).reshape(payload.shape).astype(payload.dtype)

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


def _scatter_rows(values_RxK, idx_RxK, f):
  rows = jnp.arange(values_RxK.shape[0])[:, None]
  return jnp.zeros((values_RxK.shape[0], f), values_RxK.dtype).at[rows, idx_RxK].set(values_RxK)


@dataclasses.dataclass(frozen=True)
class TopK(Codec):
  """Keeps the ceil(K*F) entries of largest |x| in each row, zeroes the rest.

  Rows are examples (F = all features of one example, as in the reference code) or the
  last axis. Exactly k entries are selected per row (`lax.top_k`), so ties never drop the
  count below k. Sends the k values plus their positions as uint16/int32 indices or as an
  F-bit mask per row, whichever is smaller.
  """
  fraction: float = 0.1
  per: str = "example"

  def __post_init__(self):
    _check_fraction(self.fraction)
    _check_per(self.per)

  def k(self, shape) -> int:
    return _k(self.fraction, _rows(shape, self.per)[1])

  def uses_mask(self, shape) -> bool:
    _, f = _rows(shape, self.per)
    return f / 8 < self.k(shape) * np.dtype(_index_dtype(f)).itemsize

  def select(self, x) -> jax.Array:
    """Indices [R, k] of the largest-magnitude entries of each row."""
    r, f = _rows(x.shape, self.per)
    return jax.lax.top_k(jnp.abs(x.reshape(r, f)), self.k(x.shape))[1]

  def values_at(self, x, idx_RxK) -> Payload:
    """The values of x at given per-row indices (index reuse: the receiver knows them)."""
    r, f = _rows(x.shape, self.per)
    values = jnp.take_along_axis(x.reshape(r, f), idx_RxK, axis=1)
    return Payload({"values": values}, x.shape, x.dtype)

  def scatter(self, payload: Payload, idx_RxK) -> jax.Array:
    """Dense tensor from values at known indices: inverse of `values_at`."""
    _, f = _rows(payload.shape, self.per)
    return _scatter_rows(payload.arrays["values"], idx_RxK, f).reshape(payload.shape)

  def encode(self, x, key=None):
    r, f = _rows(x.shape, self.per)
    idx = self.select(x)
    if self.uses_mask(x.shape):
      idx = jnp.sort(idx, axis=1)  # values travel in positional order
      mask = jnp.zeros((r, f), bool).at[jnp.arange(r)[:, None], idx].set(True)
      where = {"mask": packing.pack_mask(mask)}
    else:
      where = {"indices": idx.astype(_index_dtype(f))}
    values = jnp.take_along_axis(x.reshape(r, f), idx, axis=1)
    return Payload({"values": values, **where}, x.shape, x.dtype)

  def indices(self, payload: Payload) -> jax.Array:
    """Selected positions [R, k] (int32) recovered from a payload, either encoding."""
    a = payload.arrays
    if "indices" in a:
      return a["indices"].astype(jnp.int32)
    _, f = _rows(payload.shape, self.per)
    k = a["values"].shape[1]
    mask = packing.unpack_mask(a["mask"], f)
    return jax.vmap(lambda m: jnp.nonzero(m, size=k, fill_value=0)[0])(mask).astype(jnp.int32)

  def decode(self, payload):
    return self.scatter(payload, self.indices(payload))

  def wire_bytes(self, shape, dtype):
    r, f = _rows(shape, self.per)
    k = self.k(shape)
    where = min(k * np.dtype(_index_dtype(f)).itemsize, -(-f // 8))
    return r * (k * np.dtype(dtype).itemsize + where)


@dataclasses.dataclass(frozen=True)
class RandK(Codec):
  """Keeps ceil(K*F) uniformly random entries per row (unscaled, so contractive like TopK).

  Positions come from a PRNG key that travels with the values (8 bytes), so the receiver
  regenerates them and no indices are sent.
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

  def encode(self, x, key=None):
    if key is None:
      raise ValueError("RandK needs a PRNG key, got key=None")
    seed = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    r, f = _rows(x.shape, self.per)
    values = jnp.take_along_axis(x.reshape(r, f), self._positions(seed, x.shape), axis=1)
    return Payload({"values": values, "seed": seed}, x.shape, x.dtype)

  def decode(self, payload):
    a = payload.arrays
    _, f = _rows(payload.shape, self.per)
    idx = self._positions(a["seed"], payload.shape)
    return _scatter_rows(a["values"], idx, f).reshape(payload.shape)

  def wire_bytes(self, shape, dtype):
    r, f = _rows(shape, self.per)
    return r * _k(self.fraction, f) * np.dtype(dtype).itemsize + 8
