"""Sparsifiers: each row keeps k = ceil(K F) of its F entries, the largest in magnitude (TopK) or random ones
(RandK), and sends them with where they sit; TopK's 8-bit values are a `MaxAbsQuant(8)` of each row's."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.arguments import is_number
from jaxcomp.compress import packing, selection
from jaxcomp.compress.codecs.base import Codec, checked, compiled, num_entries
from jaxcomp.compress.codecs.quantizers import MaxAbsQuant
from jaxcomp.compress.codecs.wire import Payload, Quantized, Sparse


def _check_fraction(fraction) -> float:
  if not is_number(fraction) or not 0.0 < fraction <= 1.0:
    raise ValueError(f"fraction K must be in (0, 1], got {fraction!r}")
  return float(fraction)



def _rows(shape, per: str) -> tuple[int, int]:
  """(R, F): the tensor viewed as R selection rows of F features."""
  if per == "example":
    return shape[0], num_entries(shape[1:])
  return num_entries(shape[:-1]), shape[-1]


def _check_per(per):
  if per not in ("example", "row"):
    raise ValueError(f"per must be 'example' or 'row', got {per!r}")


def _k(fraction: float, f: int) -> int:
  """Entries kept per row: ceil(fraction * F), at least 1 (float noise in the product ignored)."""
  return max(1, min(f, math.ceil(round(fraction * f, 6))))


def _index_dtype(f: int):
  return np.uint16 if f <= 1 << 16 else np.int32


TOPK_VALUE_FORMATS = ("native", "bf16", "q8")


def _flag_nonfinite_rows(values_RxK, x_Rx):
  """The values selected from each row of x, their finite ones NaN where the row holds a NaN or
  +-inf: a selection (random, approximate, or of the gradient at reused positions) that skips
  the non-finite entry still shows the receiver that the row had one. `x_Rx`: the rows ([R, ...]), or any
  part of each holding all its non-finite entries (an exact top-k's own values do: NaN and +-inf
  rank highest)."""
  bad_Rx1 = ~jnp.all(jnp.isfinite(x_Rx), axis=tuple(range(1, x_Rx.ndim)))[:, None]
  return jnp.where(bad_Rx1 & jnp.isfinite(values_RxK), jnp.nan, values_RxK)


def _scatter_rows(values_RxK, idx_RxK, f):
  rows = jnp.arange(values_RxK.shape[0])[:, None]
  return jnp.zeros((values_RxK.shape[0], f), values_RxK.dtype).at[rows, idx_RxK].set(values_RxK)


def _selected_positions(selector, x_RxF, k):
  return selection.top_k_positions(x_RxF, k, selector)


def _selected_mask(selector, x_RxAxB, k):
  """Packed bitmask of the k largest |x| per row ([R, A, B]: `selection.row_view`), selected by `selector`."""
  if selector == "threshold":
    return selection.top_k_packed(x_RxAxB, k)
  x_RxF = x_RxAxB.reshape(x_RxAxB.shape[0], -1)
  idx = _selected_positions(selector, x_RxF, k)
  rows = jnp.arange(x_RxF.shape[0])[:, None]
  return packing.pack_mask(jnp.zeros(x_RxF.shape, bool).at[rows, idx].set(True))


THRESHOLD_FROM_FRACTION_CPU = 0.03  # select="auto" on CPU: threshold from this K up (docs/results/codec_cost_cpu.md)
AUTO_SELECTION = {"cpu": "threshold", "cuda": "threshold", "rocm": "threshold", "tpu": "threshold"}  # select="auto"


@dataclasses.dataclass(frozen=True)
class TopK(Codec):
  """Keeps the ceil(K*F) entries of largest |x| in each row, zeroes the rest.

  Rows are examples (F = all features of one example, as in the reference code) or the
  last axis. Exactly k entries are selected per row, the set `lax.top_k(|x|, k)` returns
  (ties by lowest position; NaN ranks above inf), so ties never drop the count below k.
  Sends the k values plus their positions as uint16/int32 indices or as an F-bit mask per
  row, whichever is smaller; values travel in the order of the positions.
  `values`: "native" (the input dtype), "bf16", or "q8": each row's values through `MaxAbsQuant(8)`
  on the zero grid with one fp32 scale s = max|v| per row (`q8`), sent as int8 codes
  c = round(127 v / s) in {-127..127} (the quantizer's code less 127) and s itself:
  v_hat = s c / 127, |v - v_hat| <= s / 254, +-inf as the quantizer sends it. A row holding a
  NaN or +-inf sends NaN in place of its finite selected values (q8: a NaN scale).
  `select`: "threshold" (counting passes + prefix-sum compaction, `jaxcomp.compress.selection`),
  "sort" (`lax.top_k`), "approx" (`lax.approx_max_k`), or "auto": per platform the program is compiled for
  (`jax.lax.platform_dependent`, `AUTO_SELECTION`): on CPU the faster measured (threshold from K =
  THRESHOLD_FROM_FRACTION_CPU up, sort below); on GPU and TPU the threshold, the one selection whose compiled
  program sorts no row (XLA lowers `lax.top_k` and `approx_max_k` of k in the thousands to a sort of the row)
  and moves the fewest bytes (docs/results/codecs_compiled.md).
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
    """The selection method on `platform` ("cpu", "cuda", "rocm", "tpu"): `select`, or for "auto" the platform's
    (`AUTO_SELECTION`; on CPU below K = THRESHOLD_FROM_FRACTION_CPU, sort)."""
    if self.select != "auto":
      return self.select
    if platform == "cpu" and self.fraction < THRESHOLD_FROM_FRACTION_CPU:
      return "sort"
    return AUTO_SELECTION.get(platform, "sort")

  def _selected(self, how, x_RxF, k):
    """how(selector, x, k) with the selector of the platform the program is lowered for (not the
    host's default backend: a program compiled for a TPU from a CPU host selects as on the TPU)."""
    chosen = {p: self.selector(p) for p in ("cpu", "cuda", "rocm", "tpu")}
    if len(set(chosen.values())) == 1:
      return how(chosen["cpu"], x_RxF, k)
    return jax.lax.platform_dependent(x_RxF, **{p: (lambda x, s=s: how(s, x, k)) for p, s in chosen.items()})

  def positions(self, x) -> jax.Array:
    """Int32 [R, k]: positions of the largest-magnitude entries of each row."""
    r, f = _rows(x.shape, self.per)
    return self._selected(_selected_positions, x.reshape(r, f), self.k(x.shape))

  def _mask(self, x_RxAxB, k) -> jax.Array:
    """Packed bitmask [R, ceil(F/8)] of the selected entries of the rows [R, A, B] (`selection.row_view`)."""
    return self._selected(_selected_mask, x_RxAxB, k)

  @staticmethod
  def q8(k: int) -> MaxAbsQuant:
    """values="q8"'s quantizer of [R, k] selected values: one fp32 scale s = max|v| per row (a group of k), the
    zero grid {-127..127} s/127, unclipped."""
    return MaxAbsQuant(8, "group", group=k, grid="zero", clip=1.0)

  def _pack_values(self, v_RxK) -> Sparse:
    """The selected values in the wire format `values` (positions not yet filled in)."""
    if self.values == "bf16":
      return Sparse(v_RxK.astype(jnp.bfloat16))
    if self.values == "q8":
      r, k = v_RxK.shape
      q = self.q8(k).encode(v_RxK).arrays  # one byte per code c in [0, 254], the scales' bits [R, 1]
      codes = (q.codes.astype(jnp.int16) - 127).astype(jnp.int8).reshape(r, k)
      return Sparse(codes, scale=packing.from_bits(q.scale, jnp.float32).reshape(r))
    return Sparse(v_RxK)

  def _unpack_values(self, arrays: Sparse, dtype) -> jax.Array:
    v = arrays.values
    if self.values == "q8":
      r, k = v.shape
      codes = (v.astype(jnp.int16) + 127).astype(jnp.uint8).reshape(-1)
      return self.q8(k).decode(Payload(Quantized(codes, scale=packing.as_bits(arrays.scale[:, None])), (r, k), dtype))
    return v.astype(dtype)

  def value_bytes(self, shape, dtype) -> int:
    """Bytes of the values part alone (all that index reuse sends backward)."""
    r, k = _rows(shape, self.per)[0], self.k(shape)
    if self.values == "q8":
      return self.q8(k).wire_bytes((r, k), dtype)
    return r * k * (2 if self.values == "bf16" else np.dtype(dtype).itemsize)

  def where(self, payload: Payload) -> jax.Array:
    """Where the payload's values sit, as its message says it (what index reuse keeps of a forward message): the
    packed mask [R, ceil(F/8)] (uint8) when `uses_mask`, else the indices [R, k] (uint16 or int32)."""
    a = payload.arrays
    return a.indices if a.indices is not None else a.mask

  def values_at(self, x, where) -> Payload:
    """The values of x at the positions `where` (as `where` gives them), in position order: a payload of values
    alone (index reuse: the receiver knows the positions). A mask is compacted (`packing.compact`): no [R, k]
    positions are kept between the forward and the backward, and no scatter decodes them."""
    return self._values_at(x, where, exact_top_k=False)

  def _values_at(self, x, where, exact_top_k: bool) -> Payload:
    """`values_at`; with `exact_top_k` (`where` is the exact top-k of x's rows, which holds every row's non-finite
    entries) the non-finite flag reads the k values, not the row: one pass over x less."""
    r, f = _rows(x.shape, self.per)
    if self.uses_mask(x.shape):
      rows = selection.row_view(x, r)  # x's own layout: the compaction gathers from it
      picked = packing.compact(where, f, self.k(x.shape), rows)
    else:
      rows = x.reshape(r, f)
      picked = jnp.take_along_axis(rows, where.astype(jnp.int32), axis=1)
    return Payload(self._pack_values(_flag_nonfinite_rows(picked, picked if exact_top_k else rows)), x.shape, x.dtype)

  def scatter(self, payload: Payload, where) -> jax.Array:
    """Dense tensor from values at the positions `where`, zero elsewhere: inverse of `values_at`."""
    r, f = _rows(payload.shape, self.per)
    values = self._unpack_values(payload.arrays, payload.dtype)
    if self.uses_mask(payload.shape):  # in the rows' own shape (`selection.row_view`): on TPU the tensor's layout
      return packing.expand_rows(where, *selection.row_shape(payload.shape, r), values).reshape(payload.shape)
    return _scatter_rows(values, where.astype(jnp.int32), f).reshape(payload.shape)

  @checked
  @compiled
  def encode(self, x, key=None):
    r, f = _rows(x.shape, self.per)
    if self.uses_mask(x.shape):
      where = self._mask(selection.row_view(x, r), self.k(x.shape))
      sent = {"mask": where}
    else:
      where = self.positions(x)
      sent = {"indices": where.astype(_index_dtype(f))}
    payload = self._values_at(x, where, exact_top_k=self.select != "approx")  # "auto" never picks approx
    return dataclasses.replace(payload, arrays=payload.arrays._replace(**sent))

  @compiled
  def decode(self, payload):
    return self.scatter(payload, self.where(payload))

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

  @checked
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
