"""Which method, schedule and microbatch count reach a target loss soonest, for a model on a link.

    python -m jaxcomp.plan --model protocol-203m --stages 8 --link 200mbit:50ms --meter inbound --device h100-8
    python -m jaxcomp.plan --model protocol --width 2048 --depth 16 --stages 8 --link 100mbit:30ms --device h100-8
    python -m jaxcomp.plan --model protocol-tiny --stages 4 --link 10mbit:5ms --device cpu      # measured here

T = the dense run's steps to the target (`--dense-steps`, the user's) x a method's step inflation x its step time:
- the step time is netsim's step as the sharded executor runs the schedule's table (`analysis.netsim`, ticks), fed
  each stage's forward and backward and each boundary's codec per microbatch (`analysis.step_cost`: compiled for
  `--device`'s chip and timed by the roofline, an estimate, or measured on this machine with `--device cpu`; the
  stage programs compiled at the fewest and the most microbatches searched, the counts between interpolated in
  tokens per microbatch), the bytes of each message (the boundary's `wire_bytes`), the data-parallel exchange and
  the tied-parameter exchange;
- the search: every schedule (`--schedules`, each with and without overlapped sends), microbatch count
  (`--microbatches`) and, for a model with tied parameters, their exchange (dense, untied or compressed); the
  fastest step of each method on each link is its row;
- the inflation comes from the shipped step-inflation table (`analysis.step_table`: measured by
  `experiments.ladder`, its provenance printed), or the user's ladder (`--steps-from`), projected to the dense
  steps and the model's width, with its range; a method the table has not measured has no T.
Each link gets a ranked table, the winner's training command and a plot of T against bytes per token. Figures that
are estimates say so, and an inflation outside what was measured says so.
"""
import argparse
import dataclasses
import json
import math
import pathlib
import sys
import textwrap
import time
import typing
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomp import losses, methods, pipeline
from jaxcomp.analysis import netsim, step_cost, step_inputs, step_table, targets
from jaxcomp.analysis.link import Link
from jaxcomp.compress.spec import parse_boundary
from jaxcomp.models import registry
from jaxcomp.parallel import padded_rows, schedules

DEFAULT_METHODS = ("fp32", "bf16", "top10-q8-reuse", "chan-tile64-fw3-bw4", "adapt34-bw4", "aqsgd-fw2-bw4",
                   "direct-fw4-bw8", "ssn", "ssn-fw4-bw4", "proj16-fw4-bw4")
DEFAULT_SCHEDULES = ("gpipe", "1f1b", "zb-h1", "interleaved:2")
TIED_COMPRESSED = "ef+maxabs:4:group=64:scales=group"  # the tied exchange compressed (--tied-compression)
DENSE_STEPS = 2925  # Protocol NanoGPT's dense record's steps to its target: the default horizon
# The step time's share of T's range, (low, high) factors per link model. On Protocol NanoGPT's meter (inbound)
# netsim fed compiled compute predicts both records' steps within 0.5% (dense -0.07%, ReparamSSN -0.45%;
# docs/results/step_inflation.md): +-1%. The per-direction link is ideal (a message costs its bytes at the rate
# plus one latency); over a real shaped TCP link the steps took longer: protocol-cpu on 2 stages at 798 kbit/s +
# 196 ms (benchmarks.real_link) measured 1.07-1.39x the steps planned for it, the most for the smallest messages
# (docs/guide/plan.md): -1% .. +39%.
STEP_RANGE = {"inbound": (0.99, 1.01), "per_direction": (0.99, 1.39)}


class Choice(NamedTuple):
  """One configuration's predicted step: the method, microbatches, schedule, overlapped sends, tied exchange,
  link, step seconds, the critical path's seconds by term and bytes per token over a boundary (both ways, the
  boundaries' mean: Protocol NanoGPT's meter)."""
  method: str
  microbatches: int
  schedule: str
  overlap: bool
  tied: str | None
  link: Link
  step_s: float
  critical: dict
  bytes_per_token: float


def microbatch_choices(stages: int, per_shard: int, given=None) -> list[int]:
  """`given`, else S, 2S, 4S, 8S (those that divide the examples per data shard), else every divisor up to 8S."""
  if given:
    bad = [m for m in given if m < 1 or per_shard % m]
    if bad:
      raise ValueError(f"--microbatches {bad}: each must divide the {per_shard} examples per data shard")
    return sorted(set(given))
  wanted = [m for m in (stages, 2 * stages, 4 * stages, 8 * stages) if per_shard % m == 0]
  return wanted or [m for m in range(1, min(per_shard, 8 * stages) + 1) if per_shard % m == 0]


def interpolate(a: step_cost.StageCosts, n_a: float, b: step_cost.StageCosts, n_b: float, n: float):
  """Costs at `n` tokens per microbatch, affine in tokens between `a` (at n_a) and `b` (at n_b)."""
  w = 0.0 if n_a == n_b else (n - n_a) / (n_b - n_a)
  mix = lambda x, y: jax.tree.map(lambda u, v: u + w * (v - u), x, y)
  return a._replace(source=f"{a.source}; interpolated in tokens per microbatch", fwd_s=mix(a.fwd_s, b.fwd_s),
                    bwd_s=mix(a.bwd_s, b.bwd_s), encode_s=mix(a.encode_s, b.encode_s),
                    decode_s=mix(a.decode_s, b.decode_s))


class Planner:
  """Predicts each method's fastest step over the search space. `build(method, microbatches)` -> Pipeline (None:
  the method does not apply to the model); `batch` one data shard's batch; `clock` a `step_cost` clock; `depth` the
  model's blocks (interleaved tables need S x V of them)."""

  def __init__(self, build, batch, clock, depth: int, meter: str = "per_direction", data_parallel: int = 1):
    self.build, self.batch, self.clock, self.meter, self.replicas = build, batch, clock, meter, data_parallel
    self.depth = depth  # the model's blocks
    self.sources = {}  # (stage set, microbatches) -> CostSource
    self.method_costs = {}  # (method, microbatches) -> StageCosts
    self.parameter_exchanges = {}  # model change -> (data-parallel exchange, {tied choice: tied exchange})
    self.skipped = {}  # why configurations were left out -> which

  def costs(self, pipe, method: methods.Method, m: int, known: list[int]) -> step_cost.StageCosts:
    """The method's costs at `m` microbatches: compiled or measured at the fewest and the most of `known`,
    interpolated between."""
    if (method.name, m) in self.method_costs:
      return self.method_costs[method.name, m]
    ends = (min(known), max(known))
    if m in ends:
      key = (method.bottleneck, m)
      if key not in self.sources:
        self.sources[key] = step_cost.stage_costs(pipeline.uncompressed(pipe), self.batch, self.clock)
      costs = self.sources[key](pipe.boundary)
    else:
      tokens = lambda k: self.batch[pipe.input_key].size / k
      lo, hi = (self.costs(dataclasses.replace(pipe, microbatches=k), method, k, known) for k in ends)
      costs = interpolate(lo, tokens(ends[0]), hi, tokens(ends[1]), tokens(m))
    self.method_costs[method.name, m] = costs
    return costs

  def search(self, names, microbatches, schedule_names, tied_choices, links, progress=None) -> list[Choice]:
    """Every method's fastest configuration on each link; `progress(i, n, name)` is called before the i-th of the
    n methods is searched."""
    best = {}
    for i, name in enumerate(names, 1):
      if progress is not None:
        progress(i, len(names), name)
      method = methods.get(name)
      for m in microbatches:
        pipe = self.build(method, m)
        if pipe is None:
          self.skipped.setdefault(f"changes a model this one cannot take ({method.bottleneck})", []).append(name)
          break
        costs = self.costs(pipe, method, m, microbatches)
        sent = [pipe.boundary.wire_bytes(s.shape, s.dtype) for s in pipeline.activation_shapes(pipe, self.batch)]
        per_token = sum(f + b for f, b in sent) / len(sent) / (self.batch[pipe.input_key].size / m)
        exchange, ties = self.exchanges(pipe, method, tied_choices)
        for table in self.tables(schedule_names, pipe, m):
          chunk_costs, chunk_sent = step_inputs.on_chunks(costs, sent, table.chunks_per_device)
          fwd_s, bwd_s = step_cost.op_seconds(chunk_costs)
          for tied, tied_exchange in ties.items():
            for link in links:
              tl = netsim.simulate_step(fwd_s, bwd_s, [f for f, _ in chunk_sent], [b for _, b in chunk_sent], m,
                                        link, 0.0, exchange if table.chunks_per_device == 1 else None, table,
                                        ticks=True, meter=self.meter, tied=tied_exchange)
              choice = Choice(name, m, table.name, table.overlapped_sends, tied, link, tl.makespan,
                              tl.critical_seconds(), per_token)
              if (link, name) not in best or choice.step_s < best[link, name].step_s:
                best[link, name] = choice
    return list(best.values())

  def exchanges(self, pipe, method: methods.Method, tied_choices):
    """(the dense data-parallel exchange of each stage device's padded parameter row, None with one replica;
    {tied choice: its exchange}, {None: None} without tied parameters) of the method's stages: parameters only, so
    once per model change, whatever the boundary and the microbatches."""
    if method.bottleneck not in self.parameter_exchanges:
      exchange = None
      if self.replicas > 1:
        params = jax.eval_shape(lambda: pipeline.init_state(pipe, optax.sgd(0.0), jax.random.key(1),
                                                            self.batch)).params
        exchange = step_inputs.exchange(None, padded_rows.FlatRows(params).size, pipe.num_stages, self.replicas)
      ties = ({c: step_inputs.tied_exchange(c, pipe, self.batch, self.clock) for c in tied_choices} if pipe.tied
              else {None: None})
      self.parameter_exchanges[method.bottleneck] = exchange, ties
    return self.parameter_exchanges[method.bottleneck]

  def tables(self, names, pipe, m: int):
    """The train tables of `names` with and without overlapped sends that fit S stages and m microbatches (the
    others are noted in `skipped`); an interleaved table needs a block per chunk (`depth` >= S x V)."""
    for name in names:
      for overlap in (False, True):
        try:
          schedule = schedules.parse(name, overlap)
          chunks = schedule.chunks_per_device
          if chunks > 1 and self.depth < pipe.num_stages * chunks:
            raise ValueError(f"needs {pipe.num_stages * chunks} blocks, the model has {self.depth}")
          if chunks > 1 and self.replicas > 1:
            raise ValueError("interleaved tables are searched with one data-parallel replica")
          yield schedule.train_table(pipe.num_stages, m)
        except ValueError as err:
          reason = str(err).split(": got")[0]  # the same reason at every M
          self.skipped.setdefault(reason, []).append(f"{name}{' +overlap' if overlap else ''} at M={m}")


class Row(NamedTuple):
  """A method's row on one link: its fastest `choice`, `inflation` (None: not measured) and T (s) with its range."""
  choice: Choice
  inflation: step_table.Inflation | None
  T: float | None
  T_low: float | None
  T_high: float | None


def rank(choices: list[Choice], table: dict, dense_steps: int, width: int, meter: str = "per_direction",
         stages: int | None = None) -> dict[Link, list[Row]]:
  """Per link, every method's row ranked by T (methods without a measured inflation after, by step time); T's range
  is the inflation's range times the step time's (`STEP_RANGE` of the `meter`); the inflation at `stages`."""
  out, (step_low, step_high) = {}, STEP_RANGE[meter]
  for c in choices:
    inf = step_table.inflation(table, c.method, dense_steps, width, stages=stages)
    t = None if inf is None else dense_steps * c.step_s
    row = Row(c, inf, t and t * inf.value, t and t * inf.low * step_low, t and t * inf.high * step_high)
    out.setdefault(c.link, []).append(row)
  bounded = lambda r: r.T is None or math.isinf(r.T_high)  # not measured, or only a lower bound
  for rows in out.values():
    rows.sort(key=lambda r: (bounded(r), r.T if not bounded(r) else r.choice.step_s))
  return out


def schedule_label(c: Choice) -> str:
  return c.schedule + (" +overlap" if c.overlap else "")


def render(link: Link, rows: list[Row], dense: str = methods.DENSE) -> str:
  """One link's ranked table."""
  base = next((r.T for r in rows if r.choice.method == dense and r.T), None)
  lines = [f"| # | method | B/token | schedule | M | tied | step s | compute / link % | inflation [range] | "
           f"T s [range] | T / {dense} [range] |", "|---:|---|---:|---|---:|---|---:|---:|---|---|---:|"]
  for i, r in enumerate(rows, 1):
    c = r.choice
    crit = sum(c.critical.values()) or 1.0
    share = f"{100 * c.critical.get('compute', 0) / crit:.0f} / {100 * c.critical.get('link', 0) / crit:.0f}"
    if r.inflation is None:
      inf, t, rel = "not measured", "-", "-"
    elif math.isinf(r.inflation.high):  # only a lower bound
      inf, t = f"> {r.inflation.low:.2f}", f"> {r.T_low:,.0f}"
      rel = f"> {r.T_low / base:.3f}" if base else "-"
    else:
      inf = (f"{r.inflation.value:.2f} [{r.inflation.low:.2f}, {r.inflation.high:.2f}]"
             + (" extrapolated" if r.inflation.extrapolated else ""))
      t = f"{r.T:,.0f} [{r.T_low:,.0f}, {r.T_high:,.0f}]"
      rel = f"{r.T / base:.3f} [{r.T_low / base:.3f}, {r.T_high / base:.3f}]" if base else "-"
    lines.append(f"| {i} | {c.method} | {c.bytes_per_token:,.1f} | {schedule_label(c)} | {c.microbatches} | "
                 f"{c.tied or '-'} | {c.step_s:.4g} | {share} | {inf} | {t} | {rel} |")
  sources = {r.choice.method: r.inflation.source for r in rows if r.inflation is not None}
  lines += ["", "Inflation from: " + "; ".join(f"{m}: {s}" for m, s in sources.items())]
  return "\n".join(lines)


def command(c: Choice, model: str, stages: int, batch: int, seq: int, size=(None, None, None)) -> str:
  """The training command of a choice (experiments.gpt2_wikitext, from a jaxcomp checkout); for a custom
  `--model protocol` at `size` (width, depth, vocab), which the experiment has no flag for, Python that builds its
  pipeline and executor."""
  if model == registry.CUSTOM:
    m = methods.get(c.method)
    return "\n".join([
        "import jaxcomp",
        "from jaxcomp.models import registry",
        "from jaxcomp.parallel import schedules",
        f"_, model = registry.get({model!r}, {', '.join(map(repr, size))})  # the planned model",
        f"boundary = jaxcomp.parse_boundary({m.fwd!r}, {m.bwd!r})",
        f"built = registry.model_stages(model, {stages}, {m.bottleneck!r}, boundary)",
        f"pipe = jaxcomp.Pipeline(built.stages, boundary, jaxcomp.losses.language_model, 'tokens', "
        f"microbatches={c.microbatches}, tied=built.tied + built.added_ties)",
        f"executor = jaxcomp.ShardedExecutor(jaxcomp.make_mesh({stages}), "
        f"schedule=schedules.parse({c.schedule!r}, overlap={c.overlap}))",
        f"# train: jaxcomp.fit(pipe, optimizer, executor, data, cfg, rng), {batch} x {seq} tokens a step "
        "(docs/guide/own_model.md)"])
  flags = [f"--model {model}", f"--stages {stages}", f"--batch-size {batch}", f"--block-size {seq}",
           f"--microbatches {c.microbatches}", "--executor sharded", f"--schedule {c.schedule}",
           *(["--overlap"] if c.overlap else []), *(["--untie-embeddings"] if c.tied == "untied" else []),
           *([f"--tied-compression {TIED_COMPRESSED}"] if c.tied == TIED_COMPRESSED else [])]
  m = methods.get(c.method).flags()
  return "python -m experiments.gpt2_wikitext " + " ".join(flags + [f"{k} {v}" for k, v in zip(m[::2], m[1::2])])


def plot(ranked: dict[Link, list[Row]], path: pathlib.Path, title: str) -> pathlib.Path:
  """T against bytes per token, one panel a link (log axes), each method labelled, its range as an error bar."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker
  fig, axes = plt.subplots(1, len(ranked), figsize=(5.5 * len(ranked), 4.2), squeeze=False)
  for ax, (link, rows) in zip(axes[0], ranked.items()):
    for r in rows:
      if r.T is None or math.isinf(r.T_high):
        continue
      ax.errorbar([r.choice.bytes_per_token], [r.T], yerr=[[r.T - r.T_low], [r.T_high - r.T]], fmt="o", capsize=3)
      ax.annotate(r.choice.method, (r.choice.bytes_per_token, r.T), fontsize=7, xytext=(3, 3),
                  textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):  # plain numbers at the decades only: minor labels overlap
      axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
      axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_title(str(link), fontsize=9)
    ax.set_xlabel("bytes per token over a boundary (both ways)")
    ax.set_ylabel("predicted T to target (s)")
    ax.grid(True, which="both", alpha=0.3)
  fig.suptitle(textwrap.fill(title, 80 * len(ranked)), fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def model_builder(cfg, stages: int, examples: int):
  """build(method, microbatches) -> the registry model's Pipeline with the method's boundary and model change
  (None where the change does not apply to it)."""
  def build(method: methods.Method, m: int):
    boundary = parse_boundary(method.fwd, method.bwd, num_examples=examples)
    try:
      built = registry.model_stages(cfg, stages, method.bottleneck, boundary)
    except registry.BottleneckError:
      return None
    return pipeline.Pipeline(built.stages, boundary, losses.language_model, "tokens", m,
                             tied=built.tied + built.added_ties)
  return build


def pipeline_builder(pipe: pipeline.Pipeline):
  """build(method, microbatches) for a pipeline the user built: its stages with the method's boundary (a method
  that changes the model does not apply)."""
  def build(method: methods.Method, m: int):
    if method.changes_model:
      return None
    boundary = parse_boundary(method.fwd, method.bwd, num_examples=max(pipe.microbatches, 1) * 1024)
    return dataclasses.replace(pipe, boundary=boundary, microbatches=m)
  return build


def for_pipeline(pipe: pipeline.Pipeline, batch, links, names=DEFAULT_METHODS, dense_steps: int = DENSE_STEPS,
                 width: int | None = None, clock=None, schedule_names=("gpipe", "1f1b"), microbatches=None,
                 table: dict | None = None, meter: str = "per_direction") -> dict[Link, list[Row]]:
  """The plan of a pipeline the user built (its stages, each method's boundary; methods that change the model
  left out), for `batch` (one replica's), on `links`: per link the ranked rows (`rank`). `width` is the model's
  (for the inflation's projection; default the first boundary's last axis); `clock` default `Measured(3)`."""
  width = width or pipeline.activation_shapes(pipe, batch)[0].shape[-1]
  names = [n for n in dict.fromkeys([methods.DENSE, *names]) if not methods.get(n).changes_model]
  planner = Planner(pipeline_builder(pipe), batch, clock or step_cost.Measured(3), pipe.num_stages, meter)
  micro = microbatches or microbatch_choices(pipe.num_stages, jax.tree.leaves(batch)[0].shape[0])
  choices = planner.search(names, micro, schedule_names, ("dense", "untied"), links)
  return rank(choices, table or step_table.load(), dense_steps, width, meter, pipe.num_stages)


def link_arg(text: str) -> list[Link]:
  try:
    return [Link.parse(part) for part in text.split(",") if part.strip()]
  except ValueError as err:
    raise argparse.ArgumentTypeError(str(err)) from None


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
  """Each option's default in its help, unless it has none or its help already says it."""

  def _get_help_string(self, action):
    if action.default is None or "default" in (action.help or ""):
      return action.help
    return super()._get_help_string(action)


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m jaxcomp.plan", description=__doc__.splitlines()[0],
                              formatter_class=DefaultsHelp)
  p.add_argument("--model", default="protocol-203m", help=f"one of {', '.join([*registry.MODELS, registry.CUSTOM])} "
                 "(protocol: the benchmark's architecture at --width/--depth/--vocab)")
  p.add_argument("--width", type=int, help="--model protocol: the width")
  p.add_argument("--depth", type=int, help="--model protocol: the blocks")
  p.add_argument("--vocab", type=int, help="--model protocol: the vocabulary (default GPT-2's padded 50,304)")
  p.add_argument("--seq", type=int, help="tokens per example (default: the model's)")
  p.add_argument("--batch", type=int, help="examples per step over all replicas (default: the model's)")
  p.add_argument("--stages", type=int, default=8, help="pipeline stages (devices per replica)")
  p.add_argument("--data-parallel", type=int, default=1, help="replicas")
  p.add_argument("--link", type=link_arg, action="extend", help="BW:LAT, e.g. 200mbit:50ms; comma-separated or "
                 "repeated for several (default: 200mbit:50ms)")
  p.add_argument("--meter", choices=typing.get_args(netsim.Meter), default="per_direction",
                 help="netsim's link model: per_direction, a link of BW each way between neighbouring stages (your "
                 "own network; ideal: a real one measured up to 39%% slower, docs/guide/plan.md); inbound, Protocol "
                 "NanoGPT's receiver meter (its benchmark)")
  p.add_argument("--device", default="cpu", help="a compile-only target (e.g. h100-8, v5e-8: compute from compiled "
                 "programs, estimated) or cpu (measured on this machine)")
  p.add_argument("--dense-steps", type=int, default=DENSE_STEPS, help="fp32's steps to the target at your scale")
  p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"any of {', '.join(methods.METHODS)}")
  p.add_argument("--schedules", default=",".join(DEFAULT_SCHEDULES), help="each searched with and without "
                 "overlapped sends")
  p.add_argument("--microbatches", help="comma-separated counts to search (default: S, 2S, 4S, 8S that divide the "
                 "batch per replica)")
  p.add_argument("--regime", choices=step_table.REGIMES, default="scratch", help="which inflation measurements")
  p.add_argument("--steps-from", help="your own ladder (experiments.ladder --out folder or its ladder.json) "
                 "instead of the shipped table")
  p.add_argument("--repeats", type=int, default=5, help="--device cpu: timed runs per op")
  p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("plan"), help="where plan.md/.json/.png go")
  p.add_argument("--estimates", type=pathlib.Path, help="a compile-only --device: the file keeping each compiled "
                 "program's estimate, so a later run compiles only programs it has not seen (default: "
                 "OUT/estimates.json)")
  return p


def main(argv=None):
  args = parser().parse_args(argv)
  start = time.perf_counter()
  links = args.link or [Link.parse("200mbit:50ms")]
  try:
    spec, cfg = registry.get(args.model, args.width, args.depth, args.vocab)
  except ValueError as err:
    raise ValueError(f"--model {args.model}: {err}") from None
  seq, batch = args.seq or spec.seq, args.batch or spec.batch
  if args.stages < 1 or args.stages > cfg.n_layer:
    raise ValueError(f"--stages {args.stages}: --model {args.model} has {cfg.n_layer} blocks; give 1..{cfg.n_layer}")
  if args.data_parallel < 1 or batch % args.data_parallel:
    raise ValueError(f"--data-parallel {args.data_parallel}: must be >= 1 and divide --batch {batch}")
  if args.dense_steps < 1:
    raise ValueError(f"--dense-steps {args.dense_steps}: give fp32's steps to your target (>= 1, e.g. 2925)")
  names = [n.strip() for n in args.methods.split(",") if n.strip()]
  for n in names:
    try:
      methods.get(n)
    except ValueError as err:
      raise ValueError(f"--methods: {err}") from None
  names = list(dict.fromkeys([methods.DENSE, *names]))
  table = step_table.load(args.steps_from, args.regime)
  per_shard = batch // args.data_parallel
  given = [int(m) for m in args.microbatches.split(",")] if args.microbatches else None
  micro = microbatch_choices(args.stages, per_shard, given)
  schedule_names = [s.strip() for s in args.schedules.split(",") if s.strip()]
  for s in schedule_names:
    try:
      schedules.parse(s)
    except ValueError as err:
      raise ValueError(f"--schedules: {err}") from None
  if args.device == "cpu":
    clock = step_cost.Measured(args.repeats)
  else:
    try:
      target = targets.target(args.device)
    except ValueError as err:
      raise ValueError(f"--device {args.device}: {err}, or cpu (measured here)") from None
    if target.devices < args.stages * args.data_parallel:
      raise ValueError(f"--device {args.device} has {target.devices} chips; --stages {args.stages} x "
                       f"--data-parallel {args.data_parallel} need {args.stages * args.data_parallel}")
    targets.prepare_host(target)
    try:
      clock = step_cost.Estimated(target, args.estimates or args.out / "estimates.json")
    except RuntimeError as err:  # the target's compiler is not installed
      raise ValueError(f"--device {args.device}: {err}") from None
  planner = Planner(model_builder(cfg, args.stages, batch), {"tokens": jnp.zeros((per_shard, seq), jnp.int32)},
                    clock, cfg.n_layer, args.meter, args.data_parallel)
  tied = ("dense", "untied", TIED_COMPRESSED)
  def progress(i, n, name):
    compiled = f", {clock.compiled} programs compiled" if isinstance(clock, step_cost.Estimated) else ""
    print(f"[plan] method {i}/{n}: {name} ({time.perf_counter() - start:.0f} s{compiled})", file=sys.stderr,
          flush=True)
  ranked = rank(planner.search(names, micro, schedule_names, tied, links, progress), table, args.dense_steps,
                cfg.n_embd, args.meter, args.stages)
  elapsed = time.perf_counter() - start
  title = (f"{args.model} ({registry.num_params(cfg) / 1e6:,.0f} M parameters, width {cfg.n_embd}), {args.stages} "
           f"stages x {args.data_parallel} replicas, {batch} x {seq} tokens a step, meter {args.meter}; compute "
           f"{clock.source}; T = {args.dense_steps:,} dense steps x inflation x step")
  text = [f"# Plan: {title}", "", f"Step inflation: {step_table.provenance(table)}", ""]
  for link, rows in ranked.items():
    winner = next((r for r in rows if r.T is not None and not math.isinf(r.T_high)), rows[0])
    text += [f"## {link}", "", render(link, rows), "", "Winner: " + winner.choice.method + " — train it with:", "",
             *("    " + line for line in command(winner.choice, args.model, args.stages, batch, seq,
                                                (args.width, args.depth, args.vocab)).splitlines()), ""]
  for reason, which in planner.skipped.items():
    text += [f"Left out ({reason}): {', '.join(dict.fromkeys(which))}", ""]
  text.append(f"Searched {len(names)} methods x {len(micro)} microbatch counts x {len(schedule_names)} schedules x "
              f"2 (overlapped sends) on {len(links)} link(s) in {elapsed:.0f} s"
              + (f", {clock.compiled} programs compiled (the others' estimates from {clock.store})."
                 if isinstance(clock, step_cost.Estimated) else "."))
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "plan.md").write_text("\n".join(text) + "\n")
  (args.out / "plan.json").write_text(json.dumps({
      "title": title, "links": {str(link): [{**r.choice._asdict(), "link": str(link), "inflation": r.inflation and
                                            r.inflation._asdict(), "T": r.T, "T_low": r.T_low, "T_high": r.T_high}
                                           for r in rows] for link, rows in ranked.items()}}, indent=1, default=str))
  png = plot(ranked, args.out / "plan.png", title)
  print("\n".join(text))
  print(f"wrote {args.out / 'plan.md'}, {args.out / 'plan.json'} and {png}")
  return ranked


if __name__ == "__main__":
  try:
    main()
  except ValueError as err:
    sys.exit(f"error: {err}")
