"""MaxText's own training loop with jaxcomp compressing its pipeline's stage-to-stage activations.

A tiny MaxText decoder in 4 pipeline stages (`ici_pipeline_parallelism=4`) on 4 fake CPU devices, trained by
MaxText's `train.main` on its synthetic data (one fixed random batch) a few steps per run: uncompressed
(`none/none`) and with each `fwd/bwd` pair given, each run inside `patch_pipeline(fwd, bwd)`. It prints each run's
losses (MaxText's metrics file) and the bytes per step its compiled train step sends between stages (XLA's dump of
`jit_train_step`, read by `stage_permute_bytes`). MaxText's train loop sets process state (its PRNG, XLA's dump),
so it runs in a process of its own:

  PYTHONPATH=. python -m examples.maxtext_train --steps 5      # needs pip install -e '.[maxtext]' (Python >= 3.12)
"""
import argparse
import glob
import json
import math
import os
import sys
import tempfile

from benchmarks.common import xla_flags_with_devices

STAGES = 4  # pipeline stages, devices and microbatches
WIDTH, LENGTH, PER_DEVICE_BATCH = 32, 32, 2
MESSAGE = (PER_DEVICE_BATCH, LENGTH, WIDTH)  # one stage's block: a microbatch (global batch / STAGES microbatches)
# the tiny decoder: MaxText's base.yml (llama2 blocks, bf16 matmuls, fp32 weights, AdamW) made small
TINY = (f"base_emb_dim={WIDTH}", "base_num_query_heads=4", "base_num_kv_heads=4", "base_mlp_dim=64", "head_dim=8",
        "base_num_decoder_layers=4", "vocab_size=64", f"max_target_length={LENGTH}",
        f"per_device_batch_size={PER_DEVICE_BATCH}", f"ici_pipeline_parallelism={STAGES}",
        f"num_pipeline_microbatches={STAGES}", "scan_layers_per_stage=False",
        "attention=dot_product", "learning_rate=3e-3", "warmup_steps_fraction=0", "dataset_type=synthetic",
        "enable_checkpointing=False", "enable_goodput_recording=False", "enable_tensorboard=False")


def train_run(fwd: str, bwd: str, steps: int, workdir: str, dump_dir: str) -> dict:
  """One `train.main` run inside `patch_pipeline(fwd, bwd)`: its losses and its train step's bytes per step."""
  import maxtext
  from maxtext.trainers.pre_train import train

  from jaxcomp.integrations import maxtext as jaxcomp_maxtext

  name = f"{fwd}-{bwd}".replace(":", "")
  metrics = os.path.join(workdir, f"{name}.jsonl")
  before = set(glob.glob(os.path.join(dump_dir, "*jit_train_step*after_optimizations.txt")))
  argv = [None, os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml"), *TINY, f"steps={steps}",
          f"run_name={name}", f"base_output_directory={workdir}", f"metrics_file={metrics}"]
  with jaxcomp_maxtext.patch_pipeline(fwd, bwd):
    train.main(argv)
  dumped = sorted(set(glob.glob(os.path.join(dump_dir, "*jit_train_step*after_optimizations.txt"))) - before)
  if len(dumped) != 1:
    raise SystemExit(f"error: expected XLA to dump one compiled jit_train_step for run {name}, found {dumped}; run "
                     "this script in a fresh process (python -m examples.maxtext_train)")
  with open(dumped[0]) as f:
    sent = jaxcomp_maxtext.stage_permute_bytes(f.read())
  with open(metrics) as f:
    losses = [json.loads(line)["learning/loss"] for line in f]
  return {"fwd": fwd, "bwd": bwd, "losses": losses, "bytes_per_step": sent, "message_shape": MESSAGE}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--runs", nargs="+", default=["none/none", "maxabs:4/maxabs:8", "maxabs:8/maxabs:8"],
                      help="fwd/bwd spec pairs, one run each (none/none: MaxText's own program)")
  parser.add_argument("--json", help="also write the runs to this JSON file")
  args = parser.parse_args(argv)
  pairs = [run.split("/") for run in args.runs]
  if any(len(pair) != 2 for pair in pairs):
    raise SystemExit(f"error: --runs takes fwd/bwd pairs such as maxabs:4/maxabs:8, got {args.runs}")
  workdir = tempfile.mkdtemp(prefix="maxtext_train_")
  dump_dir = os.path.join(workdir, "xla_dump")
  # before JAX starts its backend: 4 CPU devices, and XLA dumping the compiled train step
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = (f"{xla_flags_with_devices(STAGES)} --xla_dump_to={dump_dir} "
                             "--xla_dump_hlo_module_re=jit_train_step")
  import jax
  if jax.device_count() != STAGES:
    raise SystemExit(f"error: the run needs {STAGES} devices, found {jax.device_count()} ({jax.devices()[0].platform})"
                     f"; run it on the CPU (JAX_PLATFORMS=cpu)")
  runs = [train_run(fwd, bwd, args.steps, workdir, dump_dir) for fwd, bwd in pairs]
  print(f"MaxText train.main, synthetic data, {args.steps} steps, {STAGES} pipeline stages on {STAGES} CPU devices; "
        "tiny decoder: " + " ".join(TINY[:9]))
  base = runs[0]["bytes_per_step"]
  print("fwd/bwd | loss per step | stage activations per step fwd / bwd (x fewer than the first run) | other permutes")
  for run in runs:
    sent = run["bytes_per_step"]
    ratio = lambda key: f"{base[key] / sent[key]:.2f}x" if sent[key] else "-"
    print(f"{run['fwd']}/{run['bwd']} | {' '.join(f'{loss:.4f}' for loss in run['losses'])} | "
          f"{sent['fwd']:,} ({ratio('fwd')}) / {sent['bwd']:,} ({ratio('bwd')}) | {sent['other']:,}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(runs, f, indent=1)
  if not all(math.isfinite(loss) for run in runs for loss in run["losses"]):
    print("error: a loss is not finite", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
