"""Exact per-row top-k by magnitude without sorting: the set `lax.top_k(|x|, k)` selects.

Order: NaN > +inf > ... > 0 on |x| (every NaN ranks equal), and equal magnitudes rank by
position, lowest first, as in `lax.top_k`. The k-th largest magnitude T of a row is found
by counting: c(t) = #{|x| >= t} is evaluated at guessed thresholds, each guess a secant step
on c inside a bracket [lo, hi) with c(lo) >= k > c(hi) (bisection on the fp32 bit pattern
when the secant stalls; the first bracket comes from a sorted strided sample of the row).
Near the end each pass also returns the nearest entries on either side of t, which snaps
the bracket onto data values, so ties and discrete data end in a few passes. Every pass is
one read of the rows (no sort, no scatter). The set is then {|x| > T} plus the first
k - #{|x| > T} entries equal to T (bit-packed mask, prefix counts). The entry points are
jitted with k and the sample size static: an eager call compiles one program.
"""
import functools

import jax
import jax.numpy as jnp

from jaxcomp.compress import packing

SELECTORS = ("threshold", "sort", "approx")
SAMPLE = 128  # strided sample per row for the first bracket (A/B vs 1024: round trip 0.44 vs 0.52 ms at [4, 8192], equal at [8, 98304])
SNAP_WIDTH = 16  # bracket width (entries) from which passes also snap to data values
_BEYOND_INF = 0x7F800001  # fp32 bit pattern just above +inf: no magnitude reaches it
_TINY = 0x00800000  # smallest normal fp32: XLA flushes subnormals to 0 in comparisons


def _bits(f):
  return jax.lax.bitcast_convert_type(f, jnp.int32)


def _float(b):
  return jax.lax.bitcast_convert_type(b, jnp.float32)


def magnitudes(x_RxF) -> jax.Array:
  """|x| in fp32 with NaN -> -1 (thresholds t >= 0 never count NaNs) and subnormals -> 0.

  XLA compares fp32 subnormals as zero (flush-to-zero), so they rank as zeros here.
  """
  a = jnp.abs(x_RxF.astype(jnp.float32))
  return jnp.where(jnp.isnan(a), -1.0, jnp.where(a < _float(_TINY), 0.0, a))


def _count(mask):
  """Per-row number of True entries (fp32 sums are exact below 2^24 and faster than int32)."""
  dtype = jnp.float32 if mask.shape[1] < 1 << 24 else jnp.int32
  return jnp.sum(mask, axis=1, dtype=dtype).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("sample",))
def kth_largest(s_RxF, k_R, sample: int = SAMPLE) -> jax.Array:
  """The k-th largest entry T [R] of each row of s (entries < 0 never count).

  Needs 1 <= k_R <= #{s >= 0} per row. T is exact: c(T) >= k > c(next float above T).
  `sample`: entries per row sorted for the first bracket (the whole row if F <= sample).
  """
  r, f = s_RxF.shape
  stride = max(1, f // sample)
  # sorted as int32 bit patterns: the same order for s >= 0 and -1 (NaN) first; XLA:CPU sorts ints ~8x faster
  n = min(sample, f // stride)  # entries j * stride, j < n, taken by a reshape (a strided slice of a long row
  sampled = s_RxF[:, : n * stride].reshape(r, n, stride)[:, :, 0]  # runs out of TPU VMEM at compile time)
  sample = jnp.sort(_bits(sampled), axis=1)
  n = sample.shape[1]
  if n == f:  # the sample is the whole row
    return _float(jnp.take_along_axis(sample, (f - k_R)[:, None], axis=1)[:, 0])
  counts = lambda t_RxM: jnp.stack([_count(s_RxF >= _float(t)[:, None]) for t in t_RxM.T], axis=1)

  def shrink(lo, c_lo, hi, c_hi, t_RxM, c_RxM):
    """Tightest bracket from counts at thresholds t (ascending per row)."""
    up = c_RxM >= k_R[:, None]
    lo = jnp.maximum(lo, jnp.max(jnp.where(up, t_RxM, 0), axis=1))
    c_lo = jnp.minimum(c_lo, jnp.min(jnp.where(up, c_RxM, f), axis=1))
    hi = jnp.minimum(hi, jnp.min(jnp.where(up, _BEYOND_INF, t_RxM), axis=1))
    c_hi = jnp.maximum(c_hi, jnp.max(jnp.where(up, 0, c_RxM), axis=1))
    return lo, c_lo, hi, c_hi

  # first bracket: the sample's order statistics at the k-th largest +- 3 binomial deviations
  q = k_R / f
  margin = 3.0 * jnp.sqrt(n * q * (1.0 - q)) + 1.0
  ranks = n * (1.0 - q)[:, None] + jnp.stack([-margin, margin], axis=1)
  t = jnp.maximum(jnp.take_along_axis(sample, jnp.clip(ranks, 0, n - 1).astype(jnp.int32), axis=1), _TINY)
  bracket = shrink(jnp.zeros(r, jnp.int32), _count(s_RxF >= 0), jnp.full(r, _BEYOND_INF, jnp.int32),
                   jnp.zeros(r, jnp.int32), t, counts(t))

  def clip(t, lo, hi):  # a threshold strictly inside the bracket, never subnormal
    return jnp.clip(t, jnp.maximum(lo + 1, _TINY), hi - 1)

  def count_pass(state):
    """Two thresholds aimed at counts k +- 4^misses sqrt(width) by linear interpolation."""
    lo, c_lo, hi, c_hi, misses = state
    width = (c_lo - c_hi).astype(jnp.float32)
    spread = (jnp.sqrt(width) + 1.0) * 4.0**misses
    target = jnp.stack([k_R + spread, k_R - 1.0 - spread], axis=1)
    frac = (c_lo[:, None] - target) / width[:, None]
    lo_f, hi_f = _float(lo)[:, None], _float(hi)[:, None]
    aimed = _bits(lo_f + (hi_f - lo_f) * jnp.clip(frac, 0.0, 1.0))
    thirds = lo[:, None] + ((hi - lo) // 3)[:, None] * jnp.arange(1, 3)
    t = jnp.where((hi >= _BEYOND_INF - 1)[:, None], thirds, aimed)
    t = clip(t, lo[:, None], hi[:, None])
    return shrink(lo, c_lo, hi, c_hi, t, counts(t)), False

  def snap_pass(state):
    """One threshold at count k - 1/2; the bracket snaps to the nearest entries around it."""
    lo, c_lo, hi, c_hi, _ = state
    width = jnp.maximum(c_lo - c_hi, 1).astype(jnp.float32)
    frac = (c_lo - k_R + 0.5) / width
    aimed = _bits(_float(lo) + (_float(hi) - _float(lo)) * frac)
    t = jnp.where(hi >= _BEYOND_INF - 1, lo + (hi - lo) // 2, aimed)
    t = clip(t, lo, hi)
    ge = s_RxF >= _float(t)[:, None]
    c = _count(ge)
    min_ge = _bits(jnp.min(jnp.where(ge, s_RxF, jnp.inf), axis=1))
    max_lt = _bits(jnp.max(jnp.where(ge, -1.0, s_RxF), axis=1))
    up = c >= k_R
    # c == k: T is the smallest entry >= t; c == k - 1: the largest entry < t
    lo = jnp.where(up, min_ge, jnp.where(c == k_R - 1, max_lt, lo))
    hi = jnp.where(up, jnp.where(c == k_R, min_ge + 1, hi), max_lt + 1)
    return (lo, jnp.where(up, c, c_lo), hi, jnp.where(up, c_hi, c)), True

  def unresolved(lo, hi):  # more than one candidate value left in [lo, hi)
    return (hi - lo > 1) & (hi > _TINY)

  def body(state):
    lo, c_lo, hi, c_hi, misses = state
    active = unresolved(lo, hi)
    snap = jnp.any(active & (misses >= 2)) | jnp.all(~active | (c_lo - c_hi <= SNAP_WIDTH))
    (new_lo, new_c_lo, new_hi, new_c_hi), snapped = jax.lax.cond(snap, snap_pass, count_pass, state)
    keep = lambda new, old: jnp.where(active, new, old)
    halved = 2 * (new_c_lo - new_c_hi) <= c_lo - c_hi
    misses = jnp.where(snapped | halved, 0, misses + 1)
    return keep(new_lo, lo), keep(new_c_lo, c_lo), keep(new_hi, hi), keep(new_c_hi, c_hi), misses

  # misses start at 1: the sample's bracket is too wide to interpolate linearly (`ones_like` varies over the
  # mesh axes the bracket does: under shard_map with check_vma a loop's carry keeps its type)
  state = (*bracket, jnp.ones_like(bracket[0]))
  lo = jax.lax.while_loop(lambda s: jnp.any(unresolved(s[0], s[2])), body, state)[0]
  return _float(lo)


@functools.partial(jax.jit, static_argnames=("k", "sample"))
def top_k_mask(x_RxF, k: int, sample: int = SAMPLE) -> jax.Array:
  """Bool [R, F] with exactly k True per row: the entries `lax.top_k(|x|, k)` returns."""
  r, f = x_RxF.shape
  s = magnitudes(x_RxF)
  nan = s < 0
  n_nan = _count(nan)
  k_finite = k - n_nan  # entries to take below NaN
  threshold = kth_largest(s, jnp.maximum(k_finite, 1), sample)
  nan_ties = k_finite <= 0  # NaNs alone fill the row: the first k of them
  above = jnp.where(nan_ties[:, None], False, nan | (s > threshold[:, None]))
  tied = jnp.where(nan_ties[:, None], nan, s == threshold[:, None])
  need = k - _count(above)

  def first_of_tied(tied):
    packed = packing.pack_mask(tied)
    return tied & (packing.mask_ranks(packed, f) < need[:, None])

  take_all = jnp.all(_count(tied) == need)
  return above | jax.lax.cond(take_all, lambda t: t, first_of_tied, tied)


@functools.partial(jax.jit, static_argnames=("k", "selector"))
def top_k_positions(x_RxF, k: int, selector: str = "threshold") -> jax.Array:
  """Int32 [R, k] positions of the k largest |x| per row.

  "threshold": the set of `top_k_mask`, in ascending position order. "sort": `lax.top_k`
  (same set, by descending |x|). "approx": `lax.approx_max_k` (recall target 0.95 on TPU;
  exact elsewhere).
  """
  if selector == "threshold":
    mask = top_k_mask(x_RxF, k)
    return packing.compact(packing.pack_mask(mask), x_RxF.shape[1], k, None)
  magnitude = jnp.abs(x_RxF)
  if selector == "sort":
    return jax.lax.top_k(magnitude, k)[1]
  if selector == "approx":
    return jax.lax.approx_max_k(magnitude, k, recall_target=0.95)[1]
  raise ValueError(f"selector must be one of {SELECTORS}, got {selector!r}")
