"""jaxcomp.parallel.padded_rows: per-stage trees as padded rows, and back (hypothesis round trips)."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcomp.parallel import padded_rows

SHAPES = st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple)


@st.composite
def stage_trees(draw, dtypes=(jnp.float32, jnp.int32)):
  """1-4 stages, each a dict of 0-3 leaves of any small shape; ints stay below 2^24 (exact in float32)."""
  trees = []
  for _ in range(draw(st.integers(1, 4))):
    tree = {}
    for j in range(draw(st.integers(0, 3))):
      shape, dtype = draw(SHAPES), draw(st.sampled_from(dtypes))
      values = np.random.default_rng(draw(st.integers(0, 2**16))).integers(-2**23, 2**23, shape)
      tree[f"w{j}"] = jnp.asarray(values if dtype == jnp.int32 else values / 7.0, dtype)
    trees.append(tree)
  return tuple(trees)


@settings(max_examples=12, deadline=None)
@given(trees=stage_trees())
def test_flat_rows_round_trip_any_stage_trees(trees):
  rows = padded_rows.FlatRows(trees)
  stacked = rows.stack(trees)
  chex.assert_shape(stacked, (len(trees), max(1, *rows.sizes)))
  chex.assert_trees_all_equal(rows.unstack(stacked), trees)
  for s, size in enumerate(rows.sizes):  # the padding is zero
    chex.assert_trees_all_equal(stacked[s, size:], jnp.zeros((rows.size - size,), stacked.dtype))


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 4), shape=SHAPES, extra=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_pad_unpad_and_table_rows_round_trip(rows, shape, extra, seed):
  x = jax.random.normal(jax.random.key(seed), (rows, *shape))
  size = padded_rows.feature_size(x.shape) + extra
  padded = padded_rows.pad(x, size, jnp.float32)
  chex.assert_shape(padded, (rows, size))
  chex.assert_trees_all_equal(padded_rows.unpad(padded, x), x)
  table = jnp.zeros((rows + 3, size))
  where = jnp.arange(rows)[::-1] + 2
  table = padded_rows.put_rows(table, where, x)
  chex.assert_trees_all_equal(padded_rows.gather_rows(table, where, x), x)
  chex.assert_trees_all_equal(table[:2], jnp.zeros((2, size)))  # rows not written stay as they were


@settings(max_examples=15, deadline=None)
@given(trees=stage_trees(dtypes=(jnp.float32,)))
def test_optimizer_state_splits_by_stage_and_merges_back(trees):
  params = tuple({**t, "b": jnp.ones((2,))} for t in trees)  # a leaf each, so every stage has a slot to split
  state = optax.adam(1e-3).init(params)
  per_stage = padded_rows.split_by_stage(state, params)
  assert len(per_stage) == len(params)
  for s, stage_state in enumerate(per_stage):
    chex.assert_trees_all_equal_structs(stage_state, optax.adam(1e-3).init(params[s]))
  chex.assert_trees_all_equal(padded_rows.merge_stages(per_stage, params), state)
