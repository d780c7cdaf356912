"""The method registry: one typed record per compression method, the table every experiment, benchmark and the
planner name into.

A method is what crosses the stage boundaries (forward and backward specs, `compress.spec`), how many dense warm-up
epochs it starts with (AQ-SGD's first epoch), and any change of the model it needs (`bottleneck`: a learned
rank-R projection, `proj:R` / `subspace:R`, or Protocol NanoGPT's ReparamSSN, `ssn`), with the run settings
that change with it (`settings`: ReparamSSN's record trains at its own learning rates). `DENSE` is the dense run
every comparison is against.
"""
import dataclasses

BWD4 = "maxabs:4:stoch"


@dataclasses.dataclass(frozen=True)
class Method:
  """One method: `fwd` and `bwd` specs, `warmup_epochs` dense epochs first, `bottleneck` (None: the model as
  it is), `settings` (run settings it changes, as (flag, value) pairs) and a short `note`."""
  name: str
  fwd: str
  bwd: str
  warmup_epochs: int = 0
  bottleneck: str | None = None
  settings: tuple = ()
  note: str = ""

  @property
  def changes_model(self) -> bool:
    """Whether the method changes the model (a bottleneck or ReparamSSN), not only what its boundaries send."""
    return self.bottleneck is not None

  def run_settings(self) -> dict:
    """The run settings of the method: specs, warm-up, bottleneck, and its own `settings`."""
    return {"fwd": self.fwd, "bwd": self.bwd, "warmup_epochs": self.warmup_epochs, "bottleneck": self.bottleneck,
            **dict(self.settings)}

  def flags(self) -> list[str]:
    """The method as command-line flags of `experiments.gpt2_wikitext`."""
    out = []
    for key, value in self.run_settings().items():
      if value is not None and not (key == "warmup_epochs" and value == 0):
        out += [f"--{key.replace('_', '-')}", str(value)]
    return out


# Protocol NanoGPT's ReparamSSN record trains at 0.8x the dense record's Muon lr and 0.75x its AdamW lrs
SSN_SETTINGS = (("lr", 0.02), ("embed_lr", 0.525), ("head_lr", 0.003), ("scalar_lr", 0.01125))

_TABLE = (  # the reference and new codecs first
    Method("fp32", "none", "none", note="the dense run"),
    Method("aqsgd-fw2-bw4", "aqsgd+maxabs:2:stoch", BWD4, 1, note="AQ-SGD: 2-bit changes of each example's activation"),
    Method("direct-fw2-bw4", "maxabs:2:stoch", BWD4),
    Method("had-fw2-bw4", "hadamard+maxabs:2:group=64:stoch", "hadamard+maxabs:4:group=64:stoch"),
    Method("had-fw3-bw4", "hadamard+maxabs:3:group=64", "hadamard+maxabs:4:group=64:stoch"),
    Method("had-adapt23-bw4", "hadamard+adaptive:2:3:0.25:stoch", "hadamard+maxabs:4:group=64:stoch"),
    Method("adapt34-bw4", "adaptive:3:4:0.25", "hadamard+maxabs:4:group=64:stoch"),
    Method("tile16-fw3-bw4", "maxabs:3:group=16", "maxabs:4:group=16:stoch"),
    Method("tile64-fw3-bw4", "maxabs:3:group=64", "maxabs:4:group=64:stoch", note="had-fw3-bw4 without rotation"),
    Method("chan-tile64-fw3-bw4", "maxabs:3:group=64:scales=both", "maxabs:4:group=64:scales=both:stoch",
           note="scales along both axes"),
    Method("had-fw2-bw3", "hadamard+maxabs:2:group=64:stoch", "hadamard+maxabs:3:group=64:stoch"),
    Method("bf16", "bf16", "bf16"),
    Method("fp8", "fp8", "fp8"),
    Method("sfp8", "fp8:scaled", "fp8:scaled", note="e4m3 with one fp32 amax scale per message"),
    Method("sfp8-channel", "fp8:scaled:channel", "fp8:scaled:channel", note="one scale per feature"),
    Method("quant-fw4-bw8", "quant:4", "quant:8"),
    Method("direct-fw4-bw8", "maxabs:4:stoch", "maxabs:8:stoch"),
    Method("top10-reuse", "topk:0.1", "reuse", note="TopK 10% with index reuse"),
    # the rest of the papers' GPT-2 rows: Rudakov's Table 5 and AQ-SGD's Figure 3
    Method("top50-reuse", "topk:0.5", "reuse"),
    Method("top30-reuse", "topk:0.3", "reuse"),
    Method("top20-reuse", "topk:0.2", "reuse"),
    Method("top10-separate", "topk:0.1", "topk:0.1", note="the gradient's own TopK (diverged in Rudakov's Table 5)"),
    Method("aqsgd-fw3-bw6", "aqsgd+maxabs:3:stoch", "maxabs:6:stoch", 1),
    Method("aqsgd-fw4-bw8", "aqsgd+maxabs:4:stoch", "maxabs:8:stoch", 1),
    Method("aqsgd-fw3-bw6-warm0", "aqsgd+maxabs:3:stoch", "maxabs:6:stoch",
           note="no dense epoch: only each example's first forward goes dense (AQ-SGD's Algorithm 1)"),
    Method("direct-fw3-bw6", "maxabs:3:stoch", "maxabs:6:stoch"),
    Method("aqsgd-top10-bw4", "aqsgd+topk:0.1", BWD4, 1, note="AQ-SGD with TopK 10% of each change (Rudakov)"),
    Method("top10-bf16-reuse", "topk:0.1:bf16", "reuse", note="values (and reused-index gradients) in bf16"),
    Method("top10-q8-reuse", "topk:0.1:q8", "reuse", note="int8 values, one fp32 scale per row"),
    Method("ef-top10-reuse", "ef+topk:0.1", "reuse"),
    Method("ef21-top10-reuse", "ef21+topk:0.1", "reuse"),
    Method("efmixed-top10", "efmixed+topk:0.1", BWD4),
    Method("rand10", "randk:0.1", BWD4),
    # learned rank-r bottlenecks (jaxcomp.compress.bottleneck): the specs compress z = x P, r of 64 features wide
    Method("proj16-fp32", "none", "none", bottleneck="proj:16", note="the bottleneck alone"),
    Method("proj16-fw3-bw4", "maxabs:3", BWD4, bottleneck="proj:16"),
    Method("subspace16-fw3-bw4", "maxabs:3", BWD4, bottleneck="subspace:16"),
    Method("proj16-fw4-bw4", "maxabs:4", BWD4, bottleneck="proj:16"),
    Method("proj24-fw2-bw3", "maxabs:2", "maxabs:3:stoch", bottleneck="proj:24"),
    Method("proj8-fw4-bw4", "maxabs:4", BWD4, bottleneck="proj:8"),
    Method("proj32-fw2-bw2", "maxabs:2", "maxabs:2:stoch", bottleneck="proj:32"),
    # Protocol NanoGPT's ReparamSSN (protocol models): [c, token ids] at every boundary, c r = 160/1024 of the width
    Method("ssn", "ids+bf16", "ids+bf16", bottleneck="ssn", settings=SSN_SETTINGS,
           note="ReparamSSN as its record: c in bf16, ids as uint16"),
    Method("ssn-fw8-bw8", "ids+maxabs:8:group=20", "ids+maxabs:8:group=20:stoch", bottleneck="ssn",
           settings=SSN_SETTINGS, note="ReparamSSN, c in 8 bits (a scale per 20)"),
    Method("ssn-fw4-bw4", "ids+maxabs:4:group=20", "ids+maxabs:4:group=20:stoch", bottleneck="ssn",
           settings=SSN_SETTINGS, note="ReparamSSN, c in 4 bits (a scale per 20)"),
)
METHODS: dict[str, Method] = {m.name: m for m in _TABLE}
DENSE = "fp32"
REFERENCE = "aqsgd-fw2-bw4"


def get(name: str) -> Method:
  """The method called `name`; ValueError naming the known ones."""
  if name not in METHODS:
    raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
  return METHODS[name]


def listing() -> str:
  """One line per method: its name, forward and backward specs, dense warm-up epochs and model change."""
  lines = [f"{'method':22s} {'fwd':34s} {'bwd':34s} warm-up  bottleneck"]
  for m in METHODS.values():
    lines.append(f"{m.name:22s} {m.fwd:34s} {m.bwd:34s} {m.warmup_epochs:7d}  {m.bottleneck or '-'}")
  return "\n".join(lines)
