"""Exact per-row top-k by magnitude without sorting the row: the set `lax.top_k(|x|, k)` selects.

Every entry gets a distinct key (m, p): m the bit pattern of |x| in its format (16-bit floats) or
fp32, in classes of equal rank (zero and subnormals, which XLA compares as zero; each normal or
infinite pattern; every NaN, above +inf), and p = F - 1 - position, compared lexicographically:
equal magnitudes rank lowest position first, as in `lax.top_k`. The top-k set is {key >= K}, K
the k-th largest key, found by counting c(t) = #{key >= t}. One pass over the row counts at M
thresholds at once, inside a bracket [lo, hi) with c(lo) >= k > c(hi), and keeps the two around
the k-th: the first pass at order statistics of a sorted strided sample of the row, later ones
at the class after lo's, then even steps in the bracket's patterns (or in the positions, once one
class is left). Once at most C keys lie in the bracket, a last pass writes the packed bitmask of
{key >= hi} and of the bracket's keys; those are compacted, sorted (C entries, not the row), and
the k - c(hi) largest set in the mask. On continuous data (normal, t3, GELU, bf16 rows of 786,432)
the first pass at M = 16 leaves at most C and the loop does not run (at the CPU's M = 8, one
trip): two passes over the row besides its strided sample, no sort of it, no copy of it; rows of a
few distinct values (ties) take 3-4 trips (`counting_trips`). A row may come as [A, B] (an example's
tokens x features, B % 8 == 0: `row_view`), its entries in row-major order: on TPU every pass reads it in
that shape, since flattening it to [F] relays the whole activation out. Entry points are jitted with k and
the sizes static.
"""
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp.compress import packing

SELECTORS = ("threshold", "sort", "approx")
SAMPLE = 4096  # strided sample per row for the first pass's thresholds
THRESHOLDS = 16  # counts per pass over the row (M) on GPU and TPU
THRESHOLDS_CPU = 8  # on CPU, where XLA's count at 16 takes 2-7x its time at 8 (docs/results/codec_cost_cpu.md)
CANDIDATES = 4096  # keys left in the bracket from which they are sorted (C)


class KeySpace(NamedTuple):
  """Magnitude keys of one float format: the pattern of |x| as a uint32, and its classes of equal
  rank: [0, tiny) (zero, subnormals), each pattern up to +inf, [nan, top) (every NaN)."""
  unsigned: type  # the format's unsigned integer of the same width
  float: type  # the format the row is read in
  tiny: int  # the smallest normal's pattern
  nan: int  # the lowest NaN pattern (+inf's + 1)

  @property
  def top(self):
    """Above every pattern: the sign bit."""
    return jnp.uint32(1 << (8 * jnp.dtype(self.unsigned).itemsize - 1))

  def keys(self, x) -> jax.Array:
    """Uint32 raw patterns of |x|: an abs and a bitcast, which XLA fuses into whatever reads them."""
    return jax.lax.bitcast_convert_type(jnp.abs(x.astype(self.float)), self.unsigned).astype(jnp.uint32)

  def lowest(self, m) -> jax.Array:
    """The lowest pattern of m's class."""
    return jnp.where(m < self.tiny, jnp.uint32(0), jnp.minimum(m, jnp.uint32(self.nan)))

  def after(self, t) -> jax.Array:
    """The lowest pattern of the class after t's (t a class's lowest)."""
    return jnp.where(t == 0, jnp.uint32(self.tiny), jnp.where(t >= self.nan, self.top, t + 1))

  def at_least(self, m, p, tm, tp) -> jax.Array:
    """Key (class of m, p) >= (tm, tp), tm a class's lowest pattern."""
    return (m >= self.after(tm)) | ((m >= tm) & (p >= tp))


_SPACES = {jnp.dtype(jnp.bfloat16): KeySpace(jnp.uint16, jnp.bfloat16, 0x0080, 0x7F81),
           jnp.dtype(jnp.float16): KeySpace(jnp.uint16, jnp.float16, 0x0400, 0x7C01)}
FP32 = KeySpace(jnp.uint32, jnp.float32, 0x00800000, 0x7F800001)


def key_space(dtype) -> KeySpace:
  """The keys a row of `dtype` is ranked by (16-bit floats their own patterns, others fp32's)."""
  return _SPACES.get(jnp.dtype(dtype), FP32)


def _position_keys(a: int, b: int) -> jax.Array:
  """Int32 [A, B]: p = F - 1 - position, position = i B + j of entry (i, j) of a row [A, B] (F = A B; the first
  position ranks highest among equal magnitudes)."""
  return jnp.arange(a * b - 1, -1, -1, dtype=jnp.int32).reshape(a, b)


def row_view(x, rows: int | None = None) -> jax.Array:
  """x's entries as `rows` rows (default: its leading axis) of [A, B] each, in row-major order: B x's last axis
  where whole bytes of a row's bitmask fall in it (B % 8 == 0) and the rows split x's other axes, else [1, F].
  The view keeps x's own layout: a TPU tiles an array's last two axes, and a row flattened to [F] is a copy of
  x relaid out (a pass to read and one to write it back)."""
  rows = x.shape[0] if rows is None else rows
  return x.reshape(rows, *row_shape(x.shape, rows))


def row_shape(shape, rows: int) -> tuple[int, int]:
  """(A, B): the shape of each of `rows` rows of an array of `shape` in `row_view`."""
  lead = math.prod(shape[:-1])
  if len(shape) >= 2 and shape[-1] % 8 == 0 and lead % rows == 0:
    return lead // rows, shape[-1]
  return 1, math.prod(shape) // rows


def _rows_of(x) -> jax.Array:
  """[R, A, B]: x itself if 3-D, else its rows [R, F] as [R, 1, F]."""
  return x if x.ndim == 3 else x.reshape(x.shape[0], 1, -1)


def _spaced(lo, hi, m: int):
  """M ints per row evenly spaced inside (lo, hi), ascending (repeats where the gap is small)."""
  frac = jnp.arange(1, m + 1, dtype=jnp.float32) / (m + 1)
  step = jnp.floor((hi - lo).astype(jnp.float32)[:, None] * frac).astype(lo.dtype)
  return jnp.clip(lo[:, None] + step, lo[:, None] + 1, jnp.maximum(hi - 1, lo + 1)[:, None])


def trip_bound(bits: int, f: int, thresholds: int) -> int:
  """The most trips the counting loop takes: a trip leaves a bracket of g patterns (or positions) at most
  g / M + 1 wide, so ceil(log_M 2^bits) trips by pattern and ceil(log_M F) by position, + 2, suffice; the
  loop stops at twice that, so a bracket that fails to narrow ends (with a wrong mask) instead of looping on."""
  per_trip = math.log2(max(thresholds, 2))
  return 2 * (math.ceil(bits / per_trip) + math.ceil(math.log2(max(f, 2)) / per_trip) + 2)


def _bracket(x_RxAxB, k: int, sample: int, thresholds: int, c_max: int):
  """((lo_m, lo_p, c(lo), hi_m, hi_p, c(hi)) per row, with c(lo) >= k > c(hi) and c(lo) - c(hi) <= c_max; the
  counting loop's trips after the first pass)."""
  r, a, b = x_RxAxB.shape
  f = a * b
  space = key_space(x_RxAxB.dtype)

  # the sample: entries j * stride of the row (position order), gathered (a strided slice of a long row runs out
  # of TPU VMEM at compile time, and a reshape of its last axis relays x out on a TPU)
  stride = max(1, f // sample)
  n = min(sample, f // stride)
  sampled = packing.at_positions(x_RxAxB, jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) * stride, (r, n)))
  sampled = jnp.sort(space.lowest(space.keys(sampled)), axis=1)
  q = k / f  # the k-th largest's rank in the sample: n (1 - q) +- 3 binomial deviations (evenly), and +- 6
  z = [-6.0, *[-3.0 + 6.0 * i / max(thresholds - 3, 1) for i in range(thresholds - 2)], 6.0][-thresholds:]
  ranks = [n * (1.0 - q) + (n * q * (1.0 - q)) ** 0.5 * zi + (1 if zi > 0 else -1) for zi in sorted(z)]
  from_sample = sampled[:, jnp.clip(jnp.array(ranks), 0, n - 1).astype(jnp.int32)]

  def count_pass(state, thresholds_of):
    """The bracket after counting at `thresholds_of(state)` (ascending); rows with at most C left keep theirs."""
    lo_m, lo_p, c_lo, hi_m, hi_p, c_hi = state
    t_m, t_p = thresholds_of(state)
    # one reduction of [R, A, B, M] (M counts per read of the row; XLA fuses the keys and positions into it: made
    # here, not outside the loop, whose body would read them from memory)
    ge = space.at_least(space.keys(x_RxAxB)[..., None], _position_keys(a, b)[None, :, :, None],
                        t_m[:, None, None, :], t_p[:, None, None, :])
    c = jnp.sum(ge, axis=(1, 2), dtype=jnp.float32 if f < 1 << 24 else jnp.int32).astype(jnp.int32)
    up = jnp.sum(c >= k, axis=1)  # counts descend: the first `up` thresholds keep c >= k
    below, above = jnp.maximum(up - 1, 0)[:, None], jnp.minimum(up, thresholds - 1)[:, None]
    pick = lambda a, i: jnp.take_along_axis(a, i, axis=1)[:, 0]
    open_ = c_lo - c_hi > c_max
    new_lo, new_hi = open_ & (up > 0), open_ & (up < thresholds)
    return (jnp.where(new_lo, pick(t_m, below), lo_m), jnp.where(new_lo, pick(t_p, below), lo_p),
            jnp.where(new_lo, pick(c, below), c_lo), jnp.where(new_hi, pick(t_m, above), hi_m),
            jnp.where(new_hi, pick(t_p, above), hi_p), jnp.where(new_hi, pick(c, above), c_hi))

  def sampled_thresholds(state):
    return jnp.clip(from_sample, state[0][:, None], state[3][:, None] - 1), jnp.zeros_like(from_sample)

  def spaced_thresholds(state):
    """The class after lo's (a row of few distinct magnitudes ends its search by class there), then even steps
    to hi; once one class is left in [lo, hi), even steps in its positions."""
    lo_m, lo_p, _, hi_m, hi_p, _ = state
    one_class = (hi_m <= space.after(lo_m))[:, None]
    first = jnp.minimum(space.after(lo_m), hi_m - 1)
    by_class = space.lowest(jnp.concatenate([first[:, None], _spaced(first, hi_m, thresholds - 1)], axis=1))
    by_position = _spaced(lo_p, jnp.where(hi_m == lo_m, hi_p, f), thresholds)
    return jnp.where(one_class, lo_m[:, None], by_class), jnp.where(one_class, by_position, 0)

  zeros, m0 = jnp.zeros(r, jnp.int32), jnp.zeros(r, jnp.uint32)  # every key is >= (0, 0): c = F; none is >= (top, 0)
  state = count_pass((m0, zeros, zeros + f, m0 + space.top, zeros, zeros), sampled_thresholds)
  bound = trip_bound(jnp.dtype(space.unsigned).itemsize * 8, f, thresholds)
  return jax.lax.while_loop(lambda s: jnp.any(s[0][2] - s[0][5] > c_max) & (s[1] < bound),
                            lambda s: (count_pass(s[0], spaced_thresholds), s[1] + 1), (state, jnp.int32(0)))


@functools.partial(jax.jit, static_argnames=("k", "sample", "thresholds", "candidates"))
def counting_trips(x_RxF, k: int, sample: int = SAMPLE, thresholds: int = THRESHOLDS,
                   candidates: int = CANDIDATES) -> jax.Array:
  """Int32: the passes over the rows `top_k_packed` counts in after its first (its loop's trips, data-dependent:
  a compiled program's cost counts them once), at `thresholds` (GPU's and TPU's M by default; THRESHOLDS_CPU
  for what a CPU program does)."""
  rows = _rows_of(x_RxF)
  return _bracket(rows, k, sample, thresholds, min(candidates, rows.shape[1] * rows.shape[2]))[1]


@functools.partial(jax.jit, static_argnames=("k", "sample", "thresholds", "candidates"))
def top_k_packed(x_RxF, k: int, sample: int = SAMPLE, thresholds: int | None = None,
                 candidates: int = CANDIDATES) -> jax.Array:
  """Uint8 [R, ceil(F/8)] (`packing.pack_mask`'s layout) with exactly k bits set per row: the entries
  `lax.top_k(|x|, k)` returns. x: rows [R, F], or [R, A, B] (each row's F = A B entries in row-major order,
  B % 8 == 0 unless A == 1: `row_view`). `sample`, `thresholds`, `candidates`: the sizes above (exact for any;
  `thresholds` by default THRESHOLDS_CPU in a program compiled for the CPU, THRESHOLDS elsewhere). By default rows
  [R, A, B] are counted, masked and gathered from in that shape on TPU, where it is x's own layout, and flattened
  elsewhere (on GPU that moves less); given `thresholds`, in the shape given."""
  x_RxAxB = _rows_of(x_RxF)
  flat = lambda x: x.reshape(x.shape[0], 1, -1)
  if thresholds is None:
    return jax.lax.platform_dependent(
        x_RxAxB, cpu=lambda x: _packed(flat(x), k, sample, THRESHOLDS_CPU, candidates),
        tpu=lambda x: _packed(x, k, sample, THRESHOLDS, candidates),
        default=lambda x: _packed(flat(x), k, sample, THRESHOLDS, candidates))
  return _packed(x_RxAxB, k, sample, thresholds, candidates)


def _packed(x_RxAxB, k: int, sample: int, thresholds: int, candidates: int) -> jax.Array:
  r, a, b = x_RxAxB.shape
  f = a * b
  space = key_space(x_RxAxB.dtype)
  c_max = min(candidates, f)
  (lo_m, lo_p, c_lo, hi_m, hi_p, c_hi), _ = _bracket(x_RxAxB, k, sample, thresholds, c_max)

  m, p = space.keys(x_RxAxB), _position_keys(a, b)[None]
  at = lambda t: t[:, None, None]
  sure = space.at_least(m, p, at(hi_m), at(hi_p))
  packed = packing.pack_mask(sure)
  bracket = packing.pack_mask(space.at_least(m, p, at(lo_m), at(lo_p)) & ~sure)
  slots = packing.compact(bracket, f, c_max)
  filled = jnp.arange(c_max) < (c_lo - c_hi)[:, None]
  key = space.lowest(space.keys(packing.at_positions(x_RxAxB, slots)))
  # largest key first: class descending (top - class ascending; empty slots last), then position
  _, ranked = jax.lax.sort((jnp.where(filled, space.top - key, space.top + 1), slots), dimension=1, num_keys=2)
  taken = jnp.arange(c_max) < (k - c_hi)[:, None]
  byte = jnp.where(taken, ranked >> 3, packed.shape[1])  # past the end: dropped
  bit = jnp.uint8(1) << (ranked & 7).astype(jnp.uint8)
  return packed.at[jnp.arange(r)[:, None], byte].add(bit, mode="drop")  # distinct bits: the add sets them


def top_k_mask(x_RxF, k: int, **sizes) -> jax.Array:
  """Bool [R, F] with exactly k True per row: the entries `lax.top_k(|x|, k)` returns (`top_k_packed`)."""
  return packing.unpack_mask(top_k_packed(x_RxF, k, **sizes), math.prod(x_RxF.shape[1:]))


@functools.partial(jax.jit, static_argnames=("k", "selector"))
def top_k_positions(x_RxF, k: int, selector: str = "threshold") -> jax.Array:
  """Int32 [R, k] positions of the k largest |x| per row.

  "threshold": the set of `top_k_packed`, in ascending position order. "sort": `lax.top_k`
  (same set, by descending |x|). "approx": `lax.approx_max_k` (recall target 0.95 on TPU;
  exact elsewhere).
  """
  if selector == "threshold":
    return packing.compact(top_k_packed(x_RxF, k), x_RxF.shape[1], k, None)
  magnitude = jnp.abs(x_RxF)
  if selector == "sort":
    return jax.lax.top_k(magnitude, k)[1]
  if selector == "approx":
    return jax.lax.approx_max_k(magnitude, k, recall_target=0.95)[1]
  raise ValueError(f"selector must be one of {SELECTORS}, got {selector!r}")
