"""Training throughput vs link bandwidth (AQ-SGD Table 2), from stage and codec costs and netsim.

`python -m benchmarks.throughput_vs_bandwidth [--model tiny|small|medium|large|xl] [--stages 4]
    [--schedule gpipe,1f1b,1f1b-fused,zb-h1,interleaved:V] [--overlap [off|on|both]] [--data-parallel 2]
    [--dp-scheme ef+quant:4] [--methods fp32,aqsgd-fw3-bw6,...] [--compile-for v5e-8]`

For every method (its name in the frontier / GPT-2 presets), and again with QuantizedAdam's data-parallel exchange:
1. a clock gives the method's `StageCosts` (seconds per microbatch: each stage's forward and backward, each
   boundary's encode and decode of both messages), labelled with where they come from: `Measured` times them on
   this machine's default device; `Estimated` (`--compile-for TARGET`) compiles each op for the target's chip and
   takes its roofline time (FLOPs / peak vs HBM traffic / bandwidth, `dryrun.compile_op`): an estimate;
2. bytes per message come from the boundary's `wire_bytes`, the data-parallel exchange of each stage from
   `dataparallel.exchange_bytes` (fp32 gradients: dense ring all-reduce; QuantizedAdam: all-gather of the
   compressed first moment, `--dp-scheme`);
3. `jaxcomp.analysis.netsim` simulates one step at each bandwidth on each `--schedule` as the sharded executor
   runs its table (`ticks=True`): without `--overlap` each tick computes, then sends, then waits; with it
   (`on`, or `both` for each schedule with and without) a message crosses during the next tick (the table of
   forwarding delay 2, M >= 2S; every schedule has one). The stage and codec times are taken once and reused for
   every schedule:
   `zb-h1` splits each backward into B = W = half of it (codecs included: netsim's `input_grad_share` 0.5);
   `interleaved:V` cuts each stage into V chunks of 1/V of its compute, each of the S*V-1 chunk boundaries
   sending the stage boundaries' message (every boundary must carry the same shape, as GPT-2's residual stream
   does) with their codec times.
`x fp32` is over fp32 with the dense exchange at the same bandwidth; the critical path's shares (compute / link
/ exchange) say which term dominates the step. AQ-SGD rows are its steady state (after the
dense warm-up epoch), QuantizedAdam's after its dense warm-up. The paper's column holds its reported figures
(`experiments.paper.AQSGD_THROUGHPUT`: another model and cluster), not results of this run.
"""
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

import jaxcomp
from benchmarks.common import gpt2_config, gpt2_parser, median_seconds, select
from experiments import frontier, gpt2_wikitext, paper
from jaxcomp import pipeline
from jaxcomp.analysis import dryrun, netsim, targets
from jaxcomp.compress import spec
from jaxcomp.models import gpt2
from jaxcomp.parallel import dataparallel, schedules, timetable

# The stateless quantizer of the frontier table (docs/frontier.md) with the fewest bytes among those that learn
# (192 B/token, eval loss 2.617 vs fp32's 2.576).
BEST_QUANTIZER = "tile64-fw3-bw4"
METHODS = ("fp32", "aqsgd-fw3-bw6", "aqsgd-fw2-bw4", "top10-reuse", "top10-q8-reuse", BEST_QUANTIZER)
QADAM = " + QuantizedAdam"


def method_specs() -> dict[str, tuple[str, str]]:
  """(forward, backward) spec of every named method: the GPT-2 presets and the frontier's (but its learned
  bottlenecks, which change the model, not only what the boundary sends)."""
  presets = {name: (p["fwd"], p["bwd"]) for name, p in gpt2_wikitext.PRESETS.items() if "fwd" in p}
  return {**presets, **{name: (fwd, bwd) for name, (fwd, bwd, _, *learned) in frontier.METHODS.items()
                        if not learned}}


class StageCosts(NamedTuple):
  """One method's seconds per microbatch, and where they come from (`source`, printed with every table).

  fwd_s[s], bwd_s[s]: stage s's forward, and its backward as the executor runs it (the vjp with the forward
  recomputed, `StageRunner.stage_grads`), codecs excluded. encode_s[b], decode_s[b]: boundary b's codec as
  (forward message, backward message); stage b encodes the forward message and decodes the backward one,
  stage b+1 the other way round.
  """
  source: str
  fwd_s: tuple[float, ...]
  bwd_s: tuple[float, ...]
  encode_s: tuple[tuple[float, float], ...]
  decode_s: tuple[tuple[float, float], ...]


CostSource = Callable[[jaxcomp.Boundary], StageCosts]  # one method's boundary -> its costs


def op_seconds(costs: StageCosts) -> tuple[list[float], list[float]]:
  """Each stage's forward and backward op with the codec work it does (netsim's fwd_s, bwd_s)."""
  last = len(costs.fwd_s) - 1
  fwd = [t + (costs.decode_s[s - 1][0] if s > 0 else 0.0) + (costs.encode_s[s][0] if s < last else 0.0)
         for s, t in enumerate(costs.fwd_s)]
  bwd = [t + (costs.decode_s[s][1] if s < last else 0.0) + (costs.encode_s[s - 1][1] if s > 0 else 0.0)
         for s, t in enumerate(costs.bwd_s)]
  return fwd, bwd


class Measured:
  """Times ops by running them on this process's default device (the median of `repeats` synchronised runs)."""

  def __init__(self, repeats: int):
    self.repeats = repeats
    self.source = f"measured on {jax.devices()[0].device_kind}"

  def input(self, shape: jax.ShapeDtypeStruct):
    return jax.random.normal(jax.random.key(2), shape.shape, shape.dtype)

  def output(self, fn, *args):
    return jax.jit(fn)(*args)

  def seconds(self, fn, *args) -> float:
    return median_seconds(jax.jit(fn), *args, repeats=self.repeats)


class Estimated:
  """Estimates ops from their programs compiled for `target` (one chip; nothing runs): the roofline
  max(FLOPs / the chip's peak, HBM traffic / its bandwidth) of `dryrun.compile_op`. Ops whose lowered programs
  are equal (stages of the same shape) are compiled once."""

  def __init__(self, target: targets.Target):
    self.target, self.devices, self.known = target, targets.compile_only_devices(target), {}
    self.source = f"estimated for {target.chip.name} from programs compiled for {target.name} (roofline, not run)"

  def input(self, shape: jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(shape.shape, shape.dtype)

  def output(self, fn, *args):
    return jax.eval_shape(fn, *args)

  def seconds(self, fn, *args) -> float:
    program = jax.jit(fn).trace(*args).lower().as_text()
    if program not in self.known:
      step = dryrun.compile_op(self.target, "op", fn, *args, devices=self.devices)
      self.known[program] = step.estimated_s(self.target.chip)
    return self.known[program]


Clock = Measured | Estimated


def stage_times(pipe, state, microbatch, clock: Clock):
  """(forward seconds, backward seconds) of each stage on one microbatch; the backward is the vjp with the
  forward recomputed, as the executor's explicit backward runs it."""
  fwd_s, bwd_s = [], []
  x = microbatch[pipe.input_key]
  rng = jax.random.key(0)
  for stage, params, ms in zip(pipe.stages, state.params, state.model_state):
    forward = lambda p, x, stage=stage, ms=ms: stage.apply(p, ms, x, train=True, rng=rng)[0]
    y = clock.output(forward, params, x)
    diff_x = jnp.issubdtype(x.dtype, jnp.floating)

    def backward(p, x, g, forward=forward, diff_x=diff_x):
      if diff_x:
        return jax.vjp(forward, p, x)[1](g)
      return jax.vjp(lambda p: forward(p, x), p)[1](g)

    fwd_s.append(clock.seconds(forward, params, x))
    bwd_s.append(clock.seconds(backward, params, x, clock.input(y)))
    x = y
  return fwd_s, bwd_s


def scheme_seconds(scheme, x, clock: Clock):
  """(encode seconds, decode seconds, payload) of one message of `x` through `scheme` (its state rows for x's
  rows: AQ-SGD's buffer arithmetic is included)."""
  rows = lambda init: clock.output(lambda: jax.tree.map(lambda a: a[: x.shape[0]],
                                                        init(x.shape[0], x.shape[1:], x.dtype)))
  send = lambda x, state, key: scheme.send(x, state, key)
  sender, receiver, key = rows(scheme.init_sender), rows(scheme.init_receiver), jax.random.key(0)
  payload = clock.output(send, x, sender, key)[0]
  return clock.seconds(send, x, sender, key), clock.seconds(scheme.receive, payload, receiver), payload


def codec_seconds(boundary, shape, clock: Clock):
  """((encode forward, encode backward), (decode forward, decode backward)) seconds of one message each way
  (index reuse: the gather of the gradient at the forward's positions and its scatter)."""
  x = clock.input(shape)
  enc_f, dec_f, payload = scheme_seconds(boundary.fwd, x, clock)
  if boundary.reuse:
    topk = boundary.fwd.codec
    idx = clock.output(topk.where, payload)
    enc_b = clock.seconds(topk.values_at, x, idx)
    dec_b = clock.seconds(topk.scatter, clock.output(topk.values_at, x, idx), idx)
  else:
    enc_b, dec_b, _ = scheme_seconds(boundary.bwd, x, clock)
  return (enc_f, enc_b), (dec_f, dec_b)


def stage_costs(pipe, batch, clock: Clock) -> CostSource:
  """Stage and codec times of one microbatch of `batch` from `clock` (stage times once, codec times per method
  and boundary shape)."""
  state = clock.output(lambda: pipeline.init_state(pipe, optax.sgd(0.0), jax.random.key(1), batch))
  microbatch = jax.tree.map(lambda a: a[0], pipeline.split_microbatches(batch, pipe.microbatches))
  fwd_s, bwd_s = stage_times(pipe, state, microbatch, clock)
  shapes = pipeline.boundary_shapes(pipe, state.params, state.model_state, microbatch[pipe.input_key])

  def costs(boundary):
    by_shape = {}
    for s in shapes:
      if (s.shape, s.dtype) not in by_shape:
        by_shape[s.shape, s.dtype] = codec_seconds(boundary, s, clock)
    encode, decode = zip(*(by_shape[s.shape, s.dtype] for s in shapes))
    return StageCosts(clock.source, tuple(fwd_s), tuple(bwd_s), tuple(encode), tuple(decode))
  return costs


def exchange(scheme, rows, replicas) -> netsim.Exchange:
  """Each stage device's data-parallel exchange of its [P] row, as `dataparallel.exchange_bytes` counts it:
  dense (scheme None) a ring all-reduce, 2(D-1) messages; compressed an all-gather, D-1 messages."""
  dense = scheme is None
  sent = [dataparallel.exchange_bytes(scheme, p, 1, replicas, dense) / replicas for p in rows]
  return netsim.Exchange(sent, (2 if dense else 1) * (replicas - 1))


class Row(NamedTuple):
  bandwidth_bps: float
  method: str
  samples_per_s: float
  critical: dict  # seconds of the step's critical path in compute, link, exchange


def render(rows: list[Row], baseline: str = "fp32") -> str:
  """`bandwidth | method | samples/s | x fp32 | critical path | AQ-SGD paper`, bandwidth-major; the critical
  path's shares of the step say which term dominates it."""
  base = {r.bandwidth_bps: r.samples_per_s for r in rows if r.method == baseline}
  lines = [f"| bandwidth | method | samples/s | x {baseline} | critical path % compute / link / exchange "
           "| AQ-SGD paper (Table 2) |", "|---|---|---:|---:|---:|---|"]
  for r in sorted(rows, key=lambda r: -r.bandwidth_bps):
    reported = paper.AQSGD_THROUGHPUT.get((r.method, r.bandwidth_bps), "")
    shares = " / ".join(f"{100 * t / sum(r.critical.values()):.0f}" for t in r.critical.values())
    lines.append(f"| {netsim.format_bandwidth(r.bandwidth_bps)} | {r.method} | {r.samples_per_s:.2f} "
                 f"| {r.samples_per_s / base[r.bandwidth_bps]:.2f} | {shares} | {reported} |")
  return "\n".join(lines)


def on_chunks(costs: StageCosts, per_message, chunks_per_device: int):
  """(costs, bytes per message) of the S*V chunks of an interleaved table: each stage's forward and backward cut
  into V chunks of 1/V of its time, each of the S*V-1 chunk boundaries with boundary 0's codec times and bytes
  (every boundary carries the same shape: checked by `main`). V = 1: as they are."""
  if chunks_per_device == 1:
    return costs, per_message
  cut = lambda times: tuple(t / chunks_per_device for t in times for _ in range(chunks_per_device))
  n = len(costs.fwd_s) * chunks_per_device - 1
  return (costs._replace(fwd_s=cut(costs.fwd_s), bwd_s=cut(costs.bwd_s), encode_s=(costs.encode_s[0],) * n,
                         decode_s=(costs.decode_s[0],) * n), [per_message[0]] * n)


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
  return table.name + (" with overlapped sends" if table.forwarding_delay > 1 else "")


def method_rows(name, costs, per_message, exchanges, args, table) -> list[Row]:
  """netsim's samples/s of one method on `table`, run as the executor runs it, at every bandwidth, with each
  data-parallel exchange."""
  costs, per_message = on_chunks(costs, per_message, table.chunks_per_device)
  fwd_s, bwd_s = op_seconds(costs)
  rows = []
  for suffix, ex in exchanges.items():
    for bw in netsim.DEFAULT_BANDWIDTHS_BPS:
      tl = netsim.simulate_step(fwd_s, bwd_s, [m[0] for m in per_message], [m[1] for m in per_message],
                                args.microbatches, bw, args.latency_ms * 1e-3, ex, table,
                                overlap_sends=table.forwarding_delay > 1, ticks=True)
      rows.append(Row(bw, name + suffix, netsim.throughput(args.batch * args.data_parallel, tl),
                      tl.critical_seconds()))
  return rows


def render_schedules(results: dict[str, list[Row]], baseline: str = "fp32") -> str:
  """`schedule | bandwidth | each method's samples/s (x baseline on that schedule)`: one row per schedule and
  bandwidth."""
  methods = list(dict.fromkeys(r.method for rows in results.values() for r in rows))
  lines = ["| schedule | bandwidth | " + " | ".join(f"{m} samples/s" for m in methods) + " |",
           "|---|---|" + "---:|" * len(methods)]
  for name, rows in results.items():
    rate = {(r.bandwidth_bps, r.method): r.samples_per_s for r in rows}
    for bw in sorted({r.bandwidth_bps for r in rows}, reverse=True):
      cells = [f"{rate[bw, m]:.2f}" + ("" if m == baseline else f" ({rate[bw, m] / rate[bw, baseline]:.2f}x)")
               for m in methods]
      lines.append(f"| {name} | {netsim.format_bandwidth(bw)} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


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
  parser.add_argument("--latency-ms", type=float, default=1.0)
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
  except ValueError as err:
    parser.error(str(err))
  tokens = jax.random.randint(jax.random.key(0), (args.batch, args.seq), 0, cfg.vocab_size)
  batch = {"tokens": tokens, "id": jnp.arange(args.batch)}
  base = jaxcomp.Pipeline(stages, spec.parse_boundary("none", "none"), jaxcomp.losses.language_model,
                          "tokens", args.microbatches)
  abstract = jax.eval_shape(lambda: pipeline.init_state(base, optax.sgd(0.0), jax.random.key(1), batch))
  microbatch = jax.tree.map(lambda a: a[0], pipeline.split_microbatches(batch, args.microbatches))
  shapes = pipeline.boundary_shapes(base, abstract.params, abstract.model_state, microbatch["tokens"])
  if any(t.num_chunks > t.num_devices for t in runs) and len({(s.shape, s.dtype) for s in shapes}) > 1:
    parser.error(f"interleaved schedules send each stage boundary's message on every chunk boundary; the stage "
                 f"boundaries of this model differ ({shapes}): drop interleaved:V")
  rows_p = [sum(a.size for a in jax.tree.leaves(p)) for p in abstract.params]
  exchanges = {"": exchange(None, rows_p, args.data_parallel)}
  if args.data_parallel > 1:  # one replica exchanges nothing: QuantizedAdam's rows would repeat fp32's
    exchanges[QADAM] = exchange(dp_scheme, rows_p, args.data_parallel)
  costs_of = stage_costs(base, batch, Estimated(target) if target else Measured(args.repeats))

  results, cost_lines, costs = {label(t): [] for t in runs}, [], {}
  for name, (fwd_text, bwd_text) in methods.items():
    boundary = spec.parse_boundary(fwd_text, bwd_text, num_examples=args.batch)
    costs[name] = c = costs_of(boundary)
    per_message = [boundary.wire_bytes(s.shape, s.dtype) for s in shapes]
    cost_lines.append(f"| {name} | `{fwd_text}` | `{bwd_text}` | {per_message[0][0]:,} | {per_message[0][1]:,} | "
                      + " | ".join(f"{t * 1e3:.4g}" for t in (*c.encode_s[0], *c.decode_s[0])) + " |")
    for table in runs:
      results[label(table)] += method_rows(name, c, per_message, exchanges, args, table)

  source = costs["fp32"].source
  print(f"GPT-2 {args.model}, {args.stages} stages, schedule {', '.join(results)}, {args.microbatches} microbatches of "
        f"{list(shapes[0].shape)} activations, {args.data_parallel} data-parallel replicas "
        f"(QuantizedAdam: `{args.dp_scheme}`), {args.latency_ms} ms latency")
  print(f"\nStage and codec times ({source}), ms per microbatch:")
  print("stage forward:", [float(f"{t * 1e3:.4g}") for t in costs["fp32"].fwd_s],
        "stage backward:", [float(f"{t * 1e3:.4g}") for t in costs["fp32"].bwd_s])
  print("\n| method | fwd | bwd | fwd bytes/message | bwd bytes/message | encode fwd ms | encode bwd ms "
        "| decode fwd ms | decode bwd ms |")
  print("|---|---|---|---:|---:|---:|---:|---:|---:|")
  print("\n".join(cost_lines))
  print("\nData-parallel bytes sent per stage device and step:", "; ".join(
      f"{suffix.removeprefix(' + ') or 'dense'} {[round(b) for b in ex.sent_bytes]}" for suffix, ex in exchanges.items()))
  for line in left_out:
    print(f"\nNo overlapped table for {line}")
  if len(results) == 1:
    print(f"\nTraining throughput, samples/s ({source}; netsim, {', '.join(results)}):\n")
    print(render(*results.values()))
  else:
    print(f"\nTraining throughput, samples/s, and x fp32 on the same schedule ({source}; netsim, each schedule's "
          "table run as the executor runs it):\n")
    print(render_schedules(results))


if __name__ == "__main__":
  main()
