"""Every codec compiled for GPU and TPU targets at the papers' shapes: sorts, passes over memory, roofline time.

`python -m benchmarks.codec_compiled [--targets h100,v5e-1] [--topk-only] [--out runs/codec_compiled]`

Per target (one process each: a TPU and a GPU compiler are set up differently), for each message shape (GPT-2
small's 1024 x 768 fp32 per example, and Protocol NanoGPT's 1024 x 1024 bf16, 8 examples), each spec's encode
and decode (TopK's index reuse also its backward's `values_at` and `scatter`) compiled alone
(`jaxcomp.analysis.codec_cost`): its sorts (a sort of the row: >= 4,096 entries along the sorted axis), passes
(HBM traffic of the compiled program / logical bytes: inputs read once, outputs written once; XLA's own count
beside it where the backend gives one), peak memory and roofline time at the chip's published HBM bandwidth,
against the compiled forward + backward of the pipeline stage the message leaves (GPT-2 small in 4 stages, the
protocol model in 8: their second stage, roofline of its compiled programs). A sort is counted as one read and
one write of its operands, which is less than any sort moves: a row sort is flagged, never priced by its passes.
Estimates of compiled programs, nothing run. Results go to OUT/TARGET.json after each cell; a rerun skips what is
there (an interrupted target resumes). `--topk-only`: the TopK variants alone.
"""
import argparse
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp

from jaxcomp import methods, plan
from jaxcomp.analysis import codec_cost, step_cost, targets
from jaxcomp.compress.spec import parse_codec
from jaxcomp.models import registry

SHAPES = {"gpt2-small": ((8, 1024, 768), "float32", "small", 4), "protocol": ((8, 1024, 1024), "bfloat16",
                                                                              "protocol-203m", 8)}
TOPK = [f"topk:0.1:{values}:{select}" for select in ("threshold", "sort", "approx") for values in ("q8", "bf16")]
FAMILIES = ["bf16", "fp8:scaled", "fp8:scaled:channel", "quant:4", "maxabs:4", "maxabs:4:group=64",
            "maxabs:4:group=64:scales=both",
            "maxabs:3:group=64:scales=both", "maxabs:3:group=64:scales=both:clip=1:grid=zero", "adaptive:3:4:0.25",
            "hadamard+maxabs:4:group=64:stoch"]
TARGETS = ("h100", "l4", "v5e-1", "v6e-1")
GOALS = "goals: TopK with no row sort and <= 3 passes; every codec <= 2 passes; codec <= 5% of its stage's compute"


def reuse_of(spec: str) -> bool:
  return spec.startswith("topk:") and spec.endswith(":threshold")  # the reuse ops do not select: once per format


def stage_seconds(target, model: str, stages: int, examples: int, tokens: int) -> float:
  """Roofline seconds of the second stage's forward + backward (the vjp with the forward recomputed) on one
  microbatch of `examples` x `tokens`, compiled for `target`."""
  _, cfg = registry.get(model)
  pipe = plan.model_builder(cfg, stages, examples)(methods.get(methods.DENSE), 1)
  batch = {"tokens": jnp.zeros((examples, tokens), jnp.int32), "id": jnp.arange(examples)}
  costs = step_cost.stage_costs(pipe, batch, step_cost.Estimated(target))(pipe.boundary)
  return costs.fwd_s[1] + costs.bwd_s[1]


def measure_target(name: str, out: pathlib.Path, shapes, specs):
  """This process compiles for target `name` and writes OUT/NAME.json after every cell."""
  target = targets.target(name)
  targets.prepare_host(target)  # before any backend starts
  devices = targets.compile_only_devices(target)
  path = out / f"{name}.json"
  done = json.loads(path.read_text()) if path.exists() else {"target": target.describe(), "cells": {}, "stage": {}}
  for shape_name in shapes:
    shape, dtype, model, stages = SHAPES[shape_name]
    if shape_name not in done["stage"]:
      done["stage"][shape_name] = stage_seconds(target, model, stages, *shape[:2])
      path.write_text(json.dumps(done, indent=1))
    for spec in specs:
      key = f"{shape_name} {spec}"
      if key in done["cells"]:
        continue
      try:
        ops = codec_cost.codec_costs(target, parse_codec(spec), shape, dtype, reuse_of(spec), devices)
        done["cells"][key] = [{**o._asdict(), "passes": o.passes} for o in ops]
      except jax.errors.JaxRuntimeError as err:  # a compiler's refusal (e.g. out of VMEM) is a result of its own
        done["cells"][key] = {"error": " ".join(str(err).split())[:300]}
      path.write_text(json.dumps(done, indent=1))
      print(f"[{name}] {key}", file=sys.stderr, flush=True)


def full_table(results: dict) -> str:
  """Every op of every cell, per target."""
  lines = []
  for done in results.values():
    lines += [f"### {done['target']}", "", "| shape | spec | op | row sorts (sorts) | passes | XLA's count / logical "
              "| peak MiB | roofline us | % of stage |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for key, ops in done["cells"].items():
      shape_name, spec = key.split(" ", 1)
      if isinstance(ops, dict):
        lines.append(f"| {shape_name} | {spec} | - | - | - | - | - | - | refused: {ops['error'][:120]} |")
        continue
      stage = done["stage"][shape_name]
      for o in ops:
        xla = f"{o['xla_bytes'] / o['logical_bytes']:.2f}" if o["xla_bytes"] else "-"
        lines.append(f"| {shape_name} | {spec} | {o['op']} | {o['row_sorts']} ({o['sorts']}) | {o['passes']:.2f} "
                     f"| {xla} | {o['peak_bytes'] / 2**20:.0f} | {1e6 * o['roofline_s']:.0f} "
                     f"| {100 * o['roofline_s'] / stage:.2f} |")
    lines += ["", "stage forward + backward (roofline): " + ", ".join(
        f"{k} {1e3 * v:.2f} ms" for k, v in done["stage"].items()), ""]
  return "\n".join(lines)


def cell_text(done: dict, shape_name: str, spec: str, ops=("encode", "decode")) -> str:
  """'P passes, R row sorts, T us = X% of the stage' of a cell's ops together (passes: of their logical bytes)."""
  cell = done["cells"].get(f"{shape_name} {spec}")
  if cell is None:
    return "-"
  if isinstance(cell, dict):
    return "refused"
  picked = [o for o in cell if o["op"] in ops]
  traffic, logical = sum(o["traffic_bytes"] for o in picked), sum(o["logical_bytes"] for o in picked)
  seconds, sorts = sum(o["roofline_s"] for o in picked), sum(o["row_sorts"] for o in picked)
  loop = sum(o.get("loop_bytes", 0) for o in picked) / logical
  return (f"{traffic / logical:.1f}{f' ({loop:.1f}/trip)' if loop else ''}{' +' + str(sorts) + ' sort' if sorts else ''}"
          f", {1e6 * seconds:.0f} us ({100 * seconds / done['stage'][shape_name]:.1f}%)")


def summary(results: dict) -> str:
  """Two tables: the TopK variants on every target, every codec family on the targets that compiled them. A cell:
  encode + decode's passes (+ row sorts), roofline time and its share of the stage's forward + backward."""
  names = list(results)
  shapes = list(SHAPES)
  head = lambda first: ("| " + first + " | " + " | ".join(f"{n} {s}" for n in names for s in shapes) + " |\n|---|"
                        + "---:|" * (len(names) * len(shapes)))
  lines = [GOALS, "", "Each cell: passes over memory of encode + decode (compiled traffic / logical bytes, a data-dependent "
           "loop counted once, (L/trip): what each further trip of it adds; + row sorts: each moves more than its one "
           "counted pass), their roofline time, and its share of the stage's compiled "
           "forward + backward (GPT-2 small 4 stages, protocol-203m 8 stages; 8 x 1,024 tokens).", "",
           head("TopK 10%")]
  for spec in TOPK:
    lines.append(f"| `{spec}` | " + " | ".join(cell_text(results[n], s, spec) for n in names for s in shapes) + " |")
  for fmt in ("q8", "bf16"):
    spec = f"topk:0.1:{fmt}:threshold"
    lines.append(f"| index reuse backward ({fmt} values_at + scatter) | " + " | ".join(
        cell_text(results[n], s, spec, ("values_at", "scatter")) for n in names for s in shapes) + " |")
  with_families = [n for n in names if any(k.split(" ", 1)[1] in FAMILIES for k in results[n]["cells"])]
  if with_families:
    names = with_families
    lines += ["", head("codec")]
    lines += [f"| `{spec}` | " + " | ".join(cell_text(results[n], s, spec) for n in names for s in shapes) + " |"
              for spec in FAMILIES]
  lines += ["", "Stage forward + backward (roofline of its compiled programs): " + "; ".join(
      f"{n} " + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in results[n]["stage"].items()) for n in results)]
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m benchmarks.codec_compiled", description=__doc__.splitlines()[0])
  parser.add_argument("--targets", default=",".join(TARGETS), help=f"compile-only targets (default {','.join(TARGETS)})")
  parser.add_argument("--out", default="runs/codec_compiled", help="one JSON per target; a rerun resumes")
  parser.add_argument("--topk-only", action="store_true", help="the TopK variants alone (both shapes)")
  parser.add_argument("--full", action="store_true", help="every op of every cell (default: the two summary tables)")
  parser.add_argument("--report", action="store_true", help="compile nothing: the tables of what OUT holds")
  parser.add_argument("--target", help=argparse.SUPPRESS)  # a child process: this one target
  args = parser.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  specs = TOPK if args.topk_only else TOPK + FAMILIES
  if args.target:
    return measure_target(args.target, out, list(SHAPES), specs)
  names = [t.strip() for t in args.targets.split(",") if t.strip()]
  try:
    [targets.target(name) for name in names]
  except ValueError as err:
    sys.exit(f"error: --targets: {err}")
  for name in [] if args.report else names:
    flags = ["--target", name, "--out", str(out), *(["--topk-only"] if args.topk_only else [])]
    done = subprocess.run([sys.executable, "-m", "benchmarks.codec_compiled", *flags])
    if done.returncode:
      sys.exit(f"error: compiling for {name} failed (exit {done.returncode}); the cells before it are in {out}")
  results = {n: json.loads((out / f"{n}.json").read_text()) for n in names}
  print(full_table(results) if args.full else summary(results))


if __name__ == "__main__":
  main()
