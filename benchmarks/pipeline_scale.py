"""Pipeline runtime scaling: compile time, step time and temporary memory per device.

For each executor (simulate: the whole model on one device; gpipe / 1f1b / 1f1b-fused / zb-h1:
stage s on device s with that schedule),
stage count S and microbatch count M (fixed microbatch size, so the batch grows with M)
it compiles one train step of the toy GPT-2 (8 blocks, d=64), GPT-2 small (`--model gpt2-small`) or
the MLP, and prints one markdown table: lowering+compile seconds, the median step in ms (`--repeats 0`:
compiled, not run), and the compiled program's temporary and argument bytes per device
(`compiled.memory_analysis()`), with the stage device's temp as a fraction of simulate's at the same S
and M (or of the first executor's when simulate is not measured).
Run with fake CPU devices: XLA_FLAGS=--xla_force_host_platform_device_count=8.
"""
import argparse
import time

import jax
import optax

import jaxcomp
from jaxcomp.analysis.step_cost import median_seconds
from jaxcomp.compress.boundary import Mode
from jaxcomp.models import gpt2
from jaxcomp.models.mlp import mlp_stages
from jaxcomp.parallel import executors, schedules

MiB = 2**20


def make_case(model: str, stages: int, microbatches: int, mb_size: int, seq: int, fwd: str, bwd: str):
  """(pipeline, batch) with `microbatches` microbatches of `mb_size` examples."""
  n = microbatches * mb_size
  boundary = jaxcomp.parse_boundary(fwd, bwd, num_examples=n)
  if model in ("gpt2", "gpt2-small"):
    cfg = (gpt2.GPT2Config.tiny(n_layer=8, n_positions=seq, dropout=0.0) if model == "gpt2"
           else gpt2.GPT2Config.small(n_positions=seq, dropout=0.0))
    tokens = jax.random.randint(jax.random.key(0), (n, seq), 0, cfg.vocab_size)
    pipe = jaxcomp.Pipeline(gpt2.gpt2_stages(cfg, stages), boundary, jaxcomp.losses.language_model, "tokens",
                            microbatches, tied=gpt2.gpt2_tied(stages))
    return pipe, {"tokens": tokens, "id": jax.numpy.arange(n)}
  x = jax.random.normal(jax.random.key(0), (n, 64))
  pipe = jaxcomp.Pipeline(mlp_stages(64, 4, stages), boundary, jaxcomp.losses.classification, "x", microbatches)
  return pipe, {"x": x, "label": (x[:, 0] > 0).astype(jax.numpy.int32), "id": jax.numpy.arange(n)}


# --executors' rows: simulate, or the sharded executor on S stage devices running a schedule with `remat`
ROWS = {"simulate": lambda stages, remat: executors.SimulateConfig(),
        **{name: lambda stages, remat, name=name: executors.ShardedConfig(
            stages=stages, remat=remat, schedule=schedules.parse(name)) for name in schedules.SCHEDULES}}


def measure(row: str, pipe, batch, repeats: int, remat: str) -> dict:
  """Compile seconds, median step seconds (None for `repeats` 0: not run) and per-device temp/argument bytes
  of one train step on the executor of `row` (`ROWS`)."""
  opt = optax.sgd(1e-3)
  ex = executors.make_executor(ROWS[row](pipe.num_stages, remat))
  state = ex.init_state(pipe, opt, jax.random.key(1), batch)
  start = time.perf_counter()
  compiled = ex.trace_step(pipe, opt, Mode.TRAIN, state, batch).lower().compile()
  compile_s = time.perf_counter() - start
  memory = compiled.memory_analysis()
  holder = [state]

  def step():
    holder[0], metrics = compiled(holder[0], batch)
    return metrics

  return {"compile_s": compile_s, "step_s": median_seconds(step, repeats=repeats, warmup=1) if repeats else None,
          "temp": memory.temp_size_in_bytes, "args": memory.argument_size_in_bytes}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", choices=["gpt2", "gpt2-small", "mlp"], default="gpt2",
                      help="gpt2: the toy GPT-2 (8 blocks, d=64); gpt2-small: GPT-2 small (12 blocks, d=768)")
  parser.add_argument("--stages", default="2,4,8", help="comma-separated stage counts")
  parser.add_argument("--microbatches", default="2,4,8,16,32,64", help="comma-separated microbatch counts")
  parser.add_argument("--executors", default=",".join(("simulate", *schedules.SCHEDULES)),
                      help=f"comma-separated rows, the first the baseline: simulate and any of the schedules "
                           f"({', '.join(schedules.SCHEDULES)})")
  parser.add_argument("--mb-size", type=int, default=2, help="examples per microbatch")
  parser.add_argument("--seq", type=int, default=32, help="GPT-2 sequence length")
  parser.add_argument("--fwd", default="quant:4")
  parser.add_argument("--bwd", default="quant:8")
  parser.add_argument("--remat", choices=["stage", "none"], default="stage")
  parser.add_argument("--repeats", type=int, default=3, help="timed steps (0: compile only)")
  args = parser.parse_args(argv)
  stages = [int(s) for s in args.stages.split(",")]
  counts = [int(m) for m in args.microbatches.split(",")]
  rows = args.executors.split(",")
  print(f"{args.model}, {args.mb_size} examples per microbatch, fwd {args.fwd} / bwd {args.bwd}, "
        f"remat={args.remat}, {jax.devices()[0].platform} ({len(jax.devices())} devices)\n")
  base_name = rows[0]
  print(f"| S | M | executor | compile s | step ms | temp MiB / device | args MiB / device | temp / {base_name} |")
  print("|---:|---:|---|---:|---:|---:|---:|---:|")
  for s in stages:
    for m in counts:
      pipe, batch = make_case(args.model, s, m, args.mb_size, args.seq, args.fwd, args.bwd)
      base = None
      for name in rows:
        r = measure(name, pipe, batch, args.repeats, args.remat)
        base = r["temp"] if name == base_name else base
        ratio = f"{r['temp'] / base:.2f}" if base else "-"
        step_ms = "-" if r["step_s"] is None else f"{r['step_s'] * 1e3:.1f}"
        print(f"| {s} | {m} | {name} | {r['compile_s']:.1f} | {step_ms} | {r['temp'] / MiB:.2f} "
              f"| {r['args'] / MiB:.2f} | {ratio} |", flush=True)


if __name__ == "__main__":
  main()
