"""Tile-wise max-abs scales, the randomized Hadamard rotation and token-adaptive bit widths."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcomp.compress import codecs, schemes, spec
from jaxcomp.compress.adaptive import TokenAdaptive, peakiness
from jaxcomp.compress.boundary import Mode
from jaxcomp.compress.rotation import Hadamard, fwht


def _x(shape, dtype=jnp.float32, seed=0):
  return (jax.random.normal(jax.random.key(seed), shape) * 3 + 1).astype(dtype)


def test_wire_bytes_by_hand():
  shape = (8, 128, 64)  # 1024 tokens of 64 features
  assert codecs.MaxAbsQuant(3, "group", group=16).wire_bytes(shape, jnp.float32) == 1024 * 64 * 3 // 8 + 1024 * 4 * 4
  assert Hadamard(codecs.MaxAbsQuant(3, "group", scale_dtype="bfloat16", group=64)).wire_bytes(
      shape, jnp.float32) == 1024 * (24 + 2)
  # 256 tokens in 4 bits + 768 in 3 bits, one fp32 scale each, a 1024-bit map
  assert TokenAdaptive(3, 4, 0.25).wire_bytes(shape, jnp.float32) == 256 * 32 + 768 * 24 + 1024 * 4 + 128


@settings(max_examples=4, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.sampled_from([2, 4, 8, 16]), st.integers(0, 10**6),
       st.sampled_from(codecs.MAXABS_GRIDS))
def test_group_scales_bound_the_error_of_each_group(rows, groups, g, seed, grid):
  x = _x((rows, groups * g), seed=seed)
  codec = codecs.MaxAbsQuant(3, "group", group=g, clip=1.0, grid=grid)
  payload = jax.jit(codec.encode)(x)
  scale = jax.lax.bitcast_convert_type(payload.arrays.scale, jnp.float32)  # fp32 scales travel as bits
  assert scale.shape == (rows, groups)
  true = jnp.max(jnp.abs(x.reshape(rows, groups, g)), axis=-1)
  assert bool(jnp.all(scale >= true)) and bool(jnp.all(scale <= true * 1.002 + 1e-6))
  err = jnp.abs(jax.jit(codec.decode)(payload) - x).reshape(rows, groups, g)
  assert bool(jnp.all(err <= (scale / (2 * codec.levels))[..., None] * (1 + 1e-4) + 1e-6))


def test_group_scales_confine_an_outlier_to_its_group():
  x = _x((2, 64)).at[0, 3].set(1000.0)
  err = np.abs(np.asarray(codecs.MaxAbsQuant(4, "group", group=16)(x) - x))
  assert err[0, 16:].max() < 2.0 and err[1].max() < 2.0  # other groups keep their own scale
  assert err[0, :16].max() > 3.0  # the outlier's group is coarse (its small entries round to 0)


def test_fwht_is_the_orthonormal_hadamard_matrix():
  n = 16
  h = np.array([[1.0]])
  while len(h) < n:
    h = np.block([[h, h], [h, -h]])
  x = _x((3, n))
  np.testing.assert_allclose(np.asarray(fwht(x)), np.asarray(x) @ h.T / np.sqrt(n), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(fwht(fwht(x))), np.asarray(x), rtol=1e-5, atol=1e-5)


@settings(max_examples=4, deadline=None)
@given(st.integers(1, 4), st.sampled_from([(8, 8), (64, 16), (48, 16), (24, None)]), st.integers(0, 10**6),
       st.sampled_from(codecs.MAXABS_GRIDS))
def test_rotation_keeps_the_inner_error_in_2_norm(rows, features_block, seed, grid):
  f, block = features_block
  x = _x((rows, f), seed=seed)
  inner = codecs.MaxAbsQuant(3, "group", group=f // 2 if f % 2 == 0 else f, grid=grid)
  rot = Hadamard(inner, block=block, seed=seed % 7)
  np.testing.assert_allclose(np.asarray(jax.jit(Hadamard(codecs.Identity(), block, seed % 7))(x)), np.asarray(x),
                             rtol=1e-5, atol=1e-4)
  y = jax.jit(rot.rotate)(x)
  np.testing.assert_allclose(np.linalg.norm(np.asarray(y)), np.linalg.norm(np.asarray(x)), rtol=1e-5)
  inner_err = np.linalg.norm(np.asarray(jax.jit(inner)(y) - y))
  np.testing.assert_allclose(np.linalg.norm(np.asarray(jax.jit(rot)(x) - x)), inner_err, rtol=1e-4, atol=1e-5)


def test_rotation_spreads_an_outlier_and_lowers_the_error():
  x = _x((64, 64), seed=3).at[:, 5].mul(40.0)  # one outlier channel, as in LLM activations
  plain = codecs.MaxAbsQuant(3, "group", clip=1.0, group=64, grid="zero")
  rotated = Hadamard(plain)
  assert float(jnp.max(jnp.abs(rotated.rotate(x)))) < 0.5 * float(jnp.max(jnp.abs(x)))
  assert float(jnp.linalg.norm(rotated(x) - x)) < 0.9 * float(jnp.linalg.norm(plain(x) - x))  # 148 vs 184


def test_rotation_signs_depend_on_the_seed_and_nothing_extra_travels():
  x = _x((2, 32))
  a, b = Hadamard(codecs.Identity(), seed=0), Hadamard(codecs.Identity(), seed=1)
  assert not np.allclose(np.asarray(a.rotate(x)), np.asarray(b.rotate(x)))
  assert set(a.encode(x).parts()) == {"x"}


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


@pytest.mark.parametrize("text, expected", [
    ("maxabs:3:group=64", codecs.MaxAbsQuant(3, "group", group=64)),
    ("maxabs:2:group=8:stoch:scale=bf16", codecs.MaxAbsQuant(2, "group", True, "bfloat16", group=8)),
    ("maxabs:3:group=8:clip=mse", codecs.MaxAbsQuant(3, "group", clip="mse", group=8)),
    ("hadamard+maxabs:3:group=64", Hadamard(codecs.MaxAbsQuant(3, "group", group=64))),
    ("hadamard:32:seed=7+topk:0.1", Hadamard(codecs.TopK(0.1), 32, 7)),
    ("adaptive:3:4:0.25", TokenAdaptive(3, 4, 0.25)),
    ("adaptive:3:4:0.5:group=16:stoch:scale=bf16", TokenAdaptive(3, 4, 0.5, 16, True, "bfloat16")),
    ("hadamard+adaptive:3:4:0.25", Hadamard(TokenAdaptive(3, 4, 0.25))),
    ("hadamard+maxabs:2:group=16:grid=midrise", Hadamard(codecs.MaxAbsQuant(2, "group", group=16, grid="midrise"))),
    ("adaptive:2:3:0.25:grid=midrise:stoch", TokenAdaptive(2, 3, 0.25, stochastic=True, grid="midrise")),
    ("adaptive:2:4:0.25:clip=0.9", TokenAdaptive(2, 4, 0.25, clip=0.9)),
])
def test_specs(text, expected):
  assert spec.parse_codec(text) == expected
  assert spec.parse_scheme(text).codec == expected
  assert spec.parse_scheme("ef21+" + text) == schemes.EF21(expected)
  assert spec.parse_scheme("aqsgd+" + text, num_examples=4).codec == expected


@pytest.mark.parametrize("text, match", [
    ("maxabs:3:group=8:tensor", "group=G replaces tensor/channel"),
    ("maxabs:3:groups=8", r"bad maxabs option\(s\) \['groups='\]"),
    ("maxabs:3:group=x", "bad number 'x'"),
    ("hadamard:12+maxabs:3", "power of two >= 2, got 12"),
    ("rotate+maxabs:3", "unknown scheme 'rotate'"),
    ("adaptive:4:3:0.25", "low < high"),
    ("adaptive:3:4:1.5", r"fraction of high-bit tokens must be in \(0, 1\), got 1.5"),
    ("adaptive:3:4", "unknown compressor"),
    ("adaptive:2:3:0.25:grid=mid", "bad adaptive option grid='mid'"),
])
def test_bad_specs(text, match):
  with pytest.raises(ValueError, match=match):
    spec.parse_scheme(text)


def test_indivisible_shapes_are_clear_errors():
  with pytest.raises(ValueError, match="group=16 does not divide the 40 features"):
    codecs.MaxAbsQuant(3, "group", group=16).encode(_x((2, 40)))
  with pytest.raises(ValueError, match="block 16 does not divide the 40 features"):
    Hadamard(codecs.Identity(), block=16).wire_bytes((2, 40), jnp.float32)


@pytest.mark.parametrize("fwd, bwd", [("hadamard+maxabs:3:group=16", "hadamard+maxabs:4:group=16"),
                                      pytest.param("adaptive:3:4:0.25", "hadamard+adaptive:3:4:0.25:stoch",
                                                   marks=pytest.mark.slow),
                                      pytest.param("adaptive:2:3:0.25:grid=midrise",
                                                   "hadamard+maxabs:4:group=16:grid=midrise", marks=pytest.mark.slow)])
def test_boundary_gradient_is_the_compressed_true_gradient(fwd, bwd):
  link = spec.parse_boundary(fwd, bwd)
  x = _x((4, 6, 32), seed=2)
  w = jax.random.normal(jax.random.key(5), (32, 32)) / 6
  state = link.init(4, (6, 32), jnp.float32)
  key = jax.random.key(0)

  def loss(x):
    y, _ = link(x, state, key, Mode.TRAIN)
    return jnp.sum(jnp.tanh(y @ w) ** 2)

  value, dx = jax.jit(jax.value_and_grad(loss))(x)
  y = link.fwd.codec(x, None)
  assert float(value) == pytest.approx(float(jnp.sum(jnp.tanh(y @ w) ** 2)), rel=1e-5)
  dy = jax.grad(lambda y: jnp.sum(jnp.tanh(y @ w) ** 2))(y)
  assert not np.allclose(np.asarray(dx), np.asarray(dy), atol=1e-6)  # the backward codec acted
  bwd_codec = link.bwd.codec
  if not getattr(getattr(bwd_codec, "inner", bwd_codec), "stochastic", False):
    np.testing.assert_allclose(np.asarray(dx), np.asarray(bwd_codec(dy, None)), rtol=1e-5, atol=1e-6)
  rel = float(jnp.linalg.norm(dx - dy) / jnp.linalg.norm(dy))
  assert rel < 0.3


def test_adaptive_sends_nothing_for_a_width_without_rows():
  """One row (or a fraction that takes every row) leaves the low width empty: no zero-size encode, no bytes."""
  for codec, shape in ((TokenAdaptive(3, 5, 0.25), (1, 16)), (TokenAdaptive(3, 5, 0.9), (2, 3, 16))):
    x = _x(shape)
    payload = codec.encode(x)
    assert set(payload.parts()) == {"bitmap", "high"}
    assert codecs.nbytes(payload) == codec.wire_bytes(shape, x.dtype)
    err = np.abs(np.asarray(codec.decode(payload) - x)).reshape(-1, 16).max(1)
    assert np.all(err <= np.abs(np.asarray(x)).reshape(-1, 16).max(1) / 30 * 1.002 + 1e-6)  # 5 bits: s / (2L)
