"""Exact threshold selection = the set lax.top_k(|x|, k) selects (ties, zeros, NaN, dtypes)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcomp.compress import codecs, packing, selection

# few distinct magnitudes so that ties are common; NaN, +-inf, -0.0 included
VALUES = [0.0, -0.0, 1.0, -1.0, 2.5, -2.5, 1e-3, 3e4, -3e4, np.inf, -np.inf, np.nan]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _reference_mask(x, k):
  idx = np.asarray(jax.lax.top_k(jnp.abs(x), k)[1])
  mask = np.zeros(x.shape, bool)
  mask[np.arange(x.shape[0])[:, None], idx] = True
  return mask


@st.composite
def rows_and_k(draw):
  r = draw(st.sampled_from([1, 3]))
  f = draw(st.sampled_from([1, 7, 40]))
  kind = draw(st.sampled_from(["ties", "floats", "constant", "nan_row"]))
  if kind == "ties":
    x = draw(st.lists(st.sampled_from(VALUES), min_size=r * f, max_size=r * f))
  elif kind == "floats":
    x = draw(st.lists(st.floats(width=32, allow_subnormal=False), min_size=r * f, max_size=r * f))
  else:
    x = [draw(st.sampled_from(VALUES))] * (r * f)
  x = np.array(x, np.float32).reshape(r, f)
  if kind == "nan_row":
    x[0] = np.nan
  k = draw(st.sampled_from([1, f, draw(st.integers(1, f))]))
  return x, k, draw(st.sampled_from(DTYPES)), draw(st.sampled_from([4, selection.SAMPLE]))


@settings(max_examples=25, deadline=None)
@given(rows_and_k())
def test_threshold_mask_is_the_lax_top_k_set(case):
  x, k, dtype, sample = case  # sample=4 < F: the counting loop; SAMPLE >= F: one sort
  x = jnp.asarray(x).astype(dtype)
  mask = np.asarray(selection.top_k_mask(x, k, sample=sample, candidates=2))
  np.testing.assert_array_equal(mask, _reference_mask(x, k))


@pytest.mark.parametrize("sizes", [{}, {"sample": 64, "thresholds": 3, "candidates": 8}], ids=["default", "tiny"])
@pytest.mark.parametrize("kind, fraction", [("normal", 0.001), ("normal", 0.1), ("cauchy", 0.1), ("bf16", 0.1),
                                            ("fp16", 0.3), ("ints", 0.5), ("sparse", 0.1), ("sparse", 0.3),
                                            ("nan_heavy", 0.9)])
def test_threshold_mask_on_long_rows(kind, fraction, sizes):
  """Rows longer than the sample; "tiny" sizes: many counting passes, by class and by position (ties)."""
  keys = jax.random.split(jax.random.key(0), 2)
  shape = (4, 5000)
  x = {"normal": lambda: jax.random.normal(keys[0], shape),
       "cauchy": lambda: jax.random.cauchy(keys[0], shape),
       "bf16": lambda: jax.random.normal(keys[0], shape).astype(jnp.bfloat16),
       "fp16": lambda: jax.random.normal(keys[0], shape).astype(jnp.float16),
       "ints": lambda: jax.random.randint(keys[0], shape, -3, 4).astype(jnp.float32),
       "sparse": lambda: jnp.where(jax.random.uniform(keys[1], shape) < 0.05, jax.random.normal(keys[0], shape), 0.0),
       "nan_heavy": lambda: jnp.where(jax.random.uniform(keys[1], shape) < 0.3, jnp.nan, jax.random.normal(keys[0], shape)),
       }[kind]()
  k = max(1, round(fraction * shape[1]))
  mask = np.asarray(selection.top_k_mask(x, k, **sizes))
  np.testing.assert_array_equal(mask.sum(axis=1), k)
  np.testing.assert_array_equal(mask, _reference_mask(x, k))


@pytest.mark.parametrize("kind", ["ties", "normal"])
@pytest.mark.parametrize("shape", [(3, 40, 16), (2, 5, 1024)])
def test_rows_in_their_own_shape_select_the_set_of_the_flattened_rows(shape, kind):
  """Rows [A, B] (the shape a TPU counts them in, `row_view`) give the bitmask of the same rows flattened to [F]:
  positions i B + j, ties to the lowest, through the counting loop ("tiny" sizes) and the candidates' gather."""
  key = jax.random.key(3)
  x = (jax.random.randint(key, shape, -3, 4).astype(jnp.float32) if kind == "ties" else jax.random.normal(key, shape))
  flat = x.reshape(shape[0], -1)
  for k in (1, flat.shape[1] // 10, flat.shape[1] // 2):
    for sizes in ({"thresholds": selection.THRESHOLDS}, {"sample": 16, "thresholds": 3, "candidates": 8}):
      np.testing.assert_array_equal(selection.top_k_packed(x, k, **sizes), selection.top_k_packed(flat, k, **sizes))
    np.testing.assert_array_equal(selection.top_k_mask(x, k, thresholds=3), _reference_mask(flat, k))


def test_row_view_keeps_the_last_axis_where_it_packs_into_whole_bytes():
  x = jnp.zeros((2, 3, 4, 16))
  assert selection.row_view(x).shape == (2, 12, 16)  # an example's tokens x features
  assert selection.row_view(x, 24).shape == (24, 1, 16)  # rows of the last axis
  assert selection.row_view(jnp.zeros((2, 3, 12))).shape == (2, 1, 36)  # 12 % 8: flattened


@pytest.mark.parametrize("thresholds", [2, 3, selection.THRESHOLDS])
def test_the_counting_loop_takes_at_most_half_its_bound(thresholds):
  """Its trips on rows of ties (7 integers, 95% zeros, 30% NaN) are within the derivation's count (half the
  bound the loop stops at), so the bound ends only a bracket that fails to narrow."""
  keys = jax.random.split(jax.random.key(1), 2)
  shape = (4, 5000)
  rows = [jax.random.randint(keys[0], shape, -3, 4).astype(jnp.float32),
          jnp.where(jax.random.uniform(keys[1], shape) < 0.05, jax.random.normal(keys[0], shape), 0.0),
          jnp.where(jax.random.uniform(keys[1], shape) < 0.3, jnp.nan, jax.random.normal(keys[0], shape))]
  for x in rows:
    for k in (1, 500, 2500, 4500):
      trips = int(selection.counting_trips(x, k, sample=4, thresholds=thresholds, candidates=2))
      assert 0 < trips <= selection.trip_bound(32, shape[1], thresholds) // 2


@pytest.mark.parametrize("selector", selection.SELECTORS)
def test_positions_of_every_selector(selector):
  x = jax.random.normal(jax.random.key(1), (3, 300))
  pos = np.asarray(selection.top_k_positions(x, 30, selector))
  assert pos.shape == (3, 30)
  np.testing.assert_array_equal(np.sort(pos, axis=1), np.sort(np.asarray(jax.lax.top_k(jnp.abs(x), 30)[1]), axis=1))
  if selector == "threshold":  # ascending position order
    assert (np.diff(pos, axis=1) > 0).all()


def test_bad_selector():
  with pytest.raises(ValueError, match="selector must be one of"):
    selection.top_k_positions(jnp.ones((1, 4)), 2, "heap")


@pytest.mark.parametrize("r, f", [(1, 1), (3, 13), (2, 64)])
def test_compact_and_expand_are_prefix_sum_inverses(r, f):
  rng = np.random.default_rng(f)
  mask = rng.random((r, f)) < 0.4
  mask[:, 0] = True  # at least one per row
  k = int(mask.sum(axis=1).min())
  packed = packing.pack_mask(mask)
  np.testing.assert_array_equal(np.asarray(packing.mask_ranks(packed, f)), np.cumsum(mask, axis=1) - mask)
  operand = jnp.asarray(rng.normal(size=(r, f)), jnp.float32)
  positions = np.asarray(packing.compact(packed, f, k))
  expected = [np.flatnonzero(row)[:k] for row in mask]
  np.testing.assert_array_equal(positions, expected)
  values = packing.compact(packed, f, k, operand)
  np.testing.assert_array_equal(np.asarray(values), np.take_along_axis(np.asarray(operand), positions, axis=1))
  full = mask & (np.cumsum(mask, axis=1) <= k)  # the first k set bits of each row
  dense = np.asarray(packing.expand(packing.pack_mask(full), f, values))
  np.testing.assert_array_equal(dense, np.where(full, np.asarray(operand), 0.0))


@pytest.mark.parametrize("density", [0.0, 0.05, 0.5, 1.0])
@pytest.mark.parametrize("k", [1, 7, 40])
def test_compact_takes_the_first_k_set_positions_and_pads_with_zero(density, k):
  rng = np.random.default_rng(k)
  r, f = 4, 37
  mask = rng.random((r, f)) < density
  operand = rng.normal(size=(r, f)).astype(np.float32)
  expected = np.zeros((r, k), np.int32)
  for i, row in enumerate(mask):
    first = np.flatnonzero(row)[:k]
    expected[i, : len(first)] = first
  filled = np.arange(k) < mask.sum(axis=1, keepdims=True)
  packed = packing.pack_mask(jnp.asarray(mask))
  np.testing.assert_array_equal(np.asarray(packing.compact(packed, f, k)), expected)
  np.testing.assert_array_equal(np.asarray(packing.compact(packed, f, k, jnp.asarray(operand))),
                                np.where(filled, np.take_along_axis(operand, expected, axis=1), 0.0))


def test_auto_selects_by_platform_and_fraction():
  """On CPU the threshold selection from K = 3% up (measured faster there), lax.top_k below; on GPU and TPU the
  threshold (no sort of the row in its compiled program)."""
  assert codecs.TopK(0.1).selector("cpu") == codecs.TopK(codecs.THRESHOLD_FROM_FRACTION_CPU).selector("cpu") == "threshold"
  assert codecs.TopK(0.1).selector("cuda") == codecs.TopK(0.001).selector("cuda") == "threshold"
  assert codecs.TopK(0.1).selector("tpu") == codecs.TopK(0.001).selector("tpu") == "threshold"
  assert codecs.TopK(0.001).selector("cpu") == codecs.TopK(0.1, select="sort").selector("tpu") == "sort"
