"""Training throughput vs link bandwidth (AQ-SGD Table 2 style), from measured parts.

`python -m benchmarks.throughput_vs_bandwidth [--model tiny|small] [--batch 8] [--seq 128]`
1. measures, on this machine's default device, each GPT-2 stage's forward and backward
   time for one microbatch, and each config's codec time (encode+decode of a forward and a
   backward message, added to the sending stages);
2. takes each config's exact bytes per message from the codecs' `wire_bytes`;
3. feeds both to `jaxcomp.netsim` (GPipe schedule, full-duplex links, given latency) and
   prints samples/s per bandwidth, with the speed-up over fp32.
"""
import jax
import jax.numpy as jnp
import optax

import jaxcomp
from benchmarks.common import gpt2_config, gpt2_parser, median_seconds, select
from jaxcomp import netsim, pipeline as pl, spec
from jaxcomp.models import gpt2

CONFIGS = {"fp32": ("none", "none"), "fw4-bw8": ("maxabs:4", "maxabs:8"),
           "direct fw3-bw6": ("maxabs:3", "maxabs:6"), "AQ-SGD fw3-bw6": ("aqsgd+maxabs:3", "maxabs:6"),
           "direct fw2-bw4": ("maxabs:2", "maxabs:4"), "Top10% (reuse)": ("topk:0.1", "reuse")}


def stage_times(pipe, state, microbatch, repeats):
  """(forward seconds, backward seconds) of each stage on one microbatch."""
  fwd_s, bwd_s = [], []
  x = microbatch[pipe.input_key]
  rng = jax.random.key(0)
  for stage, params, ms in zip(pipe.stages, state.params, state.model_state):
    forward = jax.jit(lambda p, x, stage=stage, ms=ms: stage.apply(p, ms, x, train=True, rng=rng)[0])
    y = forward(params, x)
    diff_x = jnp.issubdtype(x.dtype, jnp.floating)

    def both(p, x, g, forward=forward, diff_x=diff_x):
      if diff_x:
        return jax.vjp(forward, p, x)[1](g)
      return jax.vjp(lambda p: forward(p, x), p)[1](g)

    t_fwd = median_seconds(forward, params, x, repeats=repeats)
    t_both = median_seconds(jax.jit(both), params, x, jnp.ones_like(y), repeats=repeats)
    fwd_s.append(t_fwd)
    bwd_s.append(max(t_both - t_fwd, 0.0))
    x = y
  return fwd_s, bwd_s


def codec_seconds(scheme, x, repeats):
  """Encode + decode of one message (index reuse: gather + scatter at known positions)."""
  if isinstance(scheme, jaxcomp.Reuse):
    return 0.0
  codec = scheme.codec
  return median_seconds(jax.jit(lambda x, k: codec(x, k)), x, jax.random.key(0), repeats=repeats)


def main(argv=None):
  parser = gpt2_parser(__doc__, microbatches=4)
  parser.add_argument("--latency-ms", type=float, default=1.0)
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--configs", default=",".join(CONFIGS),
                      help="comma-separated subset of the configs (fp32, the baseline, is always run)")
  args = parser.parse_args(argv)
  configs = select(CONFIGS, args.configs, "fp32")

  cfg = gpt2_config(args.model)
  stages = gpt2.gpt2_stages(cfg, 4)
  tokens = jax.random.randint(jax.random.key(0), (args.batch, args.seq), 0, cfg.vocab_size)
  batch = {"tokens": tokens, "id": jnp.arange(args.batch)}
  base = jaxcomp.Pipeline(stages, spec.parse_boundary("none", "none"), jaxcomp.losses.language_model,
                          "tokens", args.microbatches)
  state = pl.init_state(base, optax.sgd(0.0), jax.random.key(1), batch)
  microbatch = jax.tree.map(lambda a: a[: args.batch // args.microbatches], batch)
  fwd_s, bwd_s = stage_times(base, state, microbatch, args.repeats)
  shapes = pl.boundary_shapes(base, state.params, state.model_state, microbatch["tokens"])
  act = jax.random.normal(jax.random.key(2), shapes[0].shape, shapes[0].dtype)
  print(f"device: {jax.devices()[0].device_kind}; GPT-2 {args.model}, 4 stages, {args.microbatches} "
        f"microbatches of {list(shapes[0].shape)} activations")
  print("stage forward ms:", [round(t * 1e3, 2) for t in fwd_s], "backward ms:", [round(t * 1e3, 2) for t in bwd_s])

  rows, bytes_lines = [], []
  for name, (fwd_text, bwd_text) in configs.items():
    boundary = spec.parse_boundary(fwd_text, bwd_text, num_examples=args.batch)
    per_message = [boundary.wire_bytes(s.shape, s.dtype) for s in shapes]
    t_fwd_codec = codec_seconds(boundary.fwd, act, args.repeats)
    t_bwd_codec = codec_seconds(boundary.bwd, act, args.repeats)
    f = [t + (t_fwd_codec if s < len(shapes) else 0.0) for s, t in enumerate(fwd_s)]
    b = [t + (t_bwd_codec if s > 0 else 0.0) for s, t in enumerate(bwd_s)]
    bytes_lines.append(f"| {name} | {per_message[0][0]:,} | {per_message[0][1]:,} | "
                       f"{t_fwd_codec * 1e3:.3f} | {t_bwd_codec * 1e3:.3f} |")
    for bw in netsim.DEFAULT_BANDWIDTHS_BPS:
      timeline = netsim.simulate_step(f, b, [m[0] for m in per_message], [m[1] for m in per_message],
                                      args.microbatches, bw, args.latency_ms * 1e-3)
      rows.append(netsim.SweepRow(name, bw, timeline.makespan, netsim.throughput(args.batch, timeline)))
  print("\n| config | fwd bytes/message | bwd bytes/message | codec fwd ms | codec bwd ms |")
  print("|---|---:|---:|---:|---:|")
  print("\n".join(bytes_lines))
  print(f"\nTraining throughput (samples/s) over links of the given bandwidth, {args.latency_ms} ms latency:\n")
  print(netsim.render_markdown(rows, baseline="fp32"))


if __name__ == "__main__":
  main()
