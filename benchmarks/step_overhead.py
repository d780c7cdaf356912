"""Compression overhead: train-step time of each preset / the uncompressed step, one run.

`python -m benchmarks.step_overhead [--model tiny|small] [--executor simulate|sharded]`
GPT-2 in 4 stages; the same batch and executor for every preset. All presets are compiled
first, then timed in interleaved rounds (so machine drift hits all alike; each round starts one
preset later, so no preset always runs first); each figure is the median over rounds of
synchronised steps. Ratio 1.05 = 5% overhead. The uncompressed step is compiled and timed twice
("fp32" and "fp32 (again)"): their ratio is the run's noise floor.
"""
import jax
import jax.numpy as jnp
import optax

import jaxcomp
from benchmarks.common import (
  gpt2_config,
  gpt2_parser,
  interleaved_medians,
  ratio_table,
  select,
)
from experiments import config
from jaxcomp.compress.boundary import Mode
from jaxcomp.models import gpt2

PRESETS = {"fp32": ("none", "none"), "fw4-bw8": ("maxabs:4", "maxabs:8"), "fw2-bw4": ("maxabs:2", "maxabs:4"),
           "AQ-SGD fw2-bw4": ("aqsgd+maxabs:2", "maxabs:4"), "AQ-SGD fw3-bw6 stoch": ("aqsgd+maxabs:3:stoch", "maxabs:6:stoch"),
           "Top10% reuse": ("topk:0.1", "reuse"), "EF21 Top10%": ("ef21+topk:0.1", "ef21+topk:0.1")}


def main(argv=None):
  parser = gpt2_parser(__doc__, microbatches=2)
  parser.add_argument("--executor", type=config.executor_name, choices=config.EXECUTORS, default="simulate")
  parser.add_argument("--repeats", type=int, default=30, help="interleaved rounds")
  parser.add_argument("--presets", default=",".join(PRESETS),
                      help="comma-separated subset of the presets (fp32, the baseline, is always run)")
  args = parser.parse_args(argv)
  presets = {**select(PRESETS, args.presets, "fp32"), "fp32 (again)": PRESETS["fp32"]}
  cfg = gpt2_config(args.model)
  tokens = jax.random.randint(jax.random.key(0), (args.batch, args.seq), 0, cfg.vocab_size)
  batch = {"tokens": tokens, "id": jnp.arange(args.batch)}
  opt = optax.adamw(1e-4)
  executor = config.executor_for(config.ExecutorConfig(executor=args.executor, stages=4,
                                                      microbatches=args.microbatches))
  runs = {}
  for name, (fwd, bwd) in presets.items():
    pipe = jaxcomp.Pipeline(gpt2.gpt2_stages(cfg, 4), jaxcomp.parse_boundary(fwd, bwd, num_examples=args.batch),
                            jaxcomp.losses.language_model, "tokens", args.microbatches, tied=gpt2.gpt2_tied(4))
    state = executor.init_state(pipe, opt, jax.random.key(1), batch)
    step = executor.make_train_step(pipe, opt, Mode.TRAIN)
    holder = [state]

    def run(step=step, holder=holder):
      holder[0], metrics = step(holder[0], batch)
      return metrics["loss"]

    jax.block_until_ready(run())  # compile
    runs[name] = run
  times = interleaved_medians(runs, args.repeats)
  print(f"device: {jax.devices()[0].device_kind}; GPT-2 {args.model}, 4 stages, {args.executor}, batch "
        f"{args.batch}x{args.seq}, {args.microbatches} microbatches\n")
  print(ratio_table("preset (ms per train step)", times, "fp32"))


if __name__ == "__main__":
  main()
