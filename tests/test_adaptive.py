"""jaxcomp.compress.adaptive: token-adaptive bit widths."""
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcomp.compress import codecs
from jaxcomp.compress.adaptive import TokenAdaptive, interleave_gathered, interleave_scattered, peakiness


def _x(shape, dtype=jnp.float32, seed=0):
  return (jax.random.normal(jax.random.key(seed), shape) * 3 + 1).astype(dtype)


def test_adaptive_gives_high_bits_to_the_peakiest_tokens():
  x = _x((2, 8, 32), seed=4)
  x = x.at[0, 2, 7].set(60.0).at[1, 5, 1].set(-80.0)  # two tokens with one outlier each
  codec = TokenAdaptive(2, 8, 0.125, clip=1.0)  # 2 of 16 tokens get 8 bits; unclipped: the half-step bound
  payload = codec.encode(x)
  is_high = np.unpackbits(np.asarray(payload.arrays.bitmap), bitorder="little")[:16].astype(bool)
  assert sorted(np.flatnonzero(is_high)) == [2, 13]
  p = np.asarray(peakiness(x.reshape(16, 32)))
  assert p[is_high].min() > p[~is_high].max()
  err = np.abs(np.asarray(codec.decode(payload) - x)).reshape(16, 32)
  scales = np.abs(np.asarray(x)).reshape(16, 32).max(1)
  bound = np.where(is_high, scales / 254, scales / 2)  # half a max-abs step of 8 and 2 bits: s / (2L)
  assert np.all(err.max(1) <= bound * (1.001) + 1e-6)


@settings(max_examples=4, deadline=None)
@given(st.integers(2, 40), st.floats(0.01, 0.99), st.integers(0, 10**6), st.sampled_from(codecs.MAXABS_GRIDS))
def test_adaptive_round_trip_bound_any_rows_and_fraction(rows, fraction, seed, grid):
  x = _x((rows, 16), seed=seed)
  codec = TokenAdaptive(3, 5, fraction, grid=grid, clip=1.0)
  _, n_high, _ = codec.split(x.shape)
  assert 1 <= n_high <= rows
  payload = jax.jit(codec.encode)(x)
  assert codecs.nbytes(payload) == codec.wire_bytes(x.shape, x.dtype)
  err = np.abs(np.asarray(jax.jit(codec.decode)(payload) - x)).max(1)
  assert np.all(err <= np.abs(np.asarray(x)).max(1) / 6 * 1.002 + 1e-6)  # 3-bit bound s / (2D) <= s / 6, every row


def test_adaptive_sends_nothing_for_a_width_without_rows():
  """One row (or a fraction that takes every row) leaves the low width empty: no zero-size encode, no bytes."""
  for codec, shape in ((TokenAdaptive(3, 5, 0.25), (1, 16)), (TokenAdaptive(3, 5, 0.9), (2, 3, 16))):
    x = _x(shape)
    payload = codec.encode(x)
    assert set(payload.parts()) == {"bitmap", "high"}
    assert codecs.nbytes(payload) == codec.wire_bytes(shape, x.dtype)
    err = np.abs(np.asarray(codec.decode(payload) - x)).reshape(-1, 16).max(1)
    assert np.all(err <= np.abs(np.asarray(x)).reshape(-1, 16).max(1) / 30 * 1.002 + 1e-6)  # 5 bits: s / (2L)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.booleans(), min_size=2, max_size=40).filter(lambda m: 0 < sum(m) < len(m)))
def test_both_interleavings_put_each_width_back_in_row_order(mask):
  """The gather (GPU and TPU) and the scatters (CPU) give the same rows: marked row i is the next high row, the
  others the next low row (the decode's two lowerings; this machine's decode runs the scatters)."""
  is_high = np.array(mask)
  high = np.arange(is_high.sum() * 3, dtype=np.float32).reshape(-1, 3) + 1
  low = -np.arange((~is_high).sum() * 3, dtype=np.float32).reshape(-1, 3) - 1
  want = np.zeros((len(mask), 3), np.float32)
  want[is_high], want[~is_high] = high, low
  for interleave in (interleave_gathered, interleave_scattered):
    np.testing.assert_array_equal(np.asarray(jax.jit(interleave)(high, low, jnp.asarray(is_high))), want)
