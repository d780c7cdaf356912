import pathlib
import re

import pytest

from jaxcomp.compress import codecs, schemes, spec
from jaxcomp.compress.adaptive import TokenAdaptive
from jaxcomp.compress.boundary import Reuse
from jaxcomp.compress.channel_scale import ChannelScale
from jaxcomp.compress.rotation import Hadamard
from jaxcomp.compress.scale_axes import ScaleAxes


@pytest.mark.parametrize("text, expected", [
    ("topk:0.1", schemes.Plain(codecs.TopK(0.1))),
    ("quant:4", schemes.Plain(codecs.MinMaxQuant(4))),
    ("quant:2:stoch", schemes.Plain(codecs.MinMaxQuant(2, stochastic=True))),
    ("maxabs:3:tensor:stoch", schemes.Plain(codecs.MaxAbsQuant(3, "tensor", stochastic=True))),
    ("maxabs:4:scale=fp16", schemes.Plain(codecs.MaxAbsQuant(4, scale_dtype="float16"))),
    ("maxabs:2:clip=mse:scale=bf16", schemes.Plain(codecs.MaxAbsQuant(2, scale_dtype="bfloat16", clip="mse"))),
    ("maxabs:2:clip=0.8", schemes.Plain(codecs.MaxAbsQuant(2, clip=0.8))),
    ("maxabs:2:grid=midrise:clip=mse", schemes.Plain(codecs.MaxAbsQuant(2, clip="mse", grid="midrise"))),
    ("maxabs:1:grid=midrise:stoch", schemes.Plain(codecs.MaxAbsQuant(1, stochastic=True, grid="midrise"))),
    ("maxabs:3:grid=zero", schemes.Plain(codecs.MaxAbsQuant(3, grid="zero"))),
    ("fp8:scaled", schemes.Plain(codecs.ScaledCast())),
    ("fp8e5m2:scaled:channel", schemes.Plain(codecs.ScaledCast("float8_e5m2", "channel"))),
    ("ef21+topk:0.1", schemes.EF21(codecs.TopK(0.1))),
    ("EF+TopK:0.05:row", schemes.EF(codecs.TopK(0.05, per="row"))),
    ("efmixed+topk:0.1", schemes.EFMixed(codecs.TopK(0.1))),
    ("topk:0.1:sort", schemes.Plain(codecs.TopK(0.1, select="sort"))),
    ("topk:0.2:row:threshold", schemes.Plain(codecs.TopK(0.2, per="row", select="threshold"))),
    ("aqsgd+quant:2", schemes.AQSGD(codecs.MinMaxQuant(2), num_examples=50)),
    ("randk:0.3", schemes.Plain(codecs.RandK(0.3))),
    ("bf16", schemes.Plain(codecs.Cast("bfloat16"))),
    ("none", schemes.Plain(codecs.Identity())),
    ("reuse", Reuse()),
])
def test_parse_scheme(text, expected):
  assert spec.parse_scheme(text, num_examples=50) == expected


@pytest.mark.parametrize("text, match", [
    ("gzip:3", "unknown compressor 'gzip:3'"),
    ("quant:0", "bits must be an integer in 1..16, got 0"),
    ("quant:17", "got 17"),
    ("maxabs:17", r"^'maxabs:17': bits must be an integer in 1..16, got 17$"),  # the spec named, once
    ("hadamard+maxabs:17", r"^'hadamard\+maxabs:17': bits must be an integer in 1..16, got 17$"),
    ("quant:four", "bad number 'four'"),
    ("topk:1.5", r"fraction K must be in \(0, 1\], got 1.5"),
    ("topk:0", "got 0.0"),
    ("topk", "unknown compressor 'topk'"),
    ("ef22+topk:0.1", "unknown scheme 'ef22'"),
    ("topk:0.1:col", "unknown option"),
    ("maxabs:4:scale=fp8", "bad maxabs option"),
    ("maxabs:4:row", "bad maxabs option"),
    ("maxabs:4:clip=1.5", r"clip must be a ratio in \(0, 1\] or 'mse', got 1.5"),
    ("maxabs:4:clip=lots", "bad number 'lots'"),
    ("maxabs:1", "maxabs needs bits >= 2"),
    ("maxabs:2:grid=lopsided", "bad maxabs option grid='lopsided'"),
    ("fp8:scaled:row", r"bad fp8:scaled option\(s\) \['row'\]"),
    ("fp8:scaled:tensor:channel", "gives tensor and channel"),
    ("topk:0.1:sort:approx", "gives sort and approx; choose one of"),
    ("aqsgd+quant:2", "needs the number of training examples"),
])
def test_parse_errors_name_the_bad_value(text, match):
  kwargs = {} if text.startswith("aqsgd") else {"num_examples": 10}
  with pytest.raises(ValueError, match=match):
    spec.parse_scheme(text, **kwargs)


def test_parse_boundary_validates_reuse():
  assert spec.parse_boundary("topk:0.3", "reuse").bwd == Reuse()
  with pytest.raises(ValueError, match="index reuse needs a single TopK"):
    spec.parse_boundary("quant:4", "reuse")


@pytest.mark.parametrize("text, expected", [
    ("maxabs:3:group=64", ScaleAxes(codecs.MaxAbsQuant(3, "group", group=64))),
    ("maxabs:3:group=64:scales=group", codecs.MaxAbsQuant(3, "group", group=64)),
    ("maxabs:3:group=64:scales=both", ChannelScale(codecs.MaxAbsQuant(3, "group", group=64))),
    ("maxabs:2:group=8:stoch:scale=bf16", ScaleAxes(codecs.MaxAbsQuant(2, "group", True, "bfloat16", group=8))),
    ("maxabs:3:group=8:clip=mse", ScaleAxes(codecs.MaxAbsQuant(3, "group", clip="mse", group=8))),
    ("hadamard+maxabs:3:group=64", Hadamard(ScaleAxes(codecs.MaxAbsQuant(3, "group", group=64)))),
    ("hadamard:32:seed=7+topk:0.1", Hadamard(codecs.TopK(0.1), 32, 7)),
    ("adaptive:3:4:0.25", TokenAdaptive(3, 4, 0.25)),
    ("adaptive:3:4:0.5:group=16:stoch:scale=bf16", TokenAdaptive(3, 4, 0.5, 16, True, "bfloat16")),
    ("hadamard+adaptive:3:4:0.25", Hadamard(TokenAdaptive(3, 4, 0.25))),
    ("hadamard+maxabs:2:group=16:grid=midrise", Hadamard(ScaleAxes(codecs.MaxAbsQuant(2, "group", group=16, grid="midrise")))),
    ("adaptive:2:3:0.25:grid=midrise:stoch", TokenAdaptive(2, 3, 0.25, stochastic=True, grid="midrise")),
    ("adaptive:2:4:0.25:clip=0.9", TokenAdaptive(2, 4, 0.25, clip=0.9)),
])
def test_group_rotation_and_adaptive_specs(text, expected):
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
def test_bad_group_rotation_and_adaptive_specs(text, match):
  with pytest.raises(ValueError, match=match):
    spec.parse_scheme(text)


def test_the_specs_page_names_the_codec_scales_both_builds():
  """docs/guide/specs.md says which `channel+` spelling `maxabs:B:group=G:scales=both` equals: that spelling parses to
  the same codec (channel scales around the groups alone), and `channel+maxabs:B:group=G` does not (its group=G
  means scales=auto: channel scales around the per-message choice)."""
  page = (pathlib.Path(__file__).parents[1] / "docs" / "guide" / "specs.md").read_text()
  said = re.search(r"`scales=both`: each channel divided by its RMS first \(= `([^`]+)`", page).group(1)
  both = spec.parse_codec("maxabs:3:group=64:scales=both")
  assert spec.parse_codec(said.replace("B", "3").replace("G", "64")) == both
  assert both == ChannelScale(codecs.MaxAbsQuant(3, "group", group=64))
  around_auto = spec.parse_codec("channel+maxabs:3:group=64")
  assert around_auto == ChannelScale(ScaleAxes(codecs.MaxAbsQuant(3, "group", group=64))) != both
