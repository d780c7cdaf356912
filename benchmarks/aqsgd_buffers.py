"""AQ-SGD buffers on the device vs in host memory (with and without prefetch): step time.

`python -m benchmarks.aqsgd_buffers [--examples 512] [--seq 128] [--model tiny|small]`
Trains GPT-2 with AQ-SGD fw2-bw4 for one shuffled epoch in each configuration and prints
the mean step time and the buffers' size; host-buffered steps gather and write back only
the batch's rows.
"""
import time

import jax
import numpy as np
import optax

import jaxcomp
from benchmarks.common import gpt2_config, gpt2_parser, ratio_table
from jaxcomp.data import batching
from jaxcomp.models import gpt2
from jaxcomp.parallel import hostbuffer, simulate


def main(argv=None):
  parser = gpt2_parser(__doc__, microbatches=1)
  parser.add_argument("--examples", type=int, default=512)
  args = parser.parse_args(argv)
  cfg = gpt2_config(args.model)
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.examples, args.seq), dtype=np.int32)
  opt = optax.adamw(1e-4)
  make = lambda n: jaxcomp.Pipeline(gpt2.gpt2_stages(cfg, 4), jaxcomp.parse_boundary("aqsgd+maxabs:2", "maxabs:4",
                                                                                     num_examples=n),
                                    jaxcomp.losses.language_model, "tokens", args.microbatches,
                                    tied=gpt2.gpt2_tied(4))
  batches = list(batching.iterate({"tokens": tokens}, args.batch, 0, 0))
  rows = [(args.seq, cfg.n_embd)] * 3
  results = {}
  compiled = {}  # one jitted step per table size: both host variants share theirs
  for name in ("device table", "host, no prefetch", "host + prefetch"):
    host = name != "device table"
    pipe = make(args.batch if host else args.examples)
    state = simulate.init_state(pipe, opt, jax.random.key(0), batches[0])
    step = compiled.setdefault(host, simulate.make_train_step(pipe, opt))
    if host:
      tables = hostbuffer.HostTables(args.examples, rows)
      step = hostbuffer.HostBufferedStep(step, tables, prefetch=name.endswith("prefetch"))
      run = lambda s, t: step(s, batches[t], batches[t + 1]["id"] if t + 1 < len(batches) else None)
    else:
      run = lambda s, t: step(s, batches[t])
    state, m = run(state, 0)  # compile
    jax.block_until_ready(m)
    start = time.perf_counter()
    for t in range(1, len(batches)):
      state, m = run(state, t)
    jax.block_until_ready(m)
    results[name] = (time.perf_counter() - start) / (len(batches) - 1)
    if host:
      step.close()
  size = hostbuffer.memory_estimate(args.examples, rows) / 2**20
  print(f"device: {jax.devices()[0].device_kind}; GPT-2 {args.model}; {args.examples} examples; AQ-SGD tables "
        f"{size:.1f} MiB per end (device: 2 ends; host: one shared copy)\n")
  print(ratio_table("buffers (ms per step)", results, "device table"))


if __name__ == "__main__":
  main()
