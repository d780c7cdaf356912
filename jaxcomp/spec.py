"""One-line string specs for CLIs: `[scheme+]codec[:arg[:option...]]`.

Codecs:  none | bf16 | fp16 | fp8 | quant:BITS[:stoch]
         | maxabs:BITS[:tensor|channel][:stoch][:scale=fp32|bf16|fp16][:clip=RATIO|mse]
         | topk:FRACTION[:row][:bf16|q8][:threshold|sort|approx] | randk:FRACTION[:row]
Schemes: plain (default) | ef | ef21 | efmixed | aqsgd;  backward only: reuse (TopK index reuse)
Examples: `topk:0.1`, `quant:4`, `ef21+topk:0.1`, `topk:0.1:q8` (8-bit values), `aqsgd+maxabs:2:stoch`,
          `maxabs:2:clip=mse`, `reuse`.
"""
from jaxcomp import codecs, feedback, selection
from jaxcomp.boundary import Boundary, Reuse

_SCHEMES = {"plain": feedback.Plain, "ef": feedback.EF, "ef21": feedback.EF21,
            "efmixed": feedback.EFMixed, "aqsgd": feedback.AQSGD}
_CASTS = {"bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3fn", "fp8e5m2": "float8_e5m2"}
_CODECS = ("none", *_CASTS, "quant", "maxabs", "topk", "randk")
_SCALES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _maxabs(bits: int, options: set, spec: str) -> codecs.MaxAbsQuant:
  """maxabs options: tensor|channel, stoch, scale=fp32|bf16|fp16, clip=RATIO|mse."""
  settings = dict(o.split("=", 1) for o in options if "=" in o)
  flags = {o for o in options if "=" not in o}
  if not flags <= {"tensor", "channel", "stoch"} or not set(settings) <= {"scale", "clip"} \
      or settings.get("scale", "fp32") not in _SCALES:
    raise ValueError(f"bad maxabs option(s) in {spec!r}; allowed: tensor, channel, stoch, "
                     f"scale={'|'.join(_SCALES)}, clip=RATIO|mse")
  clip = settings.get("clip", "1")
  return codecs.MaxAbsQuant(bits, stochastic="stoch" in options,
                            granularity="tensor" if "tensor" in options else "channel",
                            scale_dtype=_SCALES[settings.get("scale", "fp32")],
                            clip=clip if clip == "mse" else _number(clip, float, spec))


def _number(text, kind, spec):
  try:
    return kind(text)
  except ValueError:
    raise ValueError(f"bad number {text!r} in compression spec {spec!r}") from None


def _one_of(choices, options, default, spec):
  """The option among `choices` given in a spec (at most one), else `default`."""
  given = [c for c in choices if c in options]
  if len(given) > 1:
    raise ValueError(f"{spec!r} gives {' and '.join(given)}; choose one of {list(choices)}")
  return given[0] if given else default


def parse_codec(spec: str) -> codecs.Codec:
  name, *args = spec.strip().lower().split(":")
  options = set(args[1:])
  if name in ("none", "fp32", "identity") and not args:
    return codecs.Identity()
  if name in _CASTS and not args:
    return codecs.Cast(_CASTS[name])
  if name in ("quant", "maxabs", "topk", "randk") and args:
    if name == "maxabs":
      return _maxabs(_number(args[0], int, spec), options, spec)
    allowed = {"quant": {"stoch"}, "topk": {"row", "bf16", "q8", *selection.SELECTORS}}.get(name, {"row"})
    if not options <= allowed:
      raise ValueError(f"unknown option(s) {sorted(options - allowed)} in {spec!r}; allowed: {sorted(allowed)}")
    if name == "quant":
      return codecs.MinMaxQuant(_number(args[0], int, spec), stochastic="stoch" in options)
    per = "row" if "row" in options else "example"
    if name == "randk":
      return codecs.RandK(_number(args[0], float, spec), per=per)
    return codecs.TopK(_number(args[0], float, spec), per=per, select=_one_of(selection.SELECTORS, options, "auto", spec),
                       values=_one_of(("bf16", "q8"), options, "native", spec))
  raise ValueError(f"unknown compressor {spec!r}; expected one of {list(_CODECS)} "
                   "(quant/maxabs take :BITS, topk/randk take :FRACTION)")


def parse_scheme(spec: str, num_examples: int | None = None):
  """`ef21+topk:0.1` -> EF21(TopK(0.1)); `reuse` -> Reuse(). AQ-SGD needs `num_examples`."""
  text = spec.strip().lower()
  if text == "reuse":
    return Reuse()
  scheme_name, _, codec_text = text.rpartition("+")
  scheme_name = scheme_name or "plain"
  if scheme_name not in _SCHEMES:
    raise ValueError(f"unknown scheme {scheme_name!r} in {spec!r}; expected one of {list(_SCHEMES)}")
  codec = parse_codec(codec_text)
  if scheme_name == "aqsgd":
    if num_examples is None:
      raise ValueError(f"{spec!r}: AQ-SGD needs the number of training examples (num_examples)")
    return feedback.AQSGD(codec, num_examples=num_examples)
  return _SCHEMES[scheme_name](codec)


def parse_boundary(fwd: str, bwd: str, num_examples: int | None = None) -> Boundary:
  """Forward and backward specs -> a Boundary (e.g. fw2-bw8 is ('quant:2', 'quant:8'))."""
  return Boundary(parse_scheme(fwd, num_examples), parse_scheme(bwd, num_examples))
