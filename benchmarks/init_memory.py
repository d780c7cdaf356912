"""Train-state bytes per device at init: GPipe's sharded init vs the whole model on one device.

`ShardedExecutor.init_state` creates the state already sharded: device s initialises only stage s's
rows (parameters, model state, optimizer state) in one jitted program with out_shardings.
`jaxcomp.init_state` (what `simulate` uses, and what GPipe used before) builds the whole
model and optimizer state on one device.

Toy GPT-2 (8 blocks, d=64), measured: each stage device's bytes of the sharded state
(`addressable_shards` after `ex.init_state`), the runtime's peak bytes per device where
`Device.memory_stats()` reports one (CPU does not), and the whole-model init jitted on one
device (`compiled.memory_analysis()`: output + temp bytes, i.e. its peak allocation).
GPT-2 small/medium/large, projected from shapes alone (`jax.eval_shape`, nothing allocated):
stage rows are padded to the largest stage, so a stage device holds
row bytes x (1 parameter + 2 Adam moments), vs every parameter and Adam moment on one device
(and vs the old GPipe init's device 0, which also held the S stacked rows: a lower bound).
The toy row of the projection is checked against the measured sharded bytes.
Run with fake CPU devices: XLA_FLAGS=--xla_force_host_platform_device_count=8.
"""
import argparse
import collections
import functools

import jax
import numpy as np
import optax

import jaxcomp
from jaxcomp.models import gpt2
from jaxcomp.parallel import executors, padded_rows

MiB = 2**20


def gpt2_case(cfg: gpt2.GPT2Config, stages: int, examples: int, seq: int, fwd: str, bwd: str):
  """(pipeline, batch): GPT-2 `cfg` in `stages` stages, one microbatch per stage."""
  boundary = jaxcomp.parse_boundary(fwd, bwd, num_examples=examples)
  pipe = jaxcomp.Pipeline(gpt2.gpt2_stages(cfg, stages), boundary, jaxcomp.losses.language_model, "tokens",
                          stages, tied=gpt2.gpt2_tied(stages))
  tokens = jax.random.randint(jax.random.key(0), (examples, seq), 0, cfg.vocab_size)
  return pipe, {"tokens": tokens, "id": jax.numpy.arange(examples)}


def tree_bytes(tree) -> int:
  """Bytes of every leaf (arrays or ShapeDtypeStructs)."""
  return sum(int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def bytes_per_device(tree) -> dict:
  """{device: bytes of the shards it holds} over every array in `tree`."""
  out = collections.Counter()
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      out[shard.device] += shard.data.nbytes
  return out


def projection(pipe, optimizer, batch) -> dict:
  """From shapes only: the whole simulate-layout state vs one stage device's Adam rows."""
  whole = jax.eval_shape(lambda b: jaxcomp.init_state(pipe, optimizer, jax.random.key(0), b), batch)
  params = padded_rows.FlatRows(whole.params)
  row = params.size * np.dtype(params.dtype).itemsize
  whole_bytes = tree_bytes(whole.params) + tree_bytes(whole.opt_state)
  return {"params": sum(params.sizes), "row": row, "stage": 3 * row, "whole": whole_bytes,
          "old_gpipe": whole_bytes + pipe.num_stages * 3 * row}


def measure_toy(pipe, optimizer, batch) -> dict:
  """Per-device bytes of GPipe's sharded state, runtime peaks if reported, whole-model init's peak."""
  ex = executors.make_executor(executors.ShardedConfig(stages=pipe.num_stages))
  state = jax.block_until_ready(ex.init_state(pipe, optimizer, jax.random.key(1), batch))
  per_device = bytes_per_device(state)
  peaks = [d.memory_stats() for d in ex.mesh.devices.flat]
  peak = [s.get("peak_bytes_in_use") for s in peaks] if all(peaks) else None
  whole_init = jax.jit(functools.partial(jaxcomp.init_state, pipe, optimizer))
  memory = whole_init.lower(jax.random.key(1), batch).compile().memory_analysis()
  return {"sharded": [per_device[d] for d in ex.mesh.devices.flat], "peak": peak,
          "whole_out": memory.output_size_in_bytes, "whole_temp": memory.temp_size_in_bytes}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--stages", type=int, default=4)
  parser.add_argument("--models", default="small,medium,large", help="comma-separated GPT-2 sizes to project")
  parser.add_argument("--seq", type=int, default=32, help="sequence length (toy model and projection)")
  parser.add_argument("--fwd", default="quant:4")
  parser.add_argument("--bwd", default="quant:8")
  args = parser.parse_args(argv)
  sizes = {"small": gpt2.GPT2Config.small, "medium": gpt2.GPT2Config.medium, "large": gpt2.GPT2Config.large}
  unknown = [m for m in args.models.split(",") if m not in sizes]
  if unknown:
    raise SystemExit(f"error: unknown --models {unknown}; choose from {list(sizes)}")
  optimizer = optax.adamw(1e-3)
  s, examples = args.stages, 2 * args.stages
  print(f"{s} stages, optax.adamw, fp32 parameters, fwd {args.fwd} / bwd {args.bwd}, "
        f"{jax.devices()[0].platform} ({len(jax.devices())} devices)\n")

  toy_cfg = gpt2.GPT2Config.tiny(n_layer=8, n_positions=args.seq, dropout=0.0)
  toy_pipe, toy_batch = gpt2_case(toy_cfg, s, examples, args.seq, args.fwd, args.bwd)
  toy = measure_toy(toy_pipe, optimizer, toy_batch)
  toy_proj = projection(toy_pipe, optimizer, toy_batch)
  whole_peak = toy["whole_out"] + toy["whole_temp"]
  print("Toy GPT-2 (8 blocks, d=64), measured. sharded: bytes of the GPipe state each stage device holds "
        "after `ex.init_state` (sum of its addressable shards; parameter, model-state, optimizer rows, "
        "compression state, step and key); whole-model init: `jaxcomp.init_state` jitted on one device, "
        "`memory_analysis()` output + temp.")
  if toy["peak"] is None:
    print(f"`Device.memory_stats()` is None on {jax.devices()[0].platform}: no runtime peak per device "
          "is reported here. The sharded column is the state that stays on each device, not the sharded init "
          "program's temporaries (its compiled program is internal to `ShardedExecutor.init_state`).\n")
  else:
    print(f"runtime peak bytes per stage device (`memory_stats()`): {toy['peak']}\n")
  print("| stage device | sharded state KiB | projected 3 x row KiB | whole-model init output + temp KiB "
        "(one device) | sharded / whole |")
  print("|---:|---:|---:|---:|---:|")
  for d, b in enumerate(toy["sharded"]):
    print(f"| {d} | {b / 1024:.1f} | {toy_proj['stage'] / 1024:.1f} | {whole_peak / 1024:.1f} "
          f"({toy['whole_out'] / 1024:.1f} + {toy['whole_temp'] / 1024:.1f}) | {b / whole_peak:.3f} |")

  print(f"\nProjection from `jax.eval_shape` (seq {args.seq}, nothing allocated): per stage device "
        "= largest stage's padded fp32 row x 3 (parameters, Adam mu, nu); before: every parameter and "
        "Adam moment on one device; old GPipe init: that plus the S stacked rows on device 0 (a lower "
        "bound). Activations, compression state and temporaries not counted; parameters count the tied "
        "embedding's head copy.\n")
  print("| model | parameters | padded row MiB | per stage device MiB | whole model + Adam on one device MiB "
        "| old GPipe init, device 0 MiB | per device / whole |")
  print("|---|---:|---:|---:|---:|---:|---:|")
  rows = [("toy (8 blocks, d=64)", toy_proj)]
  for name in args.models.split(","):
    pipe, batch = gpt2_case(sizes[name](dropout=0.0), s, examples, args.seq, args.fwd, args.bwd)
    rows.append((f"GPT-2 {name}", projection(pipe, optimizer, batch)))
  for name, p in rows:
    print(f"| {name} | {p['params'] / 1e6:.2f} M | {p['row'] / MiB:.1f} | {p['stage'] / MiB:.1f} "
          f"| {p['whole'] / MiB:.1f} | {p['old_gpipe'] / MiB:.1f} | {p['stage'] / p['whole']:.3f} |", flush=True)


if __name__ == "__main__":
  main()
