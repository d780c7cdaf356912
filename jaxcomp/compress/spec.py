"""One-line string specs for CLIs: `[scheme+]codec[:arg[:option...]]`.

Codecs:  none | bf16 | fp16 | fp8 | fp8e5m2 | fp8[e5m2]:scaled[:tensor|channel] | quant:BITS[:stoch]
         | maxabs:BITS[:tensor|channel|group=G[:scales=auto|both|group]][:stoch][:scale=fp32|bf16|fp16]
                       [:clip=RATIO|mse][:grid=zero|midrise|auto]
         | topk:FRACTION[:row][:bf16|q8][:threshold|sort|approx] | randk:FRACTION[:row]
         | adaptive:LOW:HIGH:FRACTION[:group=G][:stoch][:grid=...][:clip=...]   (FRACTION of tokens in HIGH bits)
maxabs grids: `zero` {-L..L} s/L, L = 2^(B-1)-1 (0 exact); `midrise` +-(2j-1) s/(2^B-1), j = 1..2^(B-1)
(all 2^B codes, no 0); `auto` per scale the one of least error (flagged in the scale's sign bit). Without
grid= / clip= a bit width takes its default (`codecs.maxabs_defaults`): 2 and 3 bits auto with clip=mse,
4 bits auto unclipped, 5 bits and more the zero grid unclipped.
maxabs group=G scales: `group` one per G features of each token; `both` each channel's RMS times those
(= channel+maxabs:...:group=G:scales=group); `auto` (default) per message `both` or one per channel, whichever
errs less (so channel+maxabs:...:group=G is channel scales around that choice, not `both`).
Wrappers: hadamard[:BLOCK][:seed=S]+CODEC   (randomized Hadamard rotation around CODEC)
          channel+CODEC   (each channel divided by its RMS first, the scales sent: outlier channels)
          ids+CODEC       (the last channel holds token ids, sent as uint16 beside CODEC of the rest: ReparamSSN)
Schemes: plain (default) | ef | ef21 | efmixed | aqsgd;  backward only: reuse (TopK index reuse)
Examples: `topk:0.1`, `topk:0.1:q8` (8-bit values), `quant:4`, `ef21+topk:0.1`, `aqsgd+maxabs:2:stoch`,
          `maxabs:2:clip=mse`, `reuse`,
          `hadamard+maxabs:3:group=64`, `channel+maxabs:3:group=64`, `adaptive:3:4:0.25:group=32`.
"""
from jaxcomp.compress import adaptive, channel_scale, codecs, rotation, scale_axes, schemes, selection, token_ids
from jaxcomp.compress.boundary import Boundary, Reuse

_SCHEMES = {"plain": schemes.Plain, "ef": schemes.EF, "ef21": schemes.EF21,
            "efmixed": schemes.EFMixed, "aqsgd": schemes.AQSGD}
_CASTS = {"bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3fn", "fp8e5m2": "float8_e5m2"}
_CODECS = ("none", *_CASTS, "fp8:scaled", "quant", "maxabs", "topk", "randk", "adaptive", "hadamard+CODEC", "channel+CODEC",
           "ids+CODEC")
_SCALES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_WRAPPERS = ("hadamard", "channel", "ids")  # CODEC wrappers: `hadamard[:BLOCK]+CODEC`, `channel+CODEC`, `ids+CODEC`
_GROUP_SCALES = ("auto", "both", "group")  # maxabs group=G's scales= (docstring above)


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


def _settings(name: str, options: set, allowed_flags: set, allowed_keys: set, spec: str) -> tuple[set, dict]:
  """Options split into flags (`stoch`) and key=value settings (`group=64`), both checked."""
  settings = dict(o.split("=", 1) for o in options if "=" in o)
  flags = {o for o in options if "=" not in o}
  if not flags <= allowed_flags or not set(settings) <= allowed_keys:
    allowed = sorted(allowed_flags) + [f"{k}=N" for k in sorted(allowed_keys)]
    bad = sorted((flags - allowed_flags) | {f"{k}=" for k in set(settings) - allowed_keys})
    raise ValueError(f"bad {name} option(s) {bad} in {spec!r}; allowed: {allowed}")
  return flags, settings


def _scale_dtype(name: str, settings: dict, spec: str) -> str:
  if settings.get("scale", "fp32") not in _SCALES:
    raise ValueError(f"bad {name} option scale={settings['scale']!r} in {spec!r}; allowed: scale={'|'.join(_SCALES)}")
  return _SCALES[settings.get("scale", "fp32")]


def _grid_and_clip(name: str, settings: dict, spec: str) -> dict:
  """grid=zero|midrise and clip=RATIO|mse as MaxAbsQuant keywords (None: the bit width's default)."""
  if settings.get("grid", "zero") not in (*codecs.MAXABS_GRIDS, codecs.AUTO_GRID):
    raise ValueError(f"bad {name} option grid={settings['grid']!r} in {spec!r}; allowed: "
                     f"grid={'|'.join((*codecs.MAXABS_GRIDS, codecs.AUTO_GRID))}")
  clip = settings.get("clip")
  return {"grid": settings.get("grid"), "clip": clip if clip in (None, "mse") else _number(clip, float, spec)}


def _maxabs(bits: int, options: set, spec: str) -> codecs.Codec:
  """maxabs options: tensor|channel|group=G (with scales=auto|both|group), stoch, scale=fp32|bf16|fp16,
  clip=RATIO|mse, grid=zero|midrise|auto."""
  flags, settings = _settings("maxabs", options, {"tensor", "channel", "stoch"},
                              {"group", "scales", "scale", "clip", "grid"}, spec)
  group = settings.get("group")
  if group is not None and flags & {"tensor", "channel"}:
    raise ValueError(f"{spec!r}: group=G replaces tensor/channel scales; give one of them")
  scales = settings.get("scales", "auto")
  if "scales" in settings and group is None:
    raise ValueError(f"{spec!r}: scales={scales} chooses the axes of group=G's scales; add group=G or drop it")
  if scales not in _GROUP_SCALES:
    raise ValueError(f"bad maxabs option scales={scales!r} in {spec!r}; allowed: scales={'|'.join(_GROUP_SCALES)}")
  codec = codecs.MaxAbsQuant(bits, "group" if group is not None else "tensor" if "tensor" in flags else "channel",
                             stochastic="stoch" in flags, scale_dtype=_scale_dtype("maxabs", settings, spec),
                             group=None if group is None else _number(group, int, spec),
                             **_grid_and_clip("maxabs", settings, spec))
  if group is None or scales == "group":
    return codec
  return channel_scale.ChannelScale(codec) if scales == "both" else scale_axes.ScaleAxes(codec)


def _hadamard(head: str, inner: str, spec: str) -> rotation.Hadamard:
  """hadamard[:BLOCK][:seed=S]+CODEC."""
  _, *args = head.split(":")
  block = [a for a in args if "=" not in a]
  _, settings = _settings("hadamard", {a for a in args if "=" in a}, set(), {"seed"}, spec)
  if len(block) > 1:
    raise ValueError(f"hadamard takes one block size, got {block} in {spec!r}")
  return rotation.Hadamard(_codec(inner), block=_number(block[0], int, spec) if block else None,
                           seed=_number(settings.get("seed", "0"), int, spec))


def parse_codec(spec: str) -> codecs.Codec:
  """The codec a spec string names (docs/guide/specs.md); a ValueError names the spec and its bad value."""
  try:
    return _codec(spec)
  except ValueError as err:
    if repr(spec) in str(err):
      raise
    raise ValueError(f"{spec!r}: {err}") from None


def _codec(spec: str) -> codecs.Codec:
  head, plus, inner = spec.strip().lower().partition("+")
  if plus:
    if head == "channel":
      return channel_scale.ChannelScale(_codec(inner))
    if head == "ids":
      return token_ids.TokenIds(_codec(inner))
    if head.split(":")[0] not in _WRAPPERS:
      raise ValueError(f"unknown codec wrapper {head!r} in {spec!r}; the wrappers are hadamard[:BLOCK]+CODEC, "
                       "channel+CODEC and ids+CODEC")
    return _hadamard(head, inner, spec)
  name, *args = head.split(":")
  options = set(args[1:])
  if name in ("none", "fp32", "identity") and not args:
    return codecs.Identity()
  if name in _CASTS and not args:
    return codecs.Cast(_CASTS[name])
  if name in ("fp8", "fp8e5m2") and args[:1] == ["scaled"]:
    flags, _ = _settings(f"{name}:scaled", options, {"tensor", "channel"}, set(), spec)
    return codecs.ScaledCast(_CASTS[name], _one_of(("tensor", "channel"), flags, "tensor", spec))
  if name == "adaptive" and len(args) >= 3:
    flags, settings = _settings("adaptive", set(args[3:]), {"stoch"}, {"group", "scale", "grid", "clip"}, spec)
    group = settings.get("group")
    return adaptive.TokenAdaptive(_number(args[0], int, spec), _number(args[1], int, spec),
                                  _number(args[2], float, spec), None if group is None else _number(group, int, spec),
                                  stochastic="stoch" in flags, scale_dtype=_scale_dtype("adaptive", settings, spec),
                                  **_grid_and_clip("adaptive", settings, spec))
  if name == "maxabs" and args:
    return _maxabs(_number(args[0], int, spec), options, spec)
  if name in ("quant", "topk", "randk") and args:
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
                   "(quant/maxabs take :BITS, topk/randk take :FRACTION, adaptive takes :LOW:HIGH:FRACTION)")


def parse_scheme(spec: str, num_examples: int | None = None):
  """`ef21+topk:0.1` -> EF21(TopK(0.1)); `reuse` -> Reuse(). AQ-SGD needs `num_examples`."""
  text = spec.strip().lower()
  if text == "reuse":
    return Reuse()
  first, plus, rest = text.partition("+")
  scheme_name, codec_text = (first, rest) if plus and first in _SCHEMES else ("plain", text)
  if plus and first not in _SCHEMES and first.split(":")[0] not in _WRAPPERS:
    raise ValueError(f"unknown scheme {first!r} in {spec!r}; expected one of {list(_SCHEMES)}")
  codec = parse_codec(codec_text)
  if scheme_name == "aqsgd":
    if num_examples is None:
      raise ValueError(f"{spec!r}: AQ-SGD needs the number of training examples (num_examples)")
    return schemes.AQSGD(codec, num_examples=num_examples)
  return _SCHEMES[scheme_name](codec)


def parse_boundary(fwd: str, bwd: str, num_examples: int | None = None) -> Boundary:
  """Forward and backward specs -> a Boundary (e.g. fw2-bw8 is ('quant:2', 'quant:8'))."""
  return Boundary(parse_scheme(fwd, num_examples), parse_scheme(bwd, num_examples))
