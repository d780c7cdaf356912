"""What a run checks before it creates anything, each refusal one error naming the flag and the fix.

`check_choices` checks the layered settings (`config.layered`) before they are typed; the others check a
`config.RunConfig` against the machine, the folders and the model.
"""
import math
import os
import pathlib
import re

import jax

from jaxcomp import pipeline
from jaxcomp.compress.boundary import Reuse
from jaxcomp.compress.schemes import AQSGD
from jaxcomp.compress.spec import parse_boundary, parse_scheme
from jaxcomp.parallel import schedules
from jaxcomp.runtime import checkpoint, train

AT_LEAST = {**{k: 1 for k in ("epochs", "steps", "batch_size", "microbatches", "stages", "train_examples",
                                "eval_examples", "data_parallel", "width", "init_epoch", "eval_every", "lr_steps")},
            "block_size": 2, "warmup_epochs": 0}
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


def check_choices(choices: dict, preset: str | None):
  """Ranges, the run name, the compression specs (parsed), and the settings that only go together."""
  for key, least in AT_LEAST.items():
    if choices.get(key) is not None and choices[key] < least:
      raise ValueError(f"--{key.replace('_', '-')} must be at least {least}, got {choices[key]}")
  if not (math.isfinite(choices["lr"]) and choices["lr"] > 0):
    raise ValueError(f"--lr must be a finite positive number, got {choices['lr']}")
  target = choices.get("target_loss")
  if target is not None and not math.isfinite(target):
    raise ValueError(f"--target-loss must be a finite number, got {target}")
  if choices.get("stop_at_target") and target is None:
    raise ValueError("--stop-at-target ends the run at --target-loss: give --target-loss L")
  if not 0 <= choices["seed"] < 2**63:
    raise ValueError(f"--seed must be an integer in 0..2^63-1, got {choices['seed']}")
  name = choices.get("run_name")
  if name is not None and not RUN_NAME.fullmatch(name):
    suggestion = re.sub(r"[^A-Za-z0-9._+-]+", "_", name).strip("._+-") or "run1"
    raise ValueError(f"--run-name {name!r} must be one folder name (letters, digits and . _ + -, not starting with "
                     f". _ + -), e.g. {suggestion}")
  try:
    schedules.parse(choices["schedule"])
  except ValueError as err:
    raise ValueError(f"--schedule: {err}") from None
  boundary = parse_boundary(choices["fwd"], choices["bwd"], num_examples=1)  # fail early on a bad spec
  buffers = choices["aqsgd_buffers"]
  if buffers != "device" and not isinstance(boundary.fwd, AQSGD):
    raise ValueError(f"--aqsgd-buffers {buffers} holds AQ-SGD tables, but the forward spec {choices['fwd']!r} keeps "
                     "none; use an aqsgd+ spec or leave the buffers on the device")
  if choices.get("tied_compression"):
    if choices.get("untie_embeddings"):
      raise ValueError(f"--untie-embeddings leaves no tied exchange for --tied-compression "
                       f"{choices['tied_compression']} to compress; drop one of them")
    try:
      pipeline.check_tied_scheme(parse_scheme(choices["tied_compression"]))
    except ValueError as err:
      raise ValueError(f"--tied-compression {choices['tied_compression']}: {err}") from None
  if choices.get("init_epoch") and not choices.get("init_from"):
    raise ValueError(f"preset {preset!r} warm-starts from a baseline after {choices['init_epoch']} epochs: "
                     "run the baseline preset first and pass its folder with --init-from")


def check_executor(config):
  """The schedule's sizes go together, and a batch splits into data shards x microbatches (which executor the
  settings name, and whether its settings go together: `config.executor_config`)."""
  settings = config.executor
  shards, m, batch_size = settings.data_parallel, settings.microbatches, config.training.batch_size
  settings.pipeline_schedule.check_overlap(settings.stages, m)
  if settings.model_stages > settings.stages:  # interleaved:V
    if m % settings.stages:
      raise ValueError(f"--schedule {settings.schedule} needs --microbatches a multiple of --stages: got "
                       f"--microbatches {m} for --stages {settings.stages}; use --microbatches "
                       f"{m + settings.stages - m % settings.stages}")
  if batch_size % (shards * m):
    raise ValueError(f"--batch-size {batch_size} does not split into {shards} data shard(s) x "
                     f"--microbatches {m} equal microbatches; use a multiple of {shards * m} (e.g. --batch-size "
                     f"{max(1, batch_size // (shards * m)) * shards * m}) or other --microbatches")


def check_folder(path, flag: str):
  """`path` is a folder, or can be made one: its nearest existing ancestor is a folder we may write.

  Checked before anything is created; a folder the OS still refuses is named by `runner.run_lock`."""
  path = pathlib.Path(path)
  existing = next(p for p in [path, *path.parents] if p.exists() or p == pathlib.Path(p.anchor or "."))
  if not existing.is_dir():
    where = "" if existing == path else f" ({existing} is a file)"
    raise ValueError(f"{flag} {path} is not a folder{where}; pass a folder (it is created if missing)")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ValueError(f"{flag} {path}: cannot write in {existing} (permission denied); pass a folder you can write")


def check_specs_fit(config, pipe, batch):
  """Initialises the model and runs each boundary's compression abstractly (`jax.eval_shape`: nothing
  is allocated, run or compiled), so a spec that does not fit the model's activations fails now,
  naming the flag. (Whether AQ-SGD tables fit is checked once their size is printed.)"""
  specs = {"fwd": config.compression.fwd, "bwd": config.compression.bwd}
  for x in pipeline.activation_shapes(pipe, batch):
    for flag in ("fwd", "bwd"):
      scheme = getattr(pipe.boundary, flag)
      try:
        if not isinstance(scheme, Reuse):
          jax.eval_shape(lambda x: scheme.codec(x, jax.random.key(0)), x)
      except ValueError as err:
        raise ValueError(f"--{flag} {specs[flag]} does not fit this model's boundary activations "
                         f"{x.dtype.name}{list(x.shape)}: {err}") from None


def check_devices(config, needed: int, command: str):
  """The executor needs `needed` devices (the sharded one stages x data-parallel); on CPU, says how to fake them."""
  settings = config.executor
  have = jax.devices()
  if len(have) < needed:
    hint = (f"; on CPU, make fake devices: XLA_FLAGS=--xla_force_host_platform_device_count={needed} "
            f"{command} ... (or use --executor simulate)" if have[0].platform == "cpu" else "")
    raise ValueError(f"--executor {settings.executor} needs {needed} devices ({settings.stages} stages x "
                     f"{settings.data_parallel} data-parallel), found {len(have)} {have[0].platform}{hint}")


def check_batch_size(batch_size: int, train_examples: int, eval_examples: int):
  """Each split must hold at least one batch (the last partial batch is dropped)."""
  for split, n, flag in (("training", train_examples, "--train-examples"), ("evaluation", eval_examples,
                                                                           "--eval-examples")):
    if batch_size > n:
      raise ValueError(f"--batch-size {batch_size} is larger than the {split} set ({n} examples); use "
                       f"--batch-size {n} or less, or a larger {flag}")


def check_run_folder(config, run_dir: pathlib.Path):
  """--resume needs this run's checkpoints, a new run must have none, --init-from needs the
  baseline's epoch; checked before anything is created."""
  saved = train.saved_epochs(run_dir / "ckpt")
  resume, name, training = config.output.resume, config.output.run_name, config.training
  if resume and not saved:
    raise ValueError(f"--resume: run {name!r} has no checkpoint in {run_dir / 'ckpt'}; check --out and "
                     "--run-name, or start the run without --resume")
  if saved and not resume:
    raise ValueError(f"run {name!r} already has checkpoints in {run_dir / 'ckpt'} (epochs {saved}); "
                     "add --resume to continue it, or give this run another --run-name (nothing was overwritten)")
  if resume:
    unreadable = train.unreadable_epochs(run_dir / "ckpt")
    if len(unreadable) == len(saved):
      raise ValueError(corrupt_checkpoint_advice(config, run_dir, checkpoint.CorruptCheckpointError(
          f"no intact checkpoint in {run_dir / 'ckpt'} (epochs {saved}): " + "; ".join(unreadable.values()))))
  if training.init_epoch and not resume:
    baseline = pathlib.Path(training.init_from) / "ckpt"
    epochs = train.saved_epochs(baseline)
    if not epochs:
      raise ValueError(f"--init-from {training.init_from}: no checkpoints in {baseline}; pass the folder of a "
                       "baseline run (runs/<experiment>/<run name>)")
    if training.init_epoch not in epochs:
      raise ValueError(f"--init-from {training.init_from} has checkpoints of epochs {epochs}, not of --init-epoch "
                       f"{training.init_epoch}; pass one of those or train the baseline further")
    unreadable = train.unreadable_epochs(baseline)
    if training.init_epoch in unreadable:
      raise ValueError(corrupt_checkpoint_advice(config, run_dir, checkpoint.CorruptCheckpointError(
          unreadable[training.init_epoch])))


def corrupt_checkpoint_advice(config, run_dir: pathlib.Path, err: checkpoint.CorruptCheckpointError) -> str:
  """What to do when every checkpoint a run would start from is corrupt (an older intact one is taken, with a
  warning)."""
  if config.output.resume:
    return (f"--resume: {err}; nothing intact to resume from: move {run_dir} away (or delete it) and start the run "
            "again without --resume, or start it under another --run-name")
  return (f"--init-from {config.training.init_from}: {err}; train the baseline again, or warm-start from another "
          "--init-epoch it saved")
