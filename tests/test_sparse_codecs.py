"""The sparse codecs: TopK (exactly the k largest, its position and value formats, index reuse) and RandK."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp.compress import codecs
from codec_cases import normal_input


@pytest.mark.parametrize("fraction, shape", [(0.5, (4, 3, 8, 8)), (0.3, (2, 64, 48)), (0.2, (3, 1000)),
                                             *(pytest.param(*case, marks=pytest.mark.slow)  # each shape again
                                               for case in [(0.1, (4, 3, 8, 8)), (0.05, (2, 64, 48)), (0.02, (3, 1000))])])
def test_topk_keeps_exactly_the_largest(fraction, shape):
  x = normal_input(shape, seed=int(fraction * 100))
  codec = codecs.TopK(fraction)
  x_hat = np.asarray(jax.jit(codec)(x)).reshape(shape[0], -1)
  flat = np.asarray(x).reshape(shape[0], -1)
  k = int(np.ceil(round(fraction * flat.shape[1], 6)))
  assert codec.k(shape) == k
  for row, row_hat in zip(flat, x_hat):
    kept = row_hat != 0
    assert kept.sum() == k
    np.testing.assert_array_equal(row_hat[kept], row[kept])
    assert np.abs(row[kept]).min() >= np.abs(row[~kept]).max(initial=0)


def test_topk_ties_never_drop_below_k():
  x = jnp.ones((3, 50))
  for codec in [codecs.TopK(0.1), codecs.TopK(0.9)]:  # index and mask encodings
    assert np.count_nonzero(np.asarray(codec(x)), axis=1).tolist() == [codec.k(x.shape)] * 3


def test_topk_chooses_cheaper_position_encoding_and_both_decode():
  x = normal_input((2, 256))
  dense, sparse = codecs.TopK(0.5), codecs.TopK(0.02)
  assert dense.uses_mask(x.shape) and dense.encode(x).arrays.mask is not None
  assert not sparse.uses_mask(x.shape) and sparse.encode(x).arrays.indices is not None
  assert sparse.encode(x).arrays.indices.dtype == jnp.uint16
  for codec in (dense, sparse):
    kept = [np.flatnonzero(row) for row in np.asarray(codec.decode(codec.encode(x)))]
    np.testing.assert_array_equal(kept, np.sort(np.asarray(codec.positions(x)), axis=1))


def test_topk_per_row_and_values_at_scatter():
  x = normal_input((2, 3, 20))
  codec = codecs.TopK(0.25, per="row")
  assert np.all(np.count_nonzero(np.asarray(codec(x)), axis=-1) == 5)
  where = codec.where(codec.encode(x))
  assert codec.positions(x).shape == (6, 5) and where.shape == (6, 3)  # 5 of 20 positions: a 3-byte mask per row
  np.testing.assert_array_equal(np.asarray(codec.scatter(codec.values_at(x, where), where)), np.asarray(codec(x)))


def test_randk_keeps_k_random_entries_decoded_from_seed():
  x = normal_input((3, 40))
  codec = codecs.RandK(0.25)
  a, b = codec(x, jax.random.key(0)), codec(x, jax.random.key(1))
  assert np.all(np.count_nonzero(np.asarray(a), axis=1) == 10)
  np.testing.assert_array_equal(np.asarray(a)[np.asarray(a) != 0], np.asarray(x)[np.asarray(a) != 0])
  assert not np.array_equal(np.asarray(a) != 0, np.asarray(b) != 0)
  assert set(codec.encode(x, jax.random.key(0)).parts()) == {"values", "seed"}


@pytest.mark.parametrize("fraction", [0.5, 0.02])  # mask and index encodings
def test_topk_q8_values_on_a_symmetric_grid_with_zero(fraction):
  x = normal_input((3, 200), seed=5).at[1].set(0.0)  # an all-zero row: scale 0 decodes to exact zeros
  q8, exact = codecs.TopK(fraction, values="q8"), codecs.TopK(fraction)
  payload = q8.encode(x)
  assert payload.arrays.values.dtype == jnp.int8 and payload.arrays.scale.shape == (3,)
  assert int(jnp.min(payload.arrays.values)) >= -127
  reference = np.asarray(exact(x))
  scale = np.abs(reference).max(axis=1, keepdims=True)
  x_hat = np.asarray(q8.decode(payload))
  assert (np.abs(x_hat - reference) <= scale / 254 * (1 + 1e-5)).all()
  np.testing.assert_array_equal(x_hat[1], 0.0)
  np.testing.assert_array_equal(np.asarray(q8(-x)), -x_hat)  # symmetric grid


@pytest.mark.parametrize("fraction", [0.01, 0.5])  # one value per row (only +-inf sent), and an inf among finite ones
def test_topk_q8_sends_inf_as_its_max_abs_quantizer_does(fraction):
  """q8 values are `MaxAbsQuant(8)`'s: +-inf decodes to +-inf, never NaN or the other sign; a row whose
  finite values are flagged NaN (`_flag_nonfinite_rows`) decodes all NaN, as its quantizer's NaN scale."""
  x = normal_input((3, 64), seed=3).at[:, 5].set(jnp.array([jnp.inf, -jnp.inf, jnp.inf]) * 1e3)
  x = x.at[2, 6].set(jnp.inf)
  x_hat, sent = np.asarray(codecs.TopK(fraction, values="q8")(x)), np.asarray(codecs.TopK(fraction)(x))
  inf = np.isinf(sent)
  if fraction < 0.1:
    assert inf.sum() == 3 and (x_hat[inf] == sent[inf]).all()
  else:
    assert np.isnan(x_hat[sent != 0]).all()  # every row holds an inf: its finite values are flagged NaN
  assert not np.any(np.isneginf(x_hat[np.isposinf(np.asarray(x))]))


@pytest.mark.parametrize("values", ["native", "bf16", "q8"])
def test_topk_value_formats_with_index_reuse(values):
  from jaxcomp.compress import schemes
  from jaxcomp.compress.boundary import Boundary, Reuse
  x, g = normal_input((4, 64), seed=1), normal_input((4, 64), seed=2)
  topk = codecs.TopK(0.25, values=values)
  idx = topk.where(topk.encode(x))
  sent = topk.values_at(g, idx)
  link = Boundary(schemes.Plain(topk), Reuse())
  assert link.wire_bytes(x.shape, x.dtype) == (codecs.nbytes(topk.encode(x)), codecs.nbytes(sent))
  g_hat = np.asarray(topk.scatter(sent, idx))
  kept = np.asarray(codecs.TopK(0.25)(x)) != 0
  tolerance = {"native": 0.0, "bf16": 2**-8, "q8": 1 / 254}[values] * np.abs(np.asarray(g)).max()
  assert (np.abs(g_hat - np.where(kept, np.asarray(g), 0.0)) <= tolerance * (1 + 1e-5)).all()
  assert (g_hat[~kept] == 0).all()


@pytest.mark.parametrize("fraction", [0.25, 0.02])  # positions sent as a mask, as uint16 indices
@pytest.mark.parametrize("values", ["native", "bf16"])
def test_index_reuse_sends_the_gradient_at_the_forward_positions_bit_for_bit(fraction, values):
  """What crosses back is g at the forward's positions in the order the forward sent them, exactly (signed zeros,
  subnormals and the largest finite value included), in `value_bytes`; the receiver's tensor is g there and 0 elsewhere."""
  x, g = normal_input((4, 256), seed=1), normal_input((4, 256), seed=2)
  g = g.at[:, ::5].set(-0.0).at[:, 1::7].set(1e-40).at[1, 2::9].set(np.finfo(np.float32).max)
  topk = codecs.TopK(fraction, values=values)
  assert topk.uses_mask(x.shape) == (fraction == 0.25)
  sent, dense = jax.jit(lambda x, g: (lambda w: (topk.values_at(g, w), topk.scatter(topk.values_at(g, w), w)))(
      topk.where(topk.encode(x))))(x, g)
  idx = np.asarray(topk.positions(x))  # as the selection orders them (lax.top_k below 3% on CPU: by magnitude)
  at = np.take_along_axis(np.asarray(g), idx, axis=1).astype(jnp.bfloat16 if values == "bf16" else np.float32)
  np.testing.assert_array_equal(np.asarray(sent.arrays.values).view(np.uint16 if values == "bf16" else np.uint32),
                                at.view(np.uint16 if values == "bf16" else np.uint32))
  assert codecs.nbytes(sent) == topk.value_bytes(x.shape, x.dtype)
  expected = np.zeros((4, 256), np.float32)
  np.put_along_axis(expected, idx, at.astype(np.float32), axis=1)
  np.testing.assert_array_equal(np.asarray(dense).view(np.uint32), expected.view(np.uint32))


def test_index_reuse_flags_a_non_finite_gradient_it_does_not_send():
  x, g = normal_input((4, 64), seed=1), normal_input((4, 64), seed=2)
  topk = codecs.TopK(0.25)
  where = topk.where(topk.encode(x))
  idx = np.sort(np.asarray(topk.positions(x)), axis=1)
  unsent = int(np.setdiff1d(np.arange(64), idx[2])[0])
  g_hat = np.asarray(topk.scatter(topk.values_at(g.at[2, unsent].set(np.nan), where), where))
  assert np.isnan(g_hat[2, idx[2]]).all() and np.isfinite(np.delete(g_hat, 2, axis=0)).all()

