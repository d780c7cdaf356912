"""Protocol NanoGPT's records, reproduced: their step times predicted from compiled compute and the benchmark's meter.

    python -m benchmarks.protocol_records --compile-for h100-8           # the records and every frontier method
    python -m benchmarks.protocol_records --compile-for h100-8 --methods fp32,tile64-fw3-bw4

Protocol NanoGPT (PluralisResearch/ProtocolNanoGPT) scores T = steps to the target loss x steady-state step time,
the step metered at 200 Mbit/s plus 50 ms per message on one inbound wire per stage (netsim's `meter="inbound"`).
This predicts its records' step times (`experiments.paper.PROTOCOL_RECORDS`: dense bf16 and ReparamSSN) with
`experiments.time_to_target.StepTimes` on `--model protocol-203m` (`--recipe protocol`: 8 stages, 1F1B, 512 x 1024
tokens a step):
1. compute: each stage's forward and backward (the vjp with the forward recomputed) of one microbatch, compiled for
   `--compile-for`'s chip and timed by the roofline (`step_cost.Estimated`: max(FLOPs / peak, HBM
   traffic / bandwidth); nothing runs) once per microbatch size; stages whose programs are equal compile once;
2. a record's messages: its bytes per token (both ways) split evenly between the activation and its gradient, x the
   tokens of one of its microbatches (`--link` and the records' microbatch counts);
3. netsim runs the 1F1B table as the sharded executor runs it (ticks, no overlapped sends) on the inbound meter.
Printed: predicted vs published step time, the relative error, the critical path's compute and link seconds and
the inbound wire of a middle stage (2 M messages of 8 x bytes / rate + latency each).

Then every frontier method (`jaxcomp.methods`; a learned bottleneck is rank R of the 1,024-wide
stream) on the same setup at each record's microbatch count: its bytes per token from its boundary's `wire_bytes`
at the model's bf16 activations, its codecs timed by the same clock, and the step inflation at which it ties each
record: record T / (step time x the dense record's steps), its faster step time of the two.
"""
import argparse
import math
from typing import Callable, NamedTuple

import jax

from jaxcomp.analysis.step_cost import Estimated
from experiments import config, gpt2_wikitext, paper
from experiments.time_to_target import StepTimes
from jaxcomp import methods as registry
from jaxcomp.analysis import targets
from jaxcomp.analysis.link import Link
from jaxcomp.compress.spec import parse_boundary

DENSE_STEPS = paper.PROTOCOL_RECORDS["dense-bf16"]["steps"]  # tie inflation's step count: the dense record's


class Record(NamedTuple):
  """A published record: its name, bytes per token over a boundary (both ways), microbatches, step seconds, steps
  to the target and T = steps x step seconds."""
  name: str
  bytes_per_token: float
  microbatches: int
  step_s: float
  steps: int
  T: float


RECORDS = tuple(Record(name, r["bytes_per_token"], r["microbatches"], r["step_s"], r["steps"], r["T"])
                for name, r in paper.PROTOCOL_RECORDS.items())


def record_sent(record: Record, tokens_per_microbatch: int, boundaries: int) -> list[tuple[float, float]]:
  """Each boundary's (forward, backward) bytes per message of `record`: half its bytes per token each way."""
  half = tokens_per_microbatch * record.bytes_per_token / 2
  return [(half, half)] * boundaries


def tie_inflation(record: Record, step_s: float, steps: int = DENSE_STEPS) -> float:
  """The step inflation at which a method of `step_s` per step ties `record`: record.T / (step_s x steps)."""
  return record.T / (step_s * steps)


class Setup(NamedTuple):
  """Where the records are predicted: a run config per method and microbatch count, and the step-time source."""
  run_config: Callable[..., config.RunConfig]  # (fwd, bwd, bottleneck, microbatches) -> the run
  step_times: StepTimes


def protocol_setup(recipe: str, link: Link, clock, **flags) -> Setup:
  """`--recipe` (protocol: the benchmark's; protocol-cpu at toy size) with `flags`, netsim on 1F1B and the inbound
  meter at `link`, stage and codec times from `clock`."""
  def run_config(fwd, bwd, bottleneck, microbatches):
    return config.resolve(gpt2_wikitext.EXPERIMENT, recipe, fwd=fwd, bwd=bwd, bottleneck=bottleneck,
                          microbatches=microbatches, run_name="protocol-records", **flags)
  return Setup(run_config, StepTimes(link, "1f1b", meter="inbound", clock=clock))


def record_rows(setup: Setup, records=RECORDS) -> list[dict]:
  """Each record's predicted step (the dense model's compute, its bytes per token) against its published one."""
  rows = []
  for record in records:
    cfg = setup.run_config("none", "none", None, record.microbatches)
    pipe, _, batch, _ = gpt2_wikitext.abstract(cfg)
    tokens = batch["tokens"].size // record.microbatches
    sent = record_sent(record, tokens, pipe.num_stages - 1)
    tl = setup.step_times.timeline(cfg, parse_boundary("none", "none"), sent)
    wire = 2 * record.microbatches * (8 * sent[0][0] / setup.step_times.link.bandwidth_bps
                                      + setup.step_times.link.latency_s)
    rows.append({"record": record, "tokens_per_microbatch": tokens, "message_bytes": sent[0][0],
                 "step_s": tl.makespan, "error": tl.makespan / record.step_s - 1, "critical": tl.critical_seconds(),
                 "inbound_wire_s": wire})
  return rows


def method_rows(setup: Setup, methods: dict, records=RECORDS) -> list[dict]:
  """Each method's steady-state step at each record's microbatch count, its bytes per token (both ways, the first
  boundary's, at the first record's microbatches), and the inflation at which its faster step ties each record; a
  method one of whose programs the target's compiler refuses has its error (`refused`) instead."""
  rows = []
  for name, method in methods.items():
    fwd, bwd = method.fwd, method.bwd
    row = {"method": name, "fwd": fwd, "bwd": bwd, "bottleneck": method.bottleneck, "step_s": {}}
    try:
      for record in records:
        cfg = setup.run_config(fwd, bwd, row["bottleneck"], record.microbatches)
        pipe, _, batch, _ = gpt2_wikitext.abstract(cfg)
        sent = setup.step_times.sent(cfg)
        row.setdefault("bytes_per_token", sum(sent[0]) / (batch["tokens"].size // record.microbatches))
        row["step_s"][record.microbatches] = setup.step_times.timeline(cfg, sent=sent).makespan
    except jax.errors.JaxRuntimeError as err:  # the target's compiler refused one of its programs: said in its row
      rows.append({**row, "best_step_s": math.inf, "refused": str(err).splitlines()[0]})
      continue
    best = min(row["step_s"].values())
    rows.append({**row, "best_step_s": best, "tie": {r.name: tie_inflation(r, best) for r in records}})
  return rows


def render_records(rows: list[dict]) -> str:
  lines = ["| record | B/token | microbatches x tokens | bytes per message (each way) | predicted step s | "
           "published step s | error | critical path s compute / link | middle stage's inbound wire s |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    rec, crit = r["record"], r["critical"]
    lines.append(f"| {rec.name} | {rec.bytes_per_token:,.0f} | {rec.microbatches} x {r['tokens_per_microbatch']:,} | "
                 f"{r['message_bytes']:,.0f} | {r['step_s']:.3f} | {rec.step_s:.3f} | {100 * r['error']:+.1f}% | "
                 f"{crit['compute']:.2f} / {crit['link']:.2f} | {r['inbound_wire_s']:.2f} |")
  return "\n".join(lines)


def render_methods(rows: list[dict], records=RECORDS) -> str:
  heads = " | ".join(f"step s, {r.microbatches} microbatches" for r in records)
  ties = " | ".join(f"tie inflation vs {r.name} (T {r.T:,.0f} s)" for r in records)
  lines = [f"| method | fwd | bwd | B/token | {heads} | {ties} |", "|---|---|---|---:|" + "---:|" * 2 * len(records)]
  for r in sorted(rows, key=lambda r: r["best_step_s"]):
    fwd = f"`{r['bottleneck']}` then `{r['fwd']}`" if r["bottleneck"] else f"`{r['fwd']}`"
    if "refused" in r:
      lines.append(f"| {r['method']} | {fwd} | `{r['bwd']}` | not compiled for the target: {r['refused']} |"
                   + " |" * (2 * len(records)))
      continue
    steps = " | ".join(f"{r['step_s'][rec.microbatches]:.3f}" for rec in records)
    tie = " | ".join(f"{r['tie'][rec.name]:.2f}" for rec in records)
    lines.append(f"| {r['method']} | {fwd} | `{r['bwd']}` | {r['bytes_per_token']:,.1f} | {steps} | {tie} |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--compile-for", metavar="TARGET", default="h100-8",
                      help="estimate compute from programs compiled for TARGET's chip (the records: h100-8)")
  parser.add_argument("--link", default="200mbit:50ms", help="each stage's inbound wire: rate and per-message latency")
  parser.add_argument("--methods", default=",".join(registry.METHODS),
                      help="comma-separated frontier methods (default: all; 'none' for the records alone)")
  args = parser.parse_args(argv)
  try:
    target, link = targets.target(args.compile_for), Link.parse(args.link)
  except ValueError as err:
    parser.error(str(err))
  names = [] if args.methods == "none" else [n.strip() for n in args.methods.split(",") if n.strip()]
  unknown = [n for n in names if n not in registry.METHODS]
  if unknown:
    parser.error(f"--methods: unknown {unknown}; choose from {list(registry.METHODS)} or none")
  if target.devices < 8:
    parser.error(f"--compile-for {target.name}: the records' 8 stages need 8 chips, it has {target.devices}")
  targets.prepare_host(target)  # before any backend starts
  clock = Estimated(target)
  setup = protocol_setup("protocol", link, clock)
  print(f"Protocol NanoGPT's step: protocol-203m on 8 stages, 1F1B (ticks, as the sharded executor runs it), "
        f"512 x 1024 tokens, link {link} on netsim's inbound meter (one inbound wire per stage); compute "
        f"{clock.source}\n")
  print(render_records(record_rows(setup)), flush=True)
  print(f"\nerror = predicted / published - 1; middle stage's inbound wire = 2 x microbatches x (8 x bytes per "
        f"message / {link.bandwidth_bps:g} + {link.latency_s:g}) s. The ReparamSSN row takes the dense model's compute "
        "(its record widens the MLP to 11,292 and projects through its subspace; the ReparamSSN port, --bottleneck ssn, "
        "has both: python -m jaxcomp.plan --methods ssn times it).")
  if names:
    methods = {n: registry.METHODS[n] for n in names}
    print(f"\nFrontier methods on the same setup (bytes per token: the boundary's wire_bytes at [microbatch, 1024, "
          f"1024] bf16, both ways; a step's steady state); tie inflation = record T / (the faster step s x "
          f"{DENSE_STEPS:,}, the dense record's steps):\n")
    print(render_methods(method_rows(setup, methods)))


if __name__ == "__main__":
  main()
