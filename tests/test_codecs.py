"""Every codec: exact wire bytes, jit and eager alike, round trips within their bounds, non-finite inputs kept
visible, bad configurations and inputs refused, and the properties each family promises."""
import copy
import itertools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcomp.compress import codecs, packing, spec
from jaxcomp.compress.adaptive import TokenAdaptive
from jaxcomp.compress.rotation import Hadamard
from codec_cases import normal_input, relative_mse

ALL_CODECS = [
    codecs.Identity(), codecs.Cast("bfloat16"), codecs.Cast("float16"), codecs.ScaledCast(),
    codecs.ScaledCast("float8_e5m2", "channel"),
    codecs.MinMaxQuant(1), codecs.MinMaxQuant(2), codecs.MinMaxQuant(3), codecs.MinMaxQuant(8),
    codecs.MinMaxQuant(16), codecs.MaxAbsQuant(2), codecs.MaxAbsQuant(4, "tensor"),
    codecs.MaxAbsQuant(5, stochastic=True), codecs.MaxAbsQuant(3, scale_dtype="bfloat16", clip="mse"),
    codecs.MaxAbsQuant(2, "tensor", scale_dtype="float16", clip=0.7), codecs.MaxAbsQuant(2, grid="midrise"),
    codecs.MaxAbsQuant(1, grid="midrise"), codecs.MaxAbsQuant(3, "tensor", True, clip="mse", grid="midrise"),
    codecs.MaxAbsQuant(2, clip="mse", grid="auto", scale_dtype="float16"),
    codecs.TopK(0.1), codecs.TopK(0.5), codecs.TopK(0.3, "row"),
    codecs.TopK(0.1, select="sort"), codecs.TopK(0.1, values="bf16"), codecs.TopK(0.5, values="q8"),
    codecs.TopK(0.02, values="q8"),
    codecs.RandK(0.2),
]
SHAPES = [(4, 33), (2, 8, 8, 6), (3, 5, 16)]
# codecs with feature blocks (groups of 8/16, Hadamard blocks) on shapes their blocks divide
BLOCK_CODECS = [
    codecs.MaxAbsQuant(3, "group", group=8), codecs.MaxAbsQuant(4, "group", stochastic=True, group=16),
    codecs.MaxAbsQuant(3, "group", clip="mse", scale_dtype="bfloat16", group=16),
    codecs.MaxAbsQuant(2, "group", stochastic=True, group=8, grid="midrise"), Hadamard(codecs.Identity()), Hadamard(codecs.MaxAbsQuant(3, "group", group=16), block=8),
    Hadamard(codecs.TopK(0.25), seed=5), TokenAdaptive(3, 4, 0.25), TokenAdaptive(2, 8, 0.5, group=8, stochastic=True),
    Hadamard(TokenAdaptive(3, 4, 0.3, group=16)), Hadamard(codecs.MaxAbsQuant(2, "group", group=16, grid="midrise")),
    TokenAdaptive(2, 3, 0.25, grid="midrise", stochastic=True),
    codecs.MaxAbsQuant(3, "group", stochastic=True, group=8, grid="auto", scale_dtype="bfloat16"),
]
BLOCK_SHAPES = [(4, 32), (3, 2, 7, 48)]
CASES = [(c, s) for c in ALL_CODECS for s in SHAPES] + [(c, s) for c in BLOCK_CODECS for s in BLOCK_SHAPES]
# every case in fp32 and bf16; fp16 on each codec's first shape
WIRE_CASES = ([(c, s, d) for c, s in CASES for d in (jnp.float32, jnp.bfloat16)]
              + [(c, s, jnp.float16) for c, s in CASES if s in (SHAPES[0], BLOCK_SHAPES[0])])


@pytest.mark.parametrize("codec, shape, dtype", WIRE_CASES, ids=repr)
def test_wire_bytes_is_payload_size(codec, shape, dtype):
  """Payload shapes are static: tracing encode gives the bytes every call sends."""
  x = jax.ShapeDtypeStruct(shape, dtype)
  payload = jax.eval_shape(codec.encode, x, jax.random.key(1))
  assert codecs.nbytes(payload) == codec.wire_bytes(shape, dtype)
  x_hat = jax.eval_shape(codec.decode, payload)
  assert x_hat.shape == x.shape and x_hat.dtype == x.dtype


@pytest.mark.parametrize("codec", [c if i in (1, 5, 7) else pytest.param(c, marks=pytest.mark.slow)
                                   for i, c in enumerate(BLOCK_CODECS)], ids=repr)
def test_block_codecs_jit_and_eager_agree(codec):
  x = normal_input((3, 5, 16))
  np.testing.assert_allclose(np.asarray(jax.jit(codec)(x, jax.random.key(1))), np.asarray(codec(x, jax.random.key(1))),
                             rtol=1e-5, atol=1e-5)


def test_wire_bytes_128x1024_fp32():
  shape, f32 = (128, 1024), 4
  dense = 128 * 1024 * f32
  assert codecs.Identity().wire_bytes(shape, jnp.float32) == dense
  assert codecs.MinMaxQuant(4).wire_bytes(shape, jnp.float32) == dense // 8 + 8
  assert codecs.MinMaxQuant(2).wire_bytes(shape, jnp.float32) == dense // 16 + 8
  assert codecs.MinMaxQuant(3).wire_bytes(shape, jnp.float32) == 128 * 1024 * 3 // 8 + 8
  assert codecs.MaxAbsQuant(4).wire_bytes(shape, jnp.float32) == dense // 8 + 1024 * 4  # fp32 scales
  assert codecs.MaxAbsQuant(4, scale_dtype="float16").wire_bytes(shape, jnp.float32) == dense // 8 + 1024 * 2
  assert codecs.MaxAbsQuant(2, grid="midrise").wire_bytes(shape, jnp.float32) == dense // 16 + 1024 * 4  # 4 levels
  assert codecs.MaxAbsQuant(1, grid="midrise").wire_bytes(shape, jnp.float32) == dense // 32 + 1024 * 4
  assert codecs.ScaledCast().wire_bytes(shape, jnp.float32) == dense // 4 + 4  # fp8 values + one fp32 scale
  assert codecs.ScaledCast(granularity="channel").wire_bytes(shape, jnp.float32) == dense // 4 + 1024 * 4
  # Top10%: 103 of 1024 per row; 103 uint16 indices (206 B) > 128 B mask -> mask wins
  assert codecs.TopK(0.1).wire_bytes(shape, jnp.float32) == 128 * (103 * 4 + 128)
  assert codecs.TopK(0.01).wire_bytes(shape, jnp.float32) == 128 * (11 * 4 + 11 * 2)


class RoundTripTest(parameterized.TestCase):

  @chex.variants(with_jit=True)  # (a without_jit variant would compare the eager round trip with itself)
  @parameterized.parameters(*range(len(ALL_CODECS)))
  def test_jit_and_eager_agree(self, i):
    codec = ALL_CODECS[i]
    x = normal_input((4, 40), seed=i)
    eager = codec(x, jax.random.key(3))
    traced = self.variant(lambda x, k: codec(x, k))(x, jax.random.key(3))
    np.testing.assert_allclose(np.asarray(traced), np.asarray(eager), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bits", [b if b in (1, 2, 3, 4, 8, 16) else pytest.param(b, marks=pytest.mark.slow)
                                  for b in range(1, 17)])  # the widths the specs name by default, every one with -m slow
def test_minmax_error_within_half_step(bits):
  x = normal_input((8, 129), seed=bits)
  x_hat = codecs.MinMaxQuant(bits)(x)
  lo, hi = float(x.min()), float(x.max())
  half_step = (hi - lo) / (2 * (2**bits - 1))
  float_error = 4 * np.finfo(np.float32).eps * max(abs(lo), abs(hi))  # fp32 arithmetic
  assert float(jnp.max(jnp.abs(x_hat - x))) <= half_step + float_error
  assert float(x_hat.min()) == pytest.approx(lo, abs=1e-5)  # extremes are on the grid
  assert float(x_hat.max()) == pytest.approx(hi, abs=1e-5)


# every bit width, granularity and grid with fp32 scales, the narrow scales at 4 bits; the rest with -m slow
@pytest.mark.parametrize("bits, granularity, scale_dtype, grid", [
    case if case[2] == "float32" or case[0] == 4 else pytest.param(*case, marks=pytest.mark.slow)
    for case in itertools.product([2, 3, 4, 7, 8, 12], ["tensor", "channel"], ["float32", "bfloat16", "float16"],
                                  codecs.MAXABS_GRIDS)])
def test_maxabs_error_within_half_step(bits, granularity, scale_dtype, grid):
  """|x - x_hat| <= s / (2D) unclipped: s/(2L) on the zero grid, s/(2^B - 1) on midrise."""
  x = normal_input((6, 5, 16), seed=bits)
  codec = codecs.MaxAbsQuant(bits, granularity, scale_dtype=scale_dtype, clip=1.0, grid=grid)
  payload = codec.encode(x)
  scale = jax.lax.bitcast_convert_type(payload.arrays.scale, jnp.dtype(scale_dtype)).astype(jnp.float32)
  assert scale.shape == ((16,) if granularity == "channel" else ())
  assert payload.arrays.scale.dtype.itemsize == jnp.dtype(scale_dtype).itemsize
  true_scale = jnp.max(jnp.abs(x), axis=(0, 1) if granularity == "channel" else None)
  assert bool(jnp.all(scale >= true_scale))  # rounded up: nothing clips
  err = jnp.abs(codec.decode(payload) - x)
  assert bool(jnp.all(err <= scale / (2 * codec.levels) * (1 + 1e-5)))


@pytest.mark.parametrize("grid", codecs.MAXABS_GRIDS)
def test_stochastic_rounding_is_unbiased(grid):
  x = normal_input((2, 64), seed=7)
  codec = codecs.MaxAbsQuant(2, "tensor", stochastic=True, clip=1.0, grid=grid)
  samples = jax.vmap(lambda k: codec(x, k))(jax.random.split(jax.random.key(0), 4000))
  step = float(jnp.max(jnp.abs(x))) / codec.levels
  # std of the mean of 4000 draws <= step/2/sqrt(4000) ~ 0.008 step
  assert float(jnp.max(jnp.abs(samples.mean(0) - x))) < 0.05 * step
  deterministic = codecs.MaxAbsQuant(2, "tensor", clip=1.0, grid=grid)
  assert float(jnp.max(jnp.abs(deterministic(x) - x))) > 0.1 * step  # deterministic is biased
  codec_mm = codecs.MinMaxQuant(1, stochastic=True)
  samples = jax.vmap(lambda k: codec_mm(x, k))(jax.random.split(jax.random.key(1), 4000))
  assert float(jnp.max(jnp.abs(samples.mean(0) - x))) < 0.05 * float(x.max() - x.min())


def test_stochastic_without_key_is_an_error():
  with pytest.raises(ValueError, match="needs a PRNG key"):
    codecs.MinMaxQuant(4, stochastic=True).encode(normal_input((2, 4)))
  with pytest.raises(ValueError, match="needs a PRNG key"):
    codecs.RandK(0.5).encode(normal_input((2, 4)))


@pytest.mark.parametrize("codec", [codecs.MinMaxQuant(4), codecs.MaxAbsQuant(4), codecs.MaxAbsQuant(3, "tensor"),
                                   codecs.MaxAbsQuant(2, grid="midrise"),
                                   codecs.MaxAbsQuant(3, "tensor", clip="mse", grid="midrise"), codecs.ScaledCast(),
                                   codecs.ScaledCast("float8_e5m2", "channel")], ids=repr)
@pytest.mark.parametrize("value", [0.0, 2.5, -7.0])
def test_constant_and_zero_inputs_decode_exactly(codec, value):
  x = jnp.full((3, 8), value)
  x_hat = codec(x)
  assert bool(jnp.all(jnp.isfinite(x_hat)))
  np.testing.assert_allclose(np.asarray(x_hat), value, rtol=1e-3)


@pytest.mark.parametrize("grid", codecs.MAXABS_GRIDS)
def test_huge_inputs(grid):
  x = jnp.array([[-3.0e38, 1.0, 3.0e38, 2.0e38]])
  x_hat = codecs.MinMaxQuant(8)(x)
  np.testing.assert_allclose(np.asarray(x_hat)[0, [0, 2]], [-3.0e38, 3.0e38], rtol=1e-6)
  maxabs = lambda **kw: codecs.MaxAbsQuant(8, "tensor", grid=grid, **kw)
  x_top = jnp.array([[3.4e38, -3.4e38, 1.0]])
  np.testing.assert_allclose(np.asarray(maxabs()(x_top))[0, :2], [3.4e38, -3.4e38], rtol=1e-6)
  assert bool(jnp.all(jnp.isfinite(x_hat)))
  assert float(jnp.max(jnp.abs(x_hat - x))) <= 6.0e38 / 255 / 2 * 1.001
  big = jnp.array([[1e30, -5e29, 3.0]])
  np.testing.assert_allclose(np.asarray(maxabs()(big))[0, :2], [1e30, -5e29], rtol=1e-2)
  # fp16 scales (an option) cannot hold 1e30: the overflow shows up, it is not hidden
  assert not bool(jnp.all(jnp.isfinite(maxabs(scale_dtype="float16")(big))))


# RandK may legitimately drop the NaN entry; eager, one codec of each kind by default (all of them, jitted, below)
@pytest.mark.parametrize("codec", [c if c in (codecs.ScaledCast(), codecs.MinMaxQuant(2), codecs.MaxAbsQuant(2),
                                              codecs.TopK(0.1)) else pytest.param(c, marks=pytest.mark.slow)
                                   for c in ALL_CODECS[3:-1]], ids=repr)
def test_nan_is_reported_not_hidden(codec):
  x = normal_input((2, 16)).at[0, 3].set(jnp.nan)
  assert bool(jnp.any(jnp.isnan(codec(x, jax.random.key(0)))))


@pytest.mark.parametrize("make, match", [
    (lambda: codecs.MinMaxQuant(0), "bits must be an integer in 1..16, got 0"),
    (lambda: codecs.MaxAbsQuant(17), "got 17"),
    (lambda: codecs.TopK(0.0), r"fraction K must be in \(0, 1\], got 0.0"),
    (lambda: codecs.TopK(1.5), "got 1.5"),
    (lambda: codecs.RandK(-0.1), "got -0.1"),
    (lambda: codecs.TopK(0.1, per="channel"), "per must be 'example' or 'row', got 'channel'"),
    (lambda: codecs.TopK(0.1, select="heap"), "select must be one of"),
    (lambda: codecs.TopK(0.1, values="int4"), "values must be one of"),
    (lambda: codecs.Cast("int8"), "Cast dtype must be one of"),
    (lambda: codecs.MaxAbsQuant(4, granularity="row"), "granularity"),
    (lambda: codecs.MaxAbsQuant(1), "needs bits >= 2 on the zero grid"),
    (lambda: codecs.MaxAbsQuant(1, grid="auto"), "needs bits >= 2 on the zero grid and with grid=auto"),
    (lambda: codecs.MaxAbsQuant(4, grid="lopsided"), "grid must be one of"),
    (lambda: codecs.ScaledCast("float16"), "ScaledCast dtype must be one of"),
    (lambda: codecs.ScaledCast(granularity="group"), "ScaledCast granularity"),
])
def test_bad_configs(make, match):
  with pytest.raises(ValueError, match=match):
    make()


@settings(max_examples=40, deadline=None)
@given(exponent=st.floats(-30, 30), seed=st.integers(0, 2**16), bits=st.sampled_from([2, 4, 8]),
       grid=st.sampled_from(codecs.MAXABS_GRIDS))
def test_default_maxabs_round_trips_any_magnitude(exponent, seed, bits, grid):
  """Default (fp32) scales: error <= s / (2D) for max|x| anywhere in 1e-30..1e30 (no clip)."""
  x = jax.random.normal(jax.random.key(seed), (4, 16)) * np.float32(10.0 ** exponent)
  codec = spec.parse_codec(f"maxabs:{bits}:grid={grid}:clip=1")
  s = np.abs(np.asarray(x)).max(0)
  err = np.abs(np.asarray(codec(x)) - np.asarray(x))
  assert np.all(err <= s / (2 * codec.levels) * (1 + 1e-5))


@settings(max_examples=40, deadline=None)
@given(exponent=st.floats(-36, 30), sign=st.sampled_from([-1.0, 1.0]), seed=st.integers(0, 2**16),
       bits=st.sampled_from([2, 4, 8]))
def test_minmax_half_step_bound_for_tiny_ranges(exponent, sign, seed, bits):
  """x = base (1 + u 2^-20), |base| in 1e-36..1e30: ranges down to ~1e-42 keep the half-step bound."""
  base = np.float32(sign * 10.0 ** exponent)
  x = base * (1 + jax.random.uniform(jax.random.key(seed), (4, 16)) * np.float32(2**-20))
  x_hat = np.asarray(codecs.MinMaxQuant(bits)(x))
  x = np.asarray(x)
  half_step = (float(x.max()) - float(x.min())) / (2 * (2**bits - 1))
  assert np.max(np.abs(x_hat - x)) <= half_step + 2 * np.spacing(np.abs(x).max())


@pytest.mark.parametrize("codec", [codecs.MinMaxQuant(4), codecs.MaxAbsQuant(4), codecs.MaxAbsQuant(4, "tensor"),
                                   codecs.MaxAbsQuant(4, scale_dtype="bfloat16"),
                                   codecs.MaxAbsQuant(4, scale_dtype="float16"), codecs.MaxAbsQuant(2, grid="midrise"),
                                   codecs.MaxAbsQuant(3, "tensor", grid="midrise", clip="mse"), codecs.ScaledCast(),
                                   codecs.ScaledCast("float8_e5m2", "channel")], ids=repr)
def test_plus_inf_never_decodes_as_minus_inf(codec):
  x = jnp.array([[jnp.inf, 1.0, -2.0], [0.5, jnp.inf, 3.0]])
  x_hat = np.asarray(codec(x))
  assert not np.any(np.isneginf(x_hat[np.isposinf(np.asarray(x))]))
  if isinstance(codec, (codecs.MaxAbsQuant, codecs.ScaledCast)):
    assert np.all(np.isposinf(x_hat[np.isposinf(np.asarray(x))]))
    x = np.asarray(x)  # the finite entries of a scale group with an inf decode to NaN
    with_inf = np.isinf(x).any(axis=0 if codec.granularity == "channel" else None, keepdims=True) & np.isfinite(x)
    assert np.all(np.isnan(x_hat[with_inf]))


@settings(max_examples=40, deadline=None)
@given(exponent=st.floats(-30, 30), seed=st.integers(0, 2**16), dtype=st.sampled_from(["float8_e4m3fn", "float8_e5m2"]),
       granularity=st.sampled_from(["tensor", "channel"]))
def test_scaled_fp8_round_trips_any_magnitude(exponent, seed, dtype, granularity):
  """amax maps to the format's largest value, so max|x| anywhere in 1e-30..1e30 keeps fp8's
  relative precision: |x - x_hat| <= eps/2 |x| + (smallest subnormal)/2 s, s = amax / FMAX."""
  x = jax.random.normal(jax.random.key(seed), (4, 16)) * np.float32(10.0 ** exponent)
  codec = codecs.ScaledCast(dtype, granularity)
  payload = codec.encode(x)
  assert payload.arrays.bits.dtype == jnp.uint8 and payload.arrays.scale.dtype == jnp.uint32  # fp32 bit patterns
  info = jnp.finfo(jnp.dtype(dtype))
  s = np.abs(np.asarray(x)).max(axis=0 if granularity == "channel" else None) / float(info.max)
  np.testing.assert_allclose(np.asarray(packing.from_bits(payload.arrays.scale, jnp.float32)), s, rtol=1e-6)
  x_hat, x = np.asarray(codec.decode(payload)), np.asarray(x)
  bound = float(info.eps) / 2 * np.abs(x) + float(info.smallest_subnormal) / 2 * s
  assert np.all(np.abs(x_hat - x) <= bound * (1 + 1e-5))
  np.testing.assert_allclose(np.abs(x_hat).max(axis=0 if granularity == "channel" else None), s * float(info.max),
                             rtol=1e-6)


def test_scaled_fp8_keeps_activation_gradients_that_plain_fp8_flushes():
  g = jax.random.normal(jax.random.key(0), (8, 64)) * 1e-5  # typical of a loss averaged over many tokens
  assert relative_mse(g, codecs.Cast("float8_e4m3fn")(g)) > 0.9  # below e4m3's smallest subnormal, 2^-9
  assert relative_mse(g, codecs.ScaledCast()(g)) < 2e-3


BAD_INPUTS = [((0, 16), jnp.float32), ((4, 0), jnp.float32), ((), jnp.float32), ((2, 16), jnp.complex64),
              ((2, 16), jnp.int32), ((2, 16), jnp.bool_)]


@pytest.mark.parametrize("codec", ALL_CODECS + BLOCK_CODECS, ids=repr)
def test_every_codec_refuses_what_it_cannot_encode_honestly(codec):
  """Zero-size, scalar, complex, integer and boolean arrays: a ValueError naming shape and dtype."""
  for shape, dtype in BAD_INPUTS:
    x = jnp.zeros(shape, dtype)
    with pytest.raises(ValueError, match=re.escape(f"cannot encode an array of shape {shape} and dtype "
                                                   f"{jnp.dtype(dtype)}: codecs encode non-empty real floating")):
      codec.encode(x, jax.random.key(0))
    with pytest.raises(ValueError, match="cannot encode an array of shape"):  # traced too
      jax.eval_shape(lambda x: codec.encode(x, jax.random.key(0)), x)


def _slow_to_compile(codec) -> bool:
  """Threshold-selection TopK and adaptive codecs take seconds to compile at [8, 512]: one of each runs by default."""
  inner = getattr(codec, "inner", codec)
  return ((isinstance(inner, codecs.TopK) and inner.select == "auto") or isinstance(inner, TokenAdaptive)) and \
      codec not in (codecs.TopK(0.1, select="sort"), TokenAdaptive(3, 4, 0.25))


# (codec, shape, a shape of >= 4096 entries: from there XLA:CPU's min/max reductions skip NaN)
PROPERTY_CASES = ([(c, (4, 40), (8, 512)) for c in ALL_CODECS]
                  + [(c, (3, 2, 7, 48), (8, 16, 48)) for c in BLOCK_CODECS])
LIGHT = [i for i, (c, *_) in enumerate(PROPERTY_CASES) if not _slow_to_compile(c)]
HEAVY = [i for i, (c, *_) in enumerate(PROPERTY_CASES) if _slow_to_compile(c)]


def _nan_checked_by_the_property_suite(codec) -> bool:
  """Whether `CodecPropertiesTest` (by default: the LIGHT cases) already sends a NaN and an inf among >= 4096
  entries through the codec's jitted round trip: every codec it takes but RandK (which may drop the entry)."""
  return any(PROPERTY_CASES[i][0] == codec for i in LIGHT) and not isinstance(codec, codecs.RandK)


@pytest.mark.parametrize("codec", [pytest.param(c, marks=pytest.mark.slow)
                                   if _slow_to_compile(c) or _nan_checked_by_the_property_suite(c) else c
                                   for c in ALL_CODECS + BLOCK_CODECS + [codecs.TopK(0.001, select="approx")]],
                         ids=repr)
def test_nan_and_inf_reach_the_decoded_message_under_jit(codec):
  """XLA:CPU's min/max reductions skip NaN from 4096 entries up, approx_max_k (k = 1) too; ranges, scales and
  sent rows still carry it. By default the codecs the property suite's check leaves out (RandK, top-k of one entry
  per row by approx_max_k); every codec with -m slow."""
  x = normal_input((8, 512))
  both = jax.jit(lambda a, b: (codec(a, jax.random.key(0)), codec(b, jax.random.key(1))))
  for value, x_hat in zip((np.nan, np.inf), both(x.at[5, 37].set(np.nan), x.at[5, 37].set(np.inf))):
    assert not bool(jnp.all(jnp.isfinite(x_hat))), value


# Property suite (optax's alias_test style): every codec crossed with jit / eager / committed-to-device calls.
def _bits(codec) -> int:
  return codec.low if isinstance(codec, TokenAdaptive) else codec.bits


def _relative_error_bound(codec) -> float:
  """||C(x) - x||_2 <= bound * ||x||_2 on the suite's Gaussian inputs.

  Quantizers 4 * 2^-bits (their step is the range, a few standard deviations, over about 2^bits levels);
  adaptive widths their lower width's; casts the narrow type's eps; TopK sqrt(1 - K) (it keeps the K largest
  entries of each row) plus its value format's rounding; RandK 1 (it keeps exact entries); a rotation its inner
  codec's (R is orthogonal)."""
  if isinstance(codec, Hadamard):
    return _relative_error_bound(codec.inner)
  if isinstance(codec, codecs.Identity):
    return 0.0
  if isinstance(codec, (codecs.Cast, codecs.ScaledCast)):
    return float(jnp.finfo(jnp.dtype(codec.dtype)).eps)
  if isinstance(codec, codecs.TopK):
    rounding = {"native": 0.0, "bf16": float(jnp.finfo(jnp.bfloat16).eps), "q8": 1 / 127}[codec.values]
    return float(np.sqrt(1 - codec.fraction)) + rounding
  if isinstance(codec, codecs.RandK):
    return 1.0
  return 4.0 * 2.0 ** -_bits(codec)


class _CodecProperties(chex.TestCase):
  """What every codec must satisfy, on every variant: the decoded message keeps the input's shape and dtype, the
  payload's bytes are `wire_bytes`, the error is within the family's bound, a NaN or inf among 4096 entries reaches
  the receiver (RandK may drop the entry: excepted), the same key gives the same message, and a jitted round trip
  traces once for every equal codec and input of one shape."""

  def _check_properties(self, i):
    codec, shape, large = PROPERTY_CASES[i]
    round_trip = self.variant(lambda x, key: codec(x, key))
    encode = self.variant(lambda x, key: codec.encode(x, key))
    key = jax.random.key(7)
    for dtype in (jnp.float32, jnp.bfloat16):
      x = normal_input(shape, dtype, seed=i)
      x_hat = round_trip(x, key)
      chex.assert_shape(x_hat, shape)
      chex.assert_type(x_hat, dtype)
      chex.assert_equal(codecs.nbytes(jax.eval_shape(encode, x, key)), codec.wire_bytes(shape, dtype))  # traced only
      chex.assert_trees_all_equal(round_trip(x, key), x_hat)
    x = normal_input(shape, seed=i)
    error = jnp.linalg.norm((round_trip(x, key) - x).ravel()) / jnp.linalg.norm(x.ravel())
    chex.assert_scalar_in(float(error), 0.0, _relative_error_bound(codec) + 1e-6)
    if not isinstance(codec, codecs.RandK):
      x = normal_input(large, seed=i)
      for bad in (np.nan, np.inf):
        with self.assertRaises(AssertionError):
          chex.assert_tree_all_finite(round_trip(x.at[(1,) * len(large)].set(bad), key))

  def _check_one_trace(self, i):
    """An equal codec (a new object: a codec is a value) and the next input of the same shape reuse the compiled
    round trip of a jitted function that takes the codec as a static argument."""
    codec, shape, _ = PROPERTY_CASES[i]
    chex.clear_trace_counter()
    round_trip = jax.jit(chex.assert_max_traces(lambda codec, x, key: codec(x, key), n=1), static_argnums=0)
    for seed in range(3):
      round_trip(copy.deepcopy(codec), normal_input(shape, seed=seed), jax.random.key(seed))


def _property_suite(cases, one_compile=True, **variants):
  """The property tests over `cases` (indices of PROPERTY_CASES) on the chex `variants` (`one_compile`: and the
  trace count of each)."""

  class Suite(_CodecProperties):

    @chex.variants(**variants)
    @parameterized.parameters(*cases)
    def test_codec_properties(self, i):
      self._check_properties(i)

  class SuiteAndTraces(Suite):

    @parameterized.parameters(*cases)
    def test_one_compile_per_codec_and_shape(self, i):
      self._check_one_trace(i)

  return SuiteAndTraces if one_compile else Suite


CodecPropertiesTest = _property_suite(LIGHT, with_jit=True)
# eagerly (op by op): by default RoundTripTest checks each codec's eager round trip against its jitted one
EagerCodecPropertiesTest = pytest.mark.slow(_property_suite(LIGHT, one_compile=False, without_jit=True))
# with the inputs placed on the device first: on the suite's CPU devices they already are (so -m slow only)
OnDeviceCodecPropertiesTest = pytest.mark.slow(_property_suite(LIGHT, one_compile=False, with_device=True))
# the codecs that take seconds to compile on XLA:CPU (`_slow_to_compile`)
SlowToCompileCodecPropertiesTest = pytest.mark.slow(
    _property_suite(HEAVY, with_jit=True, without_jit=True, with_device=True))


# Tile-wise (group) max-abs scales; wire bytes of the rotation and adaptive codecs by hand
def test_group_rotation_and_adaptive_wire_bytes_by_hand():
  shape = (8, 128, 64)  # 1024 tokens of 64 features
  assert codecs.MaxAbsQuant(3, "group", group=16).wire_bytes(shape, jnp.float32) == 1024 * 64 * 3 // 8 + 1024 * 4 * 4
  assert Hadamard(codecs.MaxAbsQuant(3, "group", scale_dtype="bfloat16", group=64)).wire_bytes(
      shape, jnp.float32) == 1024 * (24 + 2)
  # 256 tokens in 4 bits + 768 in 3 bits, one fp32 scale each, a 1024-bit map
  assert TokenAdaptive(3, 4, 0.25).wire_bytes(shape, jnp.float32) == 256 * 32 + 768 * 24 + 1024 * 4 + 128


def test_group_scales_confine_an_outlier_to_its_group():
  x = normal_input((2, 64)).at[0, 3].set(1000.0)
  err = np.abs(np.asarray(codecs.MaxAbsQuant(4, "group", group=16)(x) - x))
  assert err[0, 16:].max() < 2.0 and err[1].max() < 2.0  # other groups keep their own scale
  assert err[0, :16].max() > 3.0  # the outlier's group is coarse (its small entries round to 0)


def test_indivisible_shapes_are_clear_errors():
  with pytest.raises(ValueError, match="group=16 does not divide the 40 features"):
    codecs.MaxAbsQuant(3, "group", group=16).encode(normal_input((2, 40)))
  with pytest.raises(ValueError, match="block 16 does not divide the 40 features"):
    Hadamard(codecs.Identity(), block=16).wire_bytes((2, 40), jnp.float32)


def test_the_sparse_extras_are_their_own_protocol():
  """Index reuse needs `Positional` (TopK); the other codecs do not offer it."""
  positional = [c for c in ALL_CODECS + BLOCK_CODECS if isinstance(c, codecs.Positional)]
  assert positional and all(isinstance(c, codecs.TopK) for c in positional)
  assert len(positional) == sum(isinstance(c, codecs.TopK) for c in ALL_CODECS + BLOCK_CODECS)
