"""The model registry: one typed record per model jaxcomp builds, and its stages with a method's model change.

A `ModelSpec` names a model family (Protocol NanoGPT's GPT or GPT-2), its configuration, and the shapes of a
default step (tokens per example, examples per step: the benchmark's or the papers' recipe). `model_stages`
cuts a configuration into pipeline stages with the change of model a method asks for (`bottleneck`: a learned
rank-R projection, `proj:R` / `subspace:R`; or `ssn[:R]`, Protocol NanoGPT's ReparamSSN, whose boundaries must
send the token ids: `ids+CODEC` both ways).
"""
import dataclasses
from typing import Callable, NamedTuple

from jaxcomp.compress import bottleneck as learned_bottleneck
from jaxcomp.compress import token_ids
from jaxcomp.models import gpt2, protocol_gpt

SSN = "ssn"  # a bottleneck spec's kind for ReparamSSN


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A model: `family` ("protocol" or "gpt2"), `config()` its configuration, `seq` tokens per example and `batch`
  examples per step by default, and a short `note`."""
  name: str
  family: str
  config: Callable
  seq: int
  batch: int
  note: str


MODELS = {m.name: m for m in (
    ModelSpec("protocol-203m", "protocol", protocol_gpt.ProtocolConfig.b203m, 1024, 512,
              "Protocol NanoGPT's model: 8 blocks of width 1,024, bf16, GPT-2's vocabulary (its records' 512 x 1,024 "
              "tokens a step)"),
    ModelSpec("protocol-tiny", "protocol", protocol_gpt.ProtocolConfig.tiny, 128, 16,
              "the same architecture at 2-CPU-core scale: 4 blocks of width 128, byte tokens, fp32"),
    *(ModelSpec(size, "gpt2", getattr(gpt2.GPT2Config, size), 1024 if size != "tiny" else 128, 8,
                f"GPT-2 {size} (fp32; embedding and head tied; the papers' batch of 8)")
      for size in ("tiny", "small", "medium", "large", "xl")),
)}
CUSTOM = "protocol"  # --model protocol --width W --depth L [--vocab V]: the benchmark's architecture at any size


def get(name: str, width: int | None = None, depth: int | None = None, vocab: int | None = None):
  """(ModelSpec, configuration) of `name` (`MODELS`, or `protocol` at `width`, `depth` and `vocab`, head dim 128
  where it divides the width, else 64); ValueError naming the choices."""
  if name == CUSTOM:
    if width is None or depth is None:
      raise ValueError("--model protocol needs --width W and --depth L (e.g. --width 2048 --depth 16: about 1.0 B "
                       "parameters)")
    head = 128 if width % 128 == 0 else 64
    cfg = protocol_gpt.ProtocolConfig(n_embd=width, n_layer=depth, head_dim=head,
                                      vocab_size=vocab or protocol_gpt.ProtocolConfig().vocab_size)
    return ModelSpec(CUSTOM, "protocol", lambda: cfg, 1024, 512, f"Protocol NanoGPT's architecture, {depth} blocks "
                     f"of width {width}"), cfg
  if name not in MODELS:
    raise ValueError(f"unknown model {name!r}; choose from {', '.join([*MODELS, CUSTOM])}")
  if (width, depth, vocab) != (None, None, None):
    raise ValueError(f"--width, --depth and --vocab size --model {CUSTOM}; --model {name} has its own")
  return MODELS[name], MODELS[name].config()


def num_params(cfg) -> int:
  """Parameters of a configuration (closed form for Protocol NanoGPT's models; GPT-2's from its shapes)."""
  if isinstance(cfg, protocol_gpt.ProtocolConfig):
    return protocol_gpt.num_params(cfg)
  d, v, p, n = cfg.n_embd, cfg.vocab_size, cfg.n_positions, cfg.n_layer
  return v * d + p * d + n * (12 * d * d + 13 * d) + 2 * d


class BottleneckError(ValueError):
  """A bottleneck spec that cannot change this model (its message says why; callers name their flag)."""


class ModelStages(NamedTuple):
  """`stages`, the model's own tied pairs (`tied`: GPT-2's embedding and head), the bottleneck's (`added_ties`) and
  the configuration they were built from (ReparamSSN's, when the method asks for it)."""
  stages: tuple
  tied: tuple
  added_ties: tuple
  cfg: object


def _reparam_ssn(cfg, spec: str, boundary):
  if not isinstance(cfg, protocol_gpt.ProtocolConfig):
    raise ValueError("ReparamSSN changes Protocol NanoGPT's model; use a protocol model (protocol-tiny, "
                     "protocol-203m)")
  _, *rank = spec.split(":")
  if len(rank) > 1 or (rank and not rank[0].isdigit()):
    raise ValueError("expected ssn or ssn:R (R a positive integer, the subspace rank)")
  if boundary is not None:
    for name, scheme in (("forward", boundary.fwd), ("backward", boundary.bwd)):
      if not isinstance(getattr(scheme, "codec", None), token_ids.TokenIds):
        raise ValueError(f"ReparamSSN sends [c, token ids] across each boundary: its {name} spec must be ids+CODEC "
                         "(e.g. ids+bf16, the record's; ids+maxabs:8)")
  return protocol_gpt.reparam_ssn(cfg, int(rank[0]) if rank else None)


def model_stages(cfg, num_stages: int, bottleneck: str | None = None, boundary=None) -> ModelStages:
  """`cfg` cut into `num_stages` stages with `bottleneck`'s change of model (None: none), checked against the
  `boundary` it will run with (ReparamSSN needs `ids+CODEC` both ways; `ids+CODEC` needs ReparamSSN). ValueErrors of the bottleneck's own (a bad spec, or ReparamSSN without ids+CODEC) are `BottleneckError`s."""
  if bottleneck and bottleneck.split(":")[0] == SSN:
    try:
      cfg, bottleneck = _reparam_ssn(cfg, bottleneck, boundary), None
    except ValueError as err:
      raise BottleneckError(str(err)) from None
  elif boundary is not None and any(isinstance(getattr(s, "codec", None), token_ids.TokenIds)
                                    for s in (boundary.fwd, boundary.bwd)):
    raise ValueError("ids+CODEC sends the last channel of what crosses a boundary as token ids: only ReparamSSN's "
                     "boundaries carry them (add the bottleneck ssn, or drop ids+)")
  protocol = isinstance(cfg, protocol_gpt.ProtocolConfig)
  stages = protocol_gpt.protocol_stages(cfg, num_stages) if protocol else gpt2.gpt2_stages(cfg, num_stages)
  tied, added = (() if protocol else gpt2.gpt2_tied(num_stages)), ()
  if bottleneck:
    try:
      learned = learned_bottleneck.parse(bottleneck)
      stages = learned_bottleneck.wrap(stages, learned, cfg.n_embd)
      added = learned_bottleneck.tied(learned, num_stages)
    except ValueError as err:
      raise BottleneckError(str(err)) from None
  return ModelStages(stages, tied, added, cfg)
