"""Bytes on the wire, measured from real payloads and from the compiled pipeline program.

`python -m benchmarks.wire_bytes` prints two tables:
1. every codec and scheme on one [128, 1024] fp32 tensor: bytes of the encoded payload
   (the arrays that travel) and the ratio to fp32;
2. a 4-stage toy GPT-2 pipeline: bytes per training step summed over every
   collective-permute in the compiled GPipe program (forward and backward), beside the
   codecs' `wire_bytes` prediction, for fp32 / fw4-bw8 / fw2-bw4 / Top10% with index reuse;
3. the same pipeline on 2 data replicas: bytes per step of the data-parallel exchange (every
   all-gather in the compiled program) for compressed gradients and QuantizedAdam momentum.
"""
import argparse
import math

import jax
import jax.numpy as jnp
import optax

import jaxcomp
from benchmarks.common import use_fake_cpu_devices
from jaxcomp.analysis import dryrun
from jaxcomp.compress import codecs, spec
from jaxcomp.parallel import executors
from jaxcomp.parallel.qadam import QuantizedAdam

SCHEME_SPECS = ["none", "bf16", "fp16", "quant:2", "quant:4", "quant:8", "maxabs:2", "maxabs:4",
                "maxabs:4:tensor", "topk:0.5", "topk:0.1", "topk:0.02", "randk:0.1", "ef+topk:0.1",
                "ef21+topk:0.1", "efmixed+topk:0.1", "aqsgd+maxabs:2"]
DATA_PARALLEL_CONFIGS = {"QuantizedAdam momentum, fp32": (QuantizedAdam(1e-3), "none"),
                         "QuantizedAdam momentum, ef+quant:4": (QuantizedAdam(1e-3), "ef+quant:4"),
                         "QuantizedAdam momentum, ef+quant:2": (QuantizedAdam(1e-3), "ef+quant:2"),
                         "SGD gradients, ef+quant:4": (optax.sgd(0.1), "ef+quant:4")}
PIPELINE_CONFIGS = {"fp32": ("none", "none"), "fw4-bw8": ("quant:4", "quant:8"),
                    "fw2-bw4": ("quant:2", "quant:4"), "Top10% (reuse)": ("topk:0.1", "reuse")}


def codec_table(shape=(128, 1024)) -> str:
  """Markdown table of measured payload bytes for every spec on one fp32 tensor."""
  x = jax.random.normal(jax.random.key(0), shape)
  dense = x.size * 4
  lines = ["| spec | payload arrays | bytes | / fp32 |", "|---|---|---:|---:|"]
  for text in SCHEME_SPECS:
    scheme = spec.parse_scheme(text, num_examples=shape[0])
    state = scheme.init_sender(shape[0], shape[1:], x.dtype)
    if scheme.keyed_by_example:
      state = jax.tree.map(lambda t: t[: shape[0]], state)
    payload, _ = scheme.send(x, state, jax.random.key(1))
    measured = codecs.nbytes(payload)
    assert measured == scheme.wire_bytes(shape, x.dtype), text
    arrays = ", ".join(f"{k} {a.dtype}{list(a.shape)}" for p in jax.tree.leaves(
        payload, is_leaf=lambda p: isinstance(p, codecs.Payload)) for k, a in p.parts().items())
    lines.append(f"| `{text}` | {arrays} | {measured:,} | {measured / dense:.4f} |")
  return "\n".join(lines)


def _toy_gpt2(batch, seq, microbatches, fwd="none", bwd="none"):
  """(pipeline, batch, config) of the 4-stage toy GPT-2."""
  from jaxcomp.models import gpt2

  cfg = gpt2.GPT2Config.tiny()
  tokens = jax.random.randint(jax.random.key(0), (batch, seq), 0, cfg.vocab_size)
  pipe = jaxcomp.Pipeline(gpt2.gpt2_stages(cfg, 4), spec.parse_boundary(fwd, bwd), jaxcomp.losses.language_model,
                          "tokens", microbatches)
  return pipe, {"tokens": tokens, "id": jnp.arange(batch)}, cfg


def pipeline_table(batch=8, seq=64, microbatches=2) -> str:
  """Markdown table of bytes per step read from the compiled GPipe program's HLO."""
  opt = optax.sgd(0.1)
  ex = executors.make_executor(executors.ShardedConfig(stages=4))
  lines = ["| config | fwd bytes/step | bwd bytes/step | predicted (fwd, bwd) | total / fp32 |",
           "|---|---:|---:|---:|---:|"]
  dense_total = None
  for name, (fwd, bwd) in PIPELINE_CONFIGS.items():
    pipe, data, cfg = _toy_gpt2(batch, seq, microbatches, fwd, bwd)
    state = ex.init_state(pipe, opt, jax.random.key(1), data)
    sent = dryrun.collective_bytes(ex, pipe, opt, state, data)
    predicted = jaxcomp.boundary_bytes(pipe, data, jaxcomp.init_state(pipe, opt, jax.random.key(1), data))
    total = sent["fwd"] + sent["bwd"]
    dense_total = dense_total or total
    lines.append(f"| {name} | {sent['fwd']:,} | {sent['bwd']:,} | {predicted['fwd']:,}, {predicted['bwd']:,} "
                 f"| {total / dense_total:.4f} |")
  shape = (batch // microbatches, seq, cfg.n_embd)
  return (f"4 stages, {microbatches} microbatches of activations {list(shape)} fp32, 3 boundaries\n\n"
          + "\n".join(lines))


def data_parallel_table(batch=8, seq=64, microbatches=2) -> str:
  """Markdown table of the data-parallel exchange's bytes per step (all-gathers in the HLO)."""
  pipe, data, _ = _toy_gpt2(batch, seq, microbatches)
  lines = ["| exchange | all-gather bytes/step | predicted | / fp32 momentum |", "|---|---:|---:|---:|"]
  dense = None
  for name, (opt, scheme) in DATA_PARALLEL_CONFIGS.items():
    ex = executors.make_executor(executors.ShardedConfig(stages=4, data_parallel=2,
                                                         grad_scheme=spec.parse_scheme(scheme)))
    state = ex.init_state(pipe, opt, jax.random.key(1), data)
    sent = dryrun.collective_bytes(ex, pipe, opt, state, data)["data"]
    dense = dense or sent  # the first row
    lines.append(f"| {name} | {sent:,} | {ex.wire_bytes_per_step(pipe, data)['data']:,} | {sent / dense:.4f} |")
  return (f"4 stages x 2 data replicas, one fp32 row of {state.params.shape[1]:,} parameters per stage; "
          "warm-up steps all-reduce dense gradients instead\n\n" + "\n".join(lines))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--skip-pipeline", action="store_true", help="only the codec table")
  parser.add_argument("--shape", default="128,1024", help="the codec table's tensor")
  args = parser.parse_args(argv)
  shape = tuple(int(d) for d in args.shape.split(","))
  print(f"## Payload bytes of one {list(shape)} fp32 tensor (fp32: {4 * math.prod(shape):,} bytes)\n")
  print(codec_table(shape))
  if not args.skip_pipeline:
    print("\n## Bytes per training step of a 4-stage toy GPT-2 (GPipe, from the compiled HLO)\n")
    print(pipeline_table())
    print("\n## Data-parallel exchange of the same pipeline on 2 replicas (GPipe, from the compiled HLO)\n")
    print(data_parallel_table())


if __name__ == "__main__":
  use_fake_cpu_devices(8)  # the 4 x 2 mesh of the data-parallel table, on a machine without accelerators
  main()
