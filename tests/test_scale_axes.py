"""jaxcomp.compress.scale_axes: `maxabs:B:group=G` sends, per message, whichever of one scale per channel
and channel RMS times group scales errs less by the mean over channels of each channel's relative error
(issue 36: grouped never worse than per channel)."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp.compress import channel_scale, codecs, scale_axes, spec


def outlier_activations():
  """N(0, 1) [4, 64, 256] with 4 of the 256 channels times 50 (issue 36's pattern, smaller)."""
  x = np.random.default_rng(0).standard_normal((4, 64, 256)).astype(np.float32)
  x[..., [3, 100, 150, 200]] *= 50
  return jnp.asarray(x)


def massive_token():
  """`outlier_activations` with 1000 at token 0 in two of its outlier channels (a massive activation)."""
  x = np.array(outlier_activations())
  x[:, 0, [3, 100]] = 1000.0
  return jnp.asarray(x)


def offset_channels():
  """Width 64, each channel its own offset and range (what the tiny GPT-2's activations look like): one
  scale per channel fits them better than any scale per token."""
  rng = np.random.default_rng(1)
  x = rng.standard_normal((4, 64, 64)) * rng.uniform(0.3, 3, 64) + rng.normal(0, 2, 64)
  return jnp.asarray(x, jnp.float32)


def errors(codec, x):
  """(pooled relative squared error, mean over channels of each channel's relative squared error)."""
  d = (codec(x, jax.random.key(0)) - x) ** 2
  return float(jnp.sum(d) / jnp.sum(x * x)), float(jnp.mean(jnp.sum(d, (0, 1)) / jnp.sum(x * x, (0, 1))))


def sent_grouped(codec, x) -> bool:
  return bool(codec.encode(x, jax.random.key(0)).arrays.grouped[0])


@pytest.mark.parametrize("bits, make", [  # each input at one width by default, every width with -m slow
    case if case in ((2, outlier_activations), (4, offset_channels)) else pytest.param(*case, marks=pytest.mark.slow)
    for case in itertools.product([2, 3, 4], [outlier_activations, offset_channels])])
def test_grouped_default_never_errs_more_than_one_scale_per_channel(bits, make):
  x = make()
  default = errors(spec.parse_codec(f"maxabs:{bits}:group=64"), x)
  per_channel = errors(spec.parse_codec(f"maxabs:{bits}"), x)
  assert default[1] <= per_channel[1] * (1 + 1e-6), (default, per_channel)  # the rule's own measure
  assert default[0] <= per_channel[0], (default, per_channel)  # and, on these inputs, the total error too


def test_every_channel_weighs_the_same_in_the_choice():
  """A massive token at 2 bits: G errs 3x more in total (the two huge channels decide that) but less by the
  channel mean, since the small channels beside them keep their own variation; G is sent."""
  x = massive_token()
  codec = spec.parse_codec("maxabs:2:group=64")
  default, per_channel = errors(codec, x), errors(spec.parse_codec("maxabs:2"), x)
  assert default[1] < per_channel[1] and default[0] > 2 * per_channel[0], (default, per_channel)
  assert sent_grouped(codec, x)


def test_each_axis_is_chosen_where_it_wins():
  """Outlier channels: the channel-scaled groups (groups alone lose the small channels); offset channels:
  one scale per channel, decoded bit for bit as `maxabs:B` decodes it."""
  codec = spec.parse_codec("maxabs:2:group=64")
  assert isinstance(codec, scale_axes.ScaleAxes)
  x = outlier_activations()
  assert sent_grouped(codec, x)
  np.testing.assert_array_equal(codec(x), spec.parse_codec("maxabs:2:group=64:scales=both")(x))
  y = offset_channels()
  assert not sent_grouped(codec, y)
  np.testing.assert_array_equal(codec(y), spec.parse_codec("maxabs:2")(y))


def test_with_stoch_the_chosen_code_is_drawn_as_it_would_be_alone():
  """`:stoch` sends the chosen candidate's own stochastic draw with the message's key: G's on outlier channels,
  P's on offset channels, bit for bit."""
  codec, key = spec.parse_codec("maxabs:2:group=64:stoch"), jax.random.key(7)
  x, y = outlier_activations(), offset_channels()
  assert sent_grouped(codec, x) and not sent_grouped(codec, y)
  np.testing.assert_array_equal(codec(x, key), spec.parse_codec("maxabs:2:group=64:scales=both:stoch")(x, key))
  np.testing.assert_array_equal(codec(y, key), spec.parse_codec("maxabs:2:stoch")(y, key))


@pytest.mark.parametrize("scale", ["fp32", "bf16"])
def test_one_message_size_whichever_axis(scale):
  codec = spec.parse_codec(f"maxabs:2:group=64:scale={scale}")
  both = spec.parse_codec(f"maxabs:2:group=64:scales=both:scale={scale}")
  for x in (outlier_activations(), offset_channels()):
    payload = codec.encode(x)
    assert codecs.nbytes(payload) == codec.wire_bytes(x.shape, x.dtype) == both.wire_bytes(x.shape, x.dtype) + 1
  y = offset_channels()  # P's bf16 scales go through the fp32 words exactly
  assert not sent_grouped(codec, y)
  np.testing.assert_array_equal(codec(y), spec.parse_codec(f"maxabs:2:scale={scale}")(y))


def test_the_choice_does_not_depend_on_magnitude_or_rounding():
  """x * 2^k, k from -40 to 40, is chosen as x (the errors are taken on x / 2^E); `:stoch` chooses as
  nearest rounding does (measured without the draw)."""
  codec = spec.parse_codec("maxabs:3:group=64")
  for x in (outlier_activations(), offset_channels()):
    want = sent_grouped(codec, x)
    assert all(sent_grouped(codec, x * 2.0 ** k) == want for k in range(-40, 41, 8))
    assert sent_grouped(spec.parse_codec("maxabs:3:group=64:stoch"), x) == want


def test_a_non_finite_entry_takes_one_scale_per_channel():
  x = outlier_activations().at[0, 5, 3].set(jnp.inf).at[1, 2, 7].set(jnp.nan)
  codec = spec.parse_codec("maxabs:4:group=64")
  assert not sent_grouped(codec, x)
  np.testing.assert_array_equal(codec(x), spec.parse_codec("maxabs:4")(x))


def test_spec_scales_options():
  assert isinstance(spec.parse_codec("maxabs:3:group=64:scales=both"), channel_scale.ChannelScale)
  assert spec.parse_codec("maxabs:3:group=64:scales=group") == codecs.MaxAbsQuant(3, "group", group=64)
  with pytest.raises(ValueError, match="scales=both chooses the axes of group=G"):
    spec.parse_codec("maxabs:3:scales=both")
  with pytest.raises(ValueError, match="scales='rows'"):
    spec.parse_codec("maxabs:3:group=64:scales=rows")
