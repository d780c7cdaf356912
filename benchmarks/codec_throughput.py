"""Encode/decode throughput of every codec against the device's measured copy bandwidth.

`python -m benchmarks.codec_throughput [--shape 8,1024,768] [--dtype float32] [--repeats 20]`
Bandwidth of an op = (bytes it must read + bytes it must write) / time: encode reads the
activation and writes the payload; decode reads the payload and writes the tensor. The copy
bound is x + 1 over the same tensor (read + write). Ratios near 1 mean the codec runs at
memory speed. `reuse` is TopK 10%'s backward with index reuse: the gradient's values at the
forward's positions (`values_at`, a compaction by the forward's mask) and their way back (`scatter`, the mask's
expansion; the positions are not sent). Times
are per call of calls run back to back (`common.pipelined_seconds`).
"""
import argparse

import jax
import jax.numpy as jnp

from benchmarks.common import codec_seconds, copy_seconds

SPECS = ["bf16", "fp8:scaled", "fp8:scaled:channel", "quant:2", "quant:4", "quant:8", "maxabs:2",
         "maxabs:2:grid=zero:clip=1", "maxabs:3", "maxabs:4", "maxabs:4:stoch", "topk:0.1", "topk:0.1:sort",
         "topk:0.1:bf16", "topk:0.1:q8", "topk:0.01", "reuse"]  # maxabs:2 and :3 default to clip=mse: a 25-ratio search


def measure(shape, repeats, dtype="float32", specs=SPECS):
  """(copy bandwidth in bytes/s, rows of (spec, wire / dense, encode GB/s of the input, encode / copy bandwidth,
  decode GB/s of the output, decode / copy bandwidth))."""
  x = jax.random.normal(jax.random.key(0), shape, dtype)
  dense = x.size * x.dtype.itemsize
  copy_bw = 2 * dense / copy_seconds(x, repeats)
  rows = []
  for text in specs:
    t_enc, t_dec, wire = codec_seconds(text, x, repeats)
    enc_bw, dec_bw = (dense + wire) / t_enc, (wire + dense) / t_dec
    rows.append((text, wire / dense, dense / t_enc / 1e9, enc_bw / copy_bw, dense / t_dec / 1e9, dec_bw / copy_bw))
  return copy_bw, rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", default="8,128,768", help="activation shape (GPT-2 small: 8,1024,768)")
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--repeats", type=int, default=20)
  args = parser.parse_args(argv)
  shape = tuple(int(s) for s in args.shape.split(","))
  copy_bw, rows = measure(shape, args.repeats, args.dtype)
  size = jnp.dtype(args.dtype).itemsize * jnp.prod(jnp.array(shape)) / 2**20
  print(f"device: {jax.devices()[0].device_kind}; input {args.dtype} {list(shape)} = {size:.1f} MiB; "
        f"copy bandwidth (read+write) {copy_bw / 1e9:.1f} GB/s\n")
  print(f"| codec | wire/{args.dtype} | encode GB/s of input | encode / copy bw | decode GB/s of output | decode / copy bw |")
  print("|---|---:|---:|---:|---:|---:|")
  for text, ratio, enc, enc_frac, dec, dec_frac in rows:
    print(f"| `{text}` | {ratio:.4f} | {enc:.2f} | {enc_frac:.2f} | {dec:.2f} | {dec_frac:.2f} |")


if __name__ == "__main__":
  main()
