"""Training throughput vs link bandwidth (AQ-SGD Table 2), from stage and codec costs and netsim.

`python -m benchmarks.throughput_vs_bandwidth [--model tiny|small|medium|large|xl] [--stages 4]
    [--schedule gpipe,1f1b,1f1b-fused,zb-h1,interleaved:V] [--overlap [off|on|both]] [--data-parallel 2]
    [--dp-scheme ef+quant:4] [--tied-exchange dense,untied,ef+maxabs:4:group=64:scales=group]
    [--methods fp32,aqsgd-fw3-bw6,...] [--compile-for v5e-8] [--link 1gbit:20ms,100mbit:20ms | --latency-ms 1]`

For every method (its name in the frontier / GPT-2 presets), and again with QuantizedAdam's data-parallel exchange:
1. a clock gives the method's `StageCosts` (seconds per microbatch: each stage's forward and backward, each
   boundary's encode and decode of both messages), labelled with where they come from: `Measured` times them on
   this machine's default device; `Estimated` (`--compile-for TARGET`) compiles each op for the target's chip and
   takes its roofline time (FLOPs / peak vs HBM traffic / bandwidth, `dryrun.compile_op`): an estimate;
2. bytes per message come from the boundary's `wire_bytes`, the data-parallel exchange of each stage device from
   `dataparallel.exchange_bytes` of the row the executor sends, its stage's parameters padded to the longest
   stage's (`padded_rows.FlatRows`; `interleaved:V`: V rows of the S*V-chunk model's) (fp32 gradients: dense ring
   all-reduce; QuantizedAdam: all-gather of the compressed first moment, `--dp-scheme`); the tied exchange (GPT-2's
   embedding on device 0 and head on device S-1) from `StateLayout.tied_messages`, for each `--tied-exchange`:
   `dense` (fp32 both ways), `untied` (`--untie-embeddings`: none) or a scheme (`--tied-compression`; its encode
   and two decodes timed by the clock), after the data-parallel exchange (before it with QuantizedAdam);
3. `jaxcomp.analysis.netsim` simulates one step on each link (`--link`: rate and one-way latency; by default
   AQ-SGD's bandwidths, 10 Gbps to 100 Mbps, each with `--latency-ms`) on each `--schedule` as the sharded executor
   runs its table (`ticks=True`): without `--overlap` each tick computes, then sends, then waits; with it
   (`on`, or `both` for each schedule with and without) a message crosses during the next tick (the table of
   forwarding delay 2, M >= 2S; every schedule has one). The stage and codec times are taken once and reused for
   every schedule:
   `zb-h1` splits each backward into B = W = half of it (codecs included: netsim's `input_grad_share` 0.5);
   `interleaved:V` cuts each stage into V chunks of 1/V of its compute, each of the S*V-1 chunk boundaries
   sending the stage boundaries' message (every boundary must carry the same shape, as GPT-2's residual stream
   does) with their codec times.
`x fp32` is over fp32 with the dense exchange on the same link; the critical path's shares (compute / link /
exchange / tied) say which term dominates the step. AQ-SGD rows are its steady state (after the
dense warm-up epoch), QuantizedAdam's after its dense warm-up. The paper's column holds its reported figures
(`experiments.paper.AQSGD_THROUGHPUT`: another model and cluster), not results of this run.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

import jaxcomp
from benchmarks.common import gpt2_config, gpt2_parser, method_specs, select
from experiments import paper
from jaxcomp import pipeline
from jaxcomp.analysis import netsim, targets
from jaxcomp.analysis.step_cost import Estimated, Measured, op_seconds, stage_costs
from jaxcomp.analysis.step_inputs import TIED_CHOICES, exchange, on_chunks, tied_exchange
from jaxcomp.analysis.link import Link
from jaxcomp.compress import spec
from jaxcomp.models import gpt2
from jaxcomp.parallel import padded_rows, schedules, timetable

# The stateless quantizer of the frontier table (docs/results/frontier.md) with the fewest bytes among those within
# 0.03 of fp32 (193.5 B/token, eval loss 2.599 against fp32's 2.575).
BEST_QUANTIZER = "tile64-fw3-bw4"
METHODS = ("fp32", "aqsgd-fw3-bw6", "aqsgd-fw2-bw4", "top10-reuse", "top10-q8-reuse", BEST_QUANTIZER)
QADAM = " + QuantizedAdam"


def padded_row(cfg, num_stages: int, batch, microbatches: int) -> int:
  """The parameter row every stage device of GPT-2 cut into `num_stages` stages exchanges (`padded_rows.FlatRows`: each
  stage's parameters, padded to the longest stage's), traced abstractly."""
  pipe = jaxcomp.Pipeline(gpt2.gpt2_stages(cfg, num_stages), spec.parse_boundary("none", "none"),
                          jaxcomp.losses.language_model, "tokens", microbatches)
  return padded_rows.FlatRows(jax.eval_shape(lambda: pipeline.init_state(pipe, optax.sgd(0.0), jax.random.key(1),
                                                                     batch)).params).size


class Row(NamedTuple):
  link: Link
  method: str
  samples_per_s: float
  critical: dict  # seconds of the step's critical path in compute, link, exchange, tied exchange


CRITICAL = ("compute", "link", "exchange", "tied")


def link_label(link: Link) -> str:
  """'100 Mbps, 20 ms': the bandwidth and the one-way latency."""
  return f"{netsim.format_bandwidth(link.bandwidth_bps)}, {link.latency_s * 1e3:g} ms"


def by_link(link: Link):
  """Links in table order: fastest bandwidth first, then least latency."""
  return -link.bandwidth_bps, link.latency_s


def render(rows: list[Row], baseline: str = "fp32") -> str:
  """`link | method | samples/s | x fp32 | critical path | AQ-SGD paper`, link-major; the critical path's shares of
  the step say which term dominates it."""
  base = {r.link: r.samples_per_s for r in rows if r.method == baseline}
  lines = [f"| link | method | samples/s | x {baseline} | critical path % {' / '.join(CRITICAL)} "
           "| AQ-SGD paper (Table 2) |", "|---|---|---:|---:|---:|---|"]
  for r in sorted(rows, key=lambda r: by_link(r.link)):
    reported = paper.AQSGD_THROUGHPUT.get((r.method, r.link.bandwidth_bps), "")
    shares = " / ".join(f"{100 * t / sum(r.critical.values()):.0f}" for t in r.critical.values())
    lines.append(f"| {link_label(r.link)} | {r.method} | {r.samples_per_s:.2f} "
                 f"| {r.samples_per_s / base[r.link]:.2f} | {shares} | {reported} |")
  return "\n".join(lines)


def tables(names: str, overlap: str, stages: int, microbatches: int) -> tuple[list[timetable.Timetable], list[str]]:
  """The train tables of the comma-separated schedule `names` (`schedules.parse`), each without overlapped sends
  (`overlap` off or both) and with them (on or both). With both, a schedule that has no overlapped table is left
  out (the reasons returned); otherwise the ValueError names the bad value."""
  built, left_out = [], []
  wanted = [name.strip() for name in names.split(",") if name.strip()]
  if not wanted:
    raise ValueError(f"--schedule names no schedule: got {names!r}")
  for name in wanted:
    if overlap in ("off", "both"):
      built.append(schedules.parse(name).train_table(stages, microbatches))
    if overlap in ("on", "both"):
      try:
        built.append(schedules.parse(name, overlap=True).train_table(stages, microbatches))
      except ValueError as err:
        if overlap == "on":
          raise
        left_out.append(f"{name}: {err}")
  return built, left_out


def label(table: timetable.Timetable) -> str:
  return table.name + (" with overlapped sends" if table.overlapped_sends else "")


def method_rows(name, costs, per_message, exchanges, args, table) -> list[Row]:
  """netsim's samples/s of one method on `table`, run as the executor runs it, on every link, with each
  data-parallel exchange and its tied exchange (`exchanges`: suffix -> (exchange of each V, tied exchange))."""
  costs, per_message = on_chunks(costs, per_message, table.chunks_per_device)
  fwd_s, bwd_s = op_seconds(costs)
  rows = []
  for suffix, (ex, tied) in exchanges.items():
    for link in args.links:
      tl = netsim.simulate_step(fwd_s, bwd_s, [m[0] for m in per_message], [m[1] for m in per_message],
                                args.microbatches, link, 0.0, ex[table.chunks_per_device], table,
                                ticks=True, tied=tied)
      critical = tl.critical_seconds()
      rows.append(Row(link, name + suffix, netsim.throughput(args.batch * args.data_parallel, tl),
                      {k: critical.get(k, 0.0) for k in CRITICAL}))
  return rows


def render_schedules(results: dict[str, list[Row]], baseline: str = "fp32") -> str:
  """`schedule | link | each method's samples/s (x baseline on that schedule)`: one row per schedule and link."""
  methods = list(dict.fromkeys(r.method for rows in results.values() for r in rows))
  lines = ["| schedule | link | " + " | ".join(f"{m} samples/s" for m in methods) + " |",
           "|---|---|" + "---:|" * len(methods)]
  for name, rows in results.items():
    rate = {(r.link, r.method): r.samples_per_s for r in rows}
    for link in sorted({r.link for r in rows}, key=by_link):
      cells = [f"{rate[link, m]:.2f}" + ("" if m == baseline else f" ({rate[link, m] / rate[link, baseline]:.2f}x)")
               for m in methods]
      lines.append(f"| {name} | {link_label(link)} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def links_of(parser, args) -> list[Link]:
  """The links `--link` names, or AQ-SGD's bandwidths with `--latency-ms` (parser.error naming a bad value)."""
  if args.link is None:
    return [Link(bw, (1.0 if args.latency_ms is None else args.latency_ms) * 1e-3)
            for bw in netsim.DEFAULT_BANDWIDTHS_BPS]
  if args.latency_ms is not None:
    parser.error(f"--latency-ms {args.latency_ms:g} with --link {args.link}: give each link's latency in --link "
                 f"(e.g. 100mbit:{args.latency_ms:g}ms)")
  try:
    return [Link.parse(text.strip()) for text in args.link.split(",") if text.strip()]
  except ValueError as err:
    parser.error(f"--link: {err}")


def main(argv=None):
  parser = gpt2_parser(__doc__, microbatches=4, models=("tiny", "small", "medium", "large", "xl"), seq=None)
  parser.add_argument("--stages", type=int, default=4)
  parser.add_argument("--schedule", default="gpipe",
                      help="comma-separated schedules: gpipe, 1f1b, 1f1b-fused, zb-h1, interleaved:V (each from the "
                      "same stage and codec times)")
  parser.add_argument("--overlap", choices=("off", "on", "both"), nargs="?", const="on", default="off",
                      help="the executor's overlapped sends (--overlap alone: on; both: each schedule without and, "
                      "where it has an overlapped table, with)")
  parser.add_argument("--data-parallel", type=int, default=2, help="replicas of the pipeline (D)")
  parser.add_argument("--dp-scheme", default="ef+quant:4", help="QuantizedAdam's first-moment compression")
  parser.add_argument("--link", help="comma-separated links, each a rate as tc writes it and a one-way latency "
                      "(1gbit:20ms,100mbit:20ms; default: AQ-SGD's bandwidths 10gbit,1gbit,500mbit,300mbit,100mbit "
                      "with --latency-ms)")
  parser.add_argument("--latency-ms", type=float, help="the one-way latency of the default links (default 1; "
                      "with --link, give each link's latency there)")
  parser.add_argument("--tied-exchange", default="dense",
                      help="comma-separated: what the tied embedding and head exchange each step, a table each: dense "
                      "(fp32 both ways, the default run), untied (--untie-embeddings: nothing) or a data-parallel "
                      "gradient scheme (--tied-compression, e.g. ef+maxabs:4:group=64:scales=group)")
  parser.add_argument("--repeats", type=int, default=10, help="timed runs per op (measured costs)")
  parser.add_argument("--compile-for", metavar="TARGET",
                      help="estimate stage and codec times from their programs compiled for TARGET's chip (e.g. "
                      "v5e-8; nothing runs; --stages x --data-parallel must fit its chips) instead of measuring them "
                      "here; --seq then defaults to 1024")
  parser.add_argument("--methods", default=",".join(METHODS),
                      help="comma-separated method names (fp32, the baseline, is always run)")
  args = parser.parse_args(argv)
  methods = select(method_specs(), args.methods, "fp32")
  if args.data_parallel < 1:
    parser.error(f"--data-parallel must be >= 1, got {args.data_parallel}")
  if args.stages < 2:
    parser.error(f"--stages must be >= 2 (links join stages), got {args.stages}")
  args.links = links_of(parser, args)
  try:
    runs, left_out = tables(args.schedule, args.overlap, args.stages, args.microbatches)
  except ValueError as err:
    parser.error(f"--schedule {args.schedule} --overlap {args.overlap}: {err}")
  target = None
  if args.compile_for:
    try:
      target = targets.target(args.compile_for)
    except ValueError as err:
      parser.error(f"--compile-for: {err}")
    if args.stages * args.data_parallel > target.devices:
      parser.error(f"--stages {args.stages} x --data-parallel {args.data_parallel} needs "
                   f"{args.stages * args.data_parallel} chips; {target.name} has {target.devices}")
    targets.prepare_host(target)  # before any backend starts
  args.seq = args.seq or (1024 if target else 128)
  cfg = gpt2_config(args.model)
  try:
    stages = gpt2.gpt2_stages(cfg, args.stages)
    dp_scheme = spec.parse_scheme(args.dp_scheme)
    choices = [c.strip() for c in args.tied_exchange.split(",") if c.strip()]
    for choice in choices:
      if choice not in TIED_CHOICES:
        pipeline.check_tied_scheme(spec.parse_scheme(choice))
  except ValueError as err:
    parser.error(str(err))
  if not choices:
    parser.error(f"--tied-exchange names no choice: got {args.tied_exchange!r}")
  tokens = jax.random.randint(jax.random.key(0), (args.batch, args.seq), 0, cfg.vocab_size)
  batch = {"tokens": tokens, "id": jnp.arange(args.batch)}
  base = jaxcomp.Pipeline(stages, spec.parse_boundary("none", "none"), jaxcomp.losses.language_model,
                          "tokens", args.microbatches, tied=gpt2.gpt2_tied(args.stages))
  abstract = jax.eval_shape(lambda: pipeline.init_state(base, optax.sgd(0.0), jax.random.key(1), batch))
  microbatch = jax.tree.map(lambda a: a[0], pipeline.split_microbatches(batch, args.microbatches))
  shapes = pipeline.boundary_shapes(base, abstract.params, abstract.model_state, microbatch["tokens"])
  if any(t.num_chunks > t.num_devices for t in runs) and len({(s.shape, s.dtype) for s in shapes}) > 1:
    parser.error(f"interleaved schedules send each stage boundary's message on every chunk boundary; the stage "
                 f"boundaries of this model differ ({shapes}): drop interleaved:V")
  rows = {v: padded_row(cfg, args.stages * v, batch, args.microbatches) for v in {t.chunks_per_device for t in runs}}
  data_exchanges = {"": {v: exchange(None, p, args.stages, args.data_parallel, v) for v, p in rows.items()}}
  if args.data_parallel > 1:  # one replica exchanges nothing: QuantizedAdam's rows would repeat fp32's
    data_exchanges[QADAM] = {v: exchange(dp_scheme, p, args.stages, args.data_parallel, v) for v, p in rows.items()}
  clock = Estimated(target) if target else Measured(args.repeats)
  costs_of = stage_costs(base, batch, clock)
  # per --tied-exchange choice: (suffix -> (data-parallel exchange per V, tied exchange)); QuantizedAdam ties first
  ties = {choice: tied_exchange(choice, base, batch, clock) for choice in choices}
  exchanges = {choice: {suffix: (ex, tie and tie._replace(before_exchange=suffix == QADAM))
                        for suffix, ex in data_exchanges.items()} for choice, tie in ties.items()}

  results = {choice: {label(t): [] for t in runs} for choice in choices}
  cost_lines, costs = [], {}
  for name, (fwd_text, bwd_text) in methods.items():
    boundary = spec.parse_boundary(fwd_text, bwd_text, num_examples=args.batch)
    costs[name] = c = costs_of(boundary)
    per_message = [boundary.wire_bytes(s.shape, s.dtype) for s in shapes]
    cost_lines.append(f"| {name} | `{fwd_text}` | `{bwd_text}` | {per_message[0][0]:,} | {per_message[0][1]:,} | "
                      + " | ".join(f"{t * 1e3:.4g}" for t in (*c.encode_s[0], *c.decode_s[0])) + " |")
    for choice in choices:
      for table in runs:
        results[choice][label(table)] += method_rows(name, c, per_message, exchanges[choice], args, table)

  source = costs["fp32"].source
  print(f"GPT-2 {args.model}, {args.stages} stages, schedule {', '.join(map(label, runs))}, {args.microbatches} "
        f"microbatches of "
        f"{list(shapes[0].shape)} activations, {args.data_parallel} data-parallel replicas "
        f"(QuantizedAdam: `{args.dp_scheme}`), links {', '.join(map(str, args.links))}")
  print(f"\nStage and codec times ({source}), ms per microbatch:")
  print("stage forward:", [float(f"{t * 1e3:.4g}") for t in costs["fp32"].fwd_s],
        "stage backward:", [float(f"{t * 1e3:.4g}") for t in costs["fp32"].bwd_s])
  print("\n| method | fwd | bwd | fwd bytes/message | bwd bytes/message | encode fwd ms | encode bwd ms "
        "| decode fwd ms | decode bwd ms |")
  print("|---|---|---|---:|---:|---:|---:|---:|---:|")
  print("\n".join(cost_lines))
  print("\nData-parallel bytes sent per stage device and step (its padded row" + (", V rows with interleaved:V"
        if len(rows) > 1 else "") + "):", "; ".join(
      f"{suffix.removeprefix(' + ') or 'dense'} " + ", ".join(f"{round(e.sent_bytes[0]):,}" + (f" (V = {v})"
                                                             if len(rows) > 1 else "") for v, e in ex.items())
      for suffix, ex in data_exchanges.items()))
  for choice in choices:
    tie = exchanges[choice][""][1]
    print(f"Tied exchange {choice}: " + ("nothing sent (the head trains on its own)" if tie is None else "; ".join(
        f"devices {a} <-> {b}, {n:,} B each way per replica" + (f", codec {t * 1e3:.4g} ms" if t else "")
        for (a, b), n, t in zip(tie.ends, tie.sent_bytes, tie.compute_s))))
  for line in left_out:
    print(f"\nNo overlapped table for {line}")
  for choice in choices:
    heading = f", tied exchange {choice}"
    if len(runs) == 1:
      print(f"\nTraining throughput, samples/s ({source}; netsim, {', '.join(results[choice])}{heading}):\n")
      print(render(*results[choice].values()))
    else:
      print(f"\nTraining throughput, samples/s, and x fp32 on the same schedule ({source}; netsim, each schedule's "
            f"table run as the executor runs it{heading}):\n")
      print(render_schedules(results[choice]))


if __name__ == "__main__":
  main()
