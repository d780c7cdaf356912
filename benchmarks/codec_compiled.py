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

SHAPES = {"gpt2-small": ((8, 1024, 768), "float32", "small", 4), "protocol": ((8, 1024, 1024), "bfloat16",
                                                                              "protocol-203m", 8)}
TOPK = [f"topk:0.1:{values}:{select}" for select in ("threshold", "sort", "approx") for values in ("q8", "bf16")]
FAMILIES = ["bf16", "fp8:scaled", "fp8:scaled:channel", "quant:4", "maxabs:4", "maxabs:4:group=64:scales=both",
            "maxabs:3:group=64:scales=both", "adaptive:3:4:0.25", "hadamard+maxabs:4:group=64:stoch"]
TARGETS = ("h100", "l4", "v5e-1", "v6e-1")
GOALS = "goals: TopK with no row sort and <= 3 passes; every codec <= 2 passes; codec <= 5% of its stage's compute"


def reuse_of(spec: str) -> bool:
  return spec.startswith("topk:") and spec.endswith(":threshold")  # the reuse ops do not select: once per format


def stage_seconds(target, model: str, stages: int) -> float:
  """Roofline seconds of the second stage's forward + backward (the vjp with the forward recomputed) on one
  microbatch of 8 examples of 1,024 tokens, compiled for `target`."""
  import jax.numpy as jnp

  from jaxcomp import losses, pipeline
  from jaxcomp.analysis import step_cost
  from jaxcomp.compress.spec import parse_boundary
  from jaxcomp.models import registry
  _, cfg = registry.get(model)
  boundary = parse_boundary("none", "none")
  built = registry.model_stages(cfg, stages, None, boundary)
  pipe = pipeline.Pipeline(built.stages, boundary, losses.language_model, "tokens", 1, tied=built.tied)
  batch = {"tokens": jnp.zeros((8, 1024), jnp.int32), "id": jnp.arange(8)}
  clock = step_cost.Estimated(target)
  costs = step_cost.stage_costs(pipe, batch, clock)(boundary)
  return costs.fwd_s[1] + costs.bwd_s[1]


def measure_target(name: str, out: pathlib.Path, shapes, specs):
  """This process compiles for target `name` and writes OUT/NAME.json after every cell."""
  from jaxcomp.analysis import targets
  target = targets.target(name)
  targets.prepare_host(target)
  from jaxcomp.analysis import codec_cost
  from jaxcomp.compress import spec as specs_
  devices = targets.compile_only_devices(target)
  path = out / f"{name}.json"
  done = json.loads(path.read_text()) if path.exists() else {"target": target.describe(), "cells": {}, "stage": {}}
  for shape_name in shapes:
    shape, dtype, model, stages = SHAPES[shape_name]
    if shape_name not in done["stage"]:
      done["stage"][shape_name] = stage_seconds(target, model, stages)
      path.write_text(json.dumps(done, indent=1))
    for spec in specs:
      key = f"{shape_name} {spec}"
      if key in done["cells"]:
        continue
      try:
        ops = codec_cost.codec_costs(target, specs_.parse_codec(spec), shape, dtype, reuse_of(spec), devices)
        done["cells"][key] = [{**o._asdict(), "passes": o.passes} for o in ops]
      except Exception as err:  # a compiler's refusal (e.g. out of VMEM) is a result of its own
        done["cells"][key] = {"error": " ".join(str(err).split())[:300]}
      path.write_text(json.dumps(done, indent=1))
      print(f"[{name}] {key}", file=sys.stderr, flush=True)


def render(results: dict) -> str:
  lines = [GOALS, ""]
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


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m benchmarks.codec_compiled", description=__doc__.splitlines()[0])
  parser.add_argument("--targets", default=",".join(TARGETS), help=f"compile-only targets (default {','.join(TARGETS)})")
  parser.add_argument("--out", default="runs/codec_compiled", help="one JSON per target; a rerun resumes")
  parser.add_argument("--topk-only", action="store_true", help="the TopK variants alone (both shapes)")
  parser.add_argument("--target", help=argparse.SUPPRESS)  # a child process: this one target
  args = parser.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  specs = TOPK if args.topk_only else TOPK + FAMILIES
  if args.target:
    return measure_target(args.target, out, list(SHAPES), specs)
  from jaxcomp.analysis import targets
  names = [t.strip() for t in args.targets.split(",") if t.strip()]
  try:
    [targets.target(name) for name in names]
  except ValueError as err:
    sys.exit(f"error: --targets: {err}")
  for name in names:
    flags = ["--target", name, "--out", str(out), *(["--topk-only"] if args.topk_only else [])]
    done = subprocess.run([sys.executable, "-m", "benchmarks.codec_compiled", *flags])
    if done.returncode:
      sys.exit(f"error: compiling for {name} failed (exit {done.returncode}); the cells before it are in {out}")
  print(render({n: json.loads((out / f"{n}.json").read_text()) for n in names}))


if __name__ == "__main__":
  main()
