"""jaxcomp.compress.channel_scale: a scale per channel sent beside any codec (`channel+CODEC`)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp.compress import channel_scale, codecs, spec


def outlier_activations(seed=0):
  """N(0, 1) [8, 128, 768] with 4 of the 768 channels times 50 (issue 36's tensor)."""
  x = np.random.default_rng(seed).standard_normal((8, 128, 768)).astype(np.float32)
  x[..., [3, 200, 400, 700]] *= 50
  return jnp.asarray(x)


def channel_averaged_error(codec, x):
  """Mean over channels of ||C(x)_f - x_f||^2 / ||x_f||^2: what each channel keeps, whatever its size."""
  y = codec(x, jax.random.key(0))
  return float(jnp.mean(jnp.sum((y - x) ** 2, axis=(0, 1)) / jnp.sum(x ** 2, axis=(0, 1))))


@pytest.mark.parametrize("bits", [3, 4])
def test_groups_after_channel_scales_keep_the_small_channels(bits):
  """Per-token groups alone lose the 764 ordinary channels to the 4 outliers' scale (0.24-0.29 averaged over
  channels); divided by their channels' RMS first they keep them, better than one scale per channel."""
  x = outlier_activations()
  grouped = channel_averaged_error(spec.parse_codec(f"maxabs:{bits}:group=64:scales=group"), x)
  per_channel = channel_averaged_error(spec.parse_codec(f"maxabs:{bits}"), x)
  both = channel_averaged_error(spec.parse_codec(f"channel+maxabs:{bits}:group=64:scales=group"), x)
  assert both < per_channel < grouped / 5, (both, per_channel, grouped)


def test_the_scales_travel_and_are_counted():
  codec = spec.parse_codec("channel+maxabs:3:group=64:scales=group")
  x = outlier_activations()[:2]
  payload = codec.encode(x)
  assert set(payload.parts()) == {"inner", "scale"} and payload.arrays.scale.dtype == jnp.uint32
  assert codecs.nbytes(payload) == codec.wire_bytes(x.shape, x.dtype) == (
      spec.parse_codec("maxabs:3:group=64:scales=group").wire_bytes(x.shape, x.dtype) + 4 * 768)
  np.testing.assert_allclose(np.asarray(channel_scale.channel_scales(x)),
                             np.sqrt(np.mean(np.asarray(x, np.float64) ** 2, axis=(0, 1))), rtol=1e-5)


def test_non_finite_entries_decode_as_the_inner_codec_decodes_them():
  """The scales are taken over finite entries, so inf and NaN reach the inner codec as they are (a NaN
  makes its whole group NaN there, as without the wrapper) and never turn a channel's scale non-finite."""
  x = outlier_activations()[:1, :4, :64]
  x = x.at[0, 1, 5].set(jnp.inf).at[0, 2, 6].set(jnp.nan).at[0, 3, 7].set(-jnp.inf)
  y = spec.parse_codec("channel+maxabs:4:group=64:scales=group")(x)
  alone = spec.parse_codec("maxabs:4:group=64:scales=group")(x)
  assert y[0, 1, 5] == jnp.inf and jnp.isnan(y[0, 2, 6]) and y[0, 3, 7] == -jnp.inf
  np.testing.assert_array_equal(np.isfinite(np.asarray(y)), np.isfinite(np.asarray(alone)))
  assert bool(jnp.all(jnp.isfinite(channel_scale.channel_scales(x))))


def test_wrappers_nest_and_a_bad_one_is_named():
  codec = spec.parse_codec("channel+hadamard+maxabs:4:group=16:scales=group")
  assert isinstance(codec, channel_scale.ChannelScale) and codec.inner.inner.group == 16
  x = outlier_activations()[:1, :8, :64]
  assert codec(x).shape == x.shape
  with pytest.raises(ValueError, match="wrappers are hadamard"):
    spec.parse_codec("rotate+maxabs:4")


def test_a_massive_token_does_not_set_its_channels_scale():
  """The outlier model's pattern (`--outliers 4:64:1024`): 4 of 64 channels x 64 and 1024 added at the
  first token of every sequence in two of them. The channel's RMS, not its max, is the divisor, so the
  massive token sets only its own token's scale and the channel's other tokens keep theirs: below one
  scale per channel at 2 and 3 bits (0.94x and 0.78x; divided by the max, 1.19x at 2 bits)."""
  x = np.random.default_rng(1).standard_normal((8, 128, 64)).astype(np.float32)
  x[..., [5, 21, 37, 53]] *= 64
  x[:, 0, [5, 37]] += 1024
  x = jnp.asarray(x)
  for bits in (2, 3):
    per_channel = channel_averaged_error(spec.parse_codec(f"maxabs:{bits}"), x)
    both = channel_averaged_error(spec.parse_codec(f"channel+maxabs:{bits}:group=64:scales=group"), x)
    assert both < per_channel, (bits, both, per_channel)


def test_a_boundary_spec_takes_the_wrapper_with_or_without_a_scheme():
  from jaxcomp.compress import schemes
  plain, ef = spec.parse_scheme("channel+maxabs:4:group=64:scales=group:stoch"), spec.parse_scheme("ef+channel+maxabs:3:group=64:scales=group")
  assert isinstance(plain, schemes.Plain) and isinstance(plain.codec, channel_scale.ChannelScale)
  assert isinstance(ef, schemes.EF) and isinstance(ef.codec, channel_scale.ChannelScale)


def test_huge_and_tiny_inputs_round_trip_finite():
  """The RMS is taken of x / max|x|: squares of 1e37 overflow to inf, and an inf scale decoded to NaN."""
  for scale in (1e37, 1e-30):
    x = jax.random.normal(jax.random.key(0), (1, 8, 64)) * scale
    y = spec.parse_codec("channel+maxabs:4:group=64:scales=group")(x)
    assert bool(jnp.all(jnp.isfinite(y))), scale
    assert float(jnp.sum(((y - x) / scale) ** 2) / jnp.sum((x / scale) ** 2)) < 0.1, scale
