import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcomp.compress import packing


@settings(max_examples=15, deadline=None)
@given(bits=st.integers(1, 16), n=st.integers(1, 300), seed=st.integers(0, 2**31))
def test_pack_round_trip_and_size(bits, n, seed):
  codes = np.random.default_rng(seed).integers(0, 2**bits, n, dtype=np.uint32)
  packed = packing.pack(codes, bits)
  assert packed.dtype == np.uint8
  assert packed.shape == (packing.packed_size(n, bits),) == (-(-n * bits // 8),)
  np.testing.assert_array_equal(np.asarray(packing.unpack(packed, bits, n)), codes)


def test_pack_layout_is_little_endian_dense_stream():
  # three 3-bit codes 0b101, 0b011, 0b110 -> bits 101 110 011 (LSB first) -> 0b10011101, 0b1
  packed = np.asarray(packing.pack(np.array([5, 3, 6]), 3))
  np.testing.assert_array_equal(packed, [0b10011101, 0b1])


def test_pack_layout_is_planar_over_full_groups():
  # 19 4-bit codes: G = 2 full groups, (0, 2, ..., 14) and (1, 3, ..., 15); byte k of group g is byte 2k + g;
  # the 3 codes left (0, 1, 2) are one group cut to its 2 bytes
  packed = np.asarray(packing.pack(np.arange(19) % 16, 4))
  np.testing.assert_array_equal(packed, [0x20, 0x31, 0x64, 0x75, 0xA8, 0xB9, 0xEC, 0xFD, 0x10, 0x02])


@settings(max_examples=12, deadline=None)
@given(r=st.integers(1, 5), f=st.integers(1, 40), seed=st.integers(0, 2**31))
def test_mask_round_trip(r, f, seed):
  mask = np.random.default_rng(seed).random((r, f)) < 0.3
  packed = packing.pack_mask(mask)
  assert packed.shape == (r, -(-f // 8))
  np.testing.assert_array_equal(np.asarray(packing.unpack_mask(packed, f)), mask)


@pytest.mark.parametrize("bad", [0, 17, -1, 2.5, True, "4"])
def test_check_bits_rejects(bad):
  with pytest.raises(ValueError, match="bits must be an integer in 1..16"):
    packing.check_bits(bad)


@pytest.mark.parametrize("r, f", [(1, 13), (3, 64), (2, 1003)])
def test_mask_layouts_agree(r, f):
  """The TPU's gathers and the other platforms' [R, F/8, 8] views pack, unpack and rank a mask alike."""
  mask = np.random.default_rng(f).random((r, f)) < 0.3
  packed = packing.pack_mask(mask, how="views")
  np.testing.assert_array_equal(packing.pack_mask(mask, how="gathers"), packed)
  for how in ("gathers", "views"):
    np.testing.assert_array_equal(packing.unpack_mask(packed, f, how=how), mask)
    np.testing.assert_array_equal(packing.mask_ranks(packed, f, how=how), np.cumsum(mask, axis=1) - mask)


def test_join_is_the_arrays_bytes_in_one_buffer_and_split_gives_them_back_bit_for_bit():
  """Mixed widths (bool, u8, f8, bf16, int32, f32 with a NaN and -0), an empty array: the buffer is of the
  narrowest word, holds exactly the arrays' bytes, and splits back to the same bit patterns."""
  import jax.numpy as jnp
  arrays = [np.array([[1.5, np.nan], [-0.0, 3e38]], np.float32), np.arange(5, dtype=np.uint8),
            jnp.array([0.5, -2.0, 448.0], jnp.float8_e4m3fn), jnp.array([1.0, -1e-3], jnp.bfloat16),
            np.array([-7, 2**31 - 1], np.int32), np.array([True, False, True]), np.zeros((0, 3), np.float32)]
  buffer = packing.join(arrays)
  assert buffer.dtype == np.uint8 and buffer.shape == (sum(np.asarray(a).nbytes for a in arrays),)
  assert packing.join(arrays[3:5]).dtype == np.uint16  # no 1-byte array: 2-byte words
  for before, after in zip(arrays, packing.split(buffer, arrays)):
    assert after.shape == np.shape(before) and after.dtype == before.dtype
    np.testing.assert_array_equal(np.asarray(after).view(np.uint8), np.asarray(before).view(np.uint8))


def test_a_gather_in_the_rows_own_shape_is_the_flat_gather_and_packing_them_packs_the_flat_rows():
  """`in_row_shape` (what `at_positions` runs on TPU) reads position i B + j of a row [A, B] at (i, j), and
  `pack_mask` of rows [R, A, B] is that of the rows flattened."""
  x = jax.random.normal(jax.random.key(0), (3, 5, 16))
  positions = jax.random.randint(jax.random.key(1), (3, 7), 0, 80)
  flat = x.reshape(3, 80)
  np.testing.assert_array_equal(packing.in_row_shape(x, positions), jnp.take_along_axis(flat, positions, axis=1))
  np.testing.assert_array_equal(packing.at_positions(x, positions), jnp.take_along_axis(flat, positions, axis=1))
  np.testing.assert_array_equal(packing.pack_mask(x > 0), packing.pack_mask(flat > 0))
  with pytest.raises(ValueError, match="whole bytes"):
    packing.pack_mask(jnp.zeros((2, 3, 12), bool))


@pytest.mark.parametrize("a, b", [(5, 16), (3, 40)])
def test_expanding_into_rows_of_their_own_shape_is_the_flat_expand(a, b):
  """`expand_in_row_shape` (what `expand_rows` runs on TPU) puts the k values where `expand` does, in [R, A, B]."""
  f = a * b
  mask = jax.random.uniform(jax.random.key(2), (3, f)) < 0.3
  packed = packing.pack_mask(mask)
  k = int(mask.sum(axis=1).max())
  values = jax.random.normal(jax.random.key(3), (3, k))
  want = packing.expand(packed, f, values).reshape(3, a, b)
  np.testing.assert_array_equal(packing.expand_in_row_shape(packed, a, b, values), want)
  np.testing.assert_array_equal(packing.expand_rows(packed, a, b, values), want)
