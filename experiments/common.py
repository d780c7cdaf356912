"""What every experiment shares: the CLI, presets, executor choice and result writing.

An experiment module defines its recipes (named defaults, `--recipe`), a preset table (paper
row -> overrides), `build(config) -> (Pipeline, optimizer, train.Data, params)` and
`abstract(config) -> (Pipeline, optimizer, batch, assumption)` (the same run without data, for
`--compile-for`); `main` does the rest. Precedence: recipe < preset < explicit flags; the
resolved configuration is printed before training.
"""
import argparse
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import re
import sys
import warnings
from typing import Callable

import jax

from experiments import plots
from jaxcomp import pipeline
from jaxcomp.compress.boundary import Reuse
from jaxcomp.compress.schemes import AQSGD
from jaxcomp.compress.spec import parse_boundary, parse_scheme
from jaxcomp.parallel import hostbuffer, sharded, simulate
from jaxcomp.runtime import (
  checkpoint,
  distributed,
  dryrun,
  lock,
  results,
  targets,
  train,
)

GROUPS = {  # --help's argument groups: key -> title
    "compression": "compression (what crosses the stage boundaries)",
    "training": "model and training",
    "parallel": "parallelism and multi-host (SLURM, Open MPI and Cloud TPU pods are detected without the "
                "multi-process flags)",
    "data": "data",
    "output": "output and resume",
}
COMMON_FLAGS = {  # flag -> (group, type, help); defaults come from the recipe
    "fwd": ("compression", str, "forward (activation) compression spec, e.g. quant:4, topk:0.1, aqsgd+topk:0.5"),
    "bwd": ("compression", str, "backward (gradient) compression spec, e.g. quant:8, reuse"),
    "warmup_epochs": ("compression", int, "epochs sent uncompressed first (AQ-SGD fills its buffers)"),
    "grad_compression": ("compression", str,
                         "compress data-parallel weight gradients, e.g. ef+quant:4 (gpipe; dense in warm-up)"),
    "epochs": ("training", int, "training epochs"),
    "steps": ("training", int, "stop after this many steps in total (short runs)"),
    "seed": ("training", int, "random seed (init, data order, stochastic rounding)"),
    "batch_size": ("training", int, "global batch size"),
    "lr": ("training", float, "peak learning rate"),
    "init_epoch": ("training", int, "warm start from the baseline's checkpoint after this many epochs (baseN)"),
    "stages": ("parallel", int, "pipeline stages"),
    "microbatches": ("parallel", int, "GPipe microbatches per batch (per data shard)"),
    "data_parallel": ("parallel", int, "data-parallel replicas (gpipe executor)"),
    "train_examples": ("data", int, "use only the first N training examples (quick runs)"),
    "eval_examples": ("data", int, "use only the first N evaluation examples"),
}


AT_LEAST = {**{k: 1 for k in ("epochs", "steps", "batch_size", "microbatches", "stages", "train_examples",
                                "eval_examples", "data_parallel", "width", "init_epoch")},
            "block_size": 2, "warmup_epochs": 0}


@dataclasses.dataclass(frozen=True)
class RunDefaults:
  """What a run uses where neither its recipe, its preset nor a flag says otherwise (set here once)."""
  executor: str = "simulate"
  schedule: str = "gpipe"
  data_parallel: int = 1
  aqsgd_buffers: str = "device"
  warmup_epochs: int = 0
  grad_compression: str | None = None  # the dense mean
  bottleneck: str | None = None


RUN_DEFAULTS = dataclasses.asdict(RunDefaults())
UNSET_MEANS = {"steps": "every epoch's", "train_examples": "all", "eval_examples": "all",
               "grad_compression": "none, the dense mean", "bottleneck": "none"}  # --help's words for None
COMPRESSION_KEYS = ("fwd", "bwd", "warmup_epochs", "init_epoch", "grad_compression")
RESUMABLE = ("epochs", "steps", "resume", "no_progress", "out", "coordinator", "num_processes", "process_id",
             "compile_for", "train_only")
# (may change when a run is resumed: where it runs is not what it computes)
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


@dataclasses.dataclass(frozen=True)
class Experiment:
  name: str
  recipes: dict  # recipe name (e.g. "paper", "tiny") -> defaults
  default_recipe: str
  presets: dict  # preset name -> overrides
  build: Callable  # config dict -> (Pipeline, optimizer, train.Data, initial params or None)
  abstract: Callable  # config dict -> (Pipeline, optimizer, batch, assumption): no data read (--compile-for)
  flags: dict = dataclasses.field(default_factory=dict)  # its own flags: name -> (group, help, argparse kwargs)
  paper_row: Callable = lambda preset: ""  # preset name -> the paper's row it reproduces (--list-presets)


def recipe_default(exp: Experiment, key: str) -> str:
  """' (default: V)' from the recipes (' (default: V; W with --recipe R)' where they differ), '' if none sets it."""
  values = {name: recipe.get(key) for name, recipe in exp.recipes.items()}
  default = values[exp.default_recipe]
  if all(v is None for v in values.values()):
    default = RUN_DEFAULTS.get(key)
    default = UNSET_MEANS.get(key) if default is None else default
    return "" if default is None else f" (default: {default})"
  others = "".join(f"; {v} with --recipe {name}" for name, v in values.items() if v != default)
  return f" (default: {default}{others})"


def parser_for(exp: Experiment) -> argparse.ArgumentParser:
  """The experiment's CLI in argument groups (GROUPS); each flag's help shows its default."""
  p = argparse.ArgumentParser(prog=f"python -m experiments.{exp.name}",
                              description=f"{exp.name}: presets reproduce the papers' rows; precedence: recipe < "
                                          "preset < flags (the resolved configuration is printed before training)")
  groups = {key: p.add_argument_group(title) for key, title in GROUPS.items()}
  groups["compression"].add_argument("--preset", help="a paper row: its specs and settings (see --list-presets)")
  groups["compression"].add_argument("--list-presets", action="store_true",
                                     help="print each preset's paper row and what it sends per step, and exit")
  groups["training"].add_argument("--recipe", choices=list(exp.recipes),
                                  help=f"defaults that presets and flags override (default: {exp.default_recipe})")
  for flag, (group, kind, text) in COMMON_FLAGS.items():
    groups[group].add_argument("--" + flag.replace("_", "-"), type=kind, help=text + recipe_default(exp, flag))
  parallel = groups["parallel"]
  parallel.add_argument("--executor", choices=["simulate", "gpipe"],
                        help="simulate: every stage on one device; gpipe: stage s on device s"
                             + recipe_default(exp, "executor"))
  parallel.add_argument("--schedule", choices=list(sharded.SCHEDULES),
                        help="gpipe executor's tick schedule: gpipe, 1f1b (at most S microbatch inputs per stage) or "
                             "1f1b-fused (at most 2S-1, fewer ticks)" + recipe_default(exp, "schedule"))
  parallel.add_argument("--compile-for", metavar="TARGET",
                        help="compile the run's steps for an accelerator and report memory, FLOPs, an estimated step "
                             "time and wire bytes; train nothing, read no data (exit 0: fits, 1: does not). TARGET: "
                             f"{', '.join(targets.TARGETS)}")
  parallel.add_argument("--train-only", action="store_true",
                        help="with --compile-for: compile the train step alone, not the eval step too (it takes "
                             "about half the train step's compile again)")
  parallel.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0 (jax.distributed)")
  parallel.add_argument("--num-processes", type=int, help="number of processes in the run")
  parallel.add_argument("--process-id", type=int, help="this process's index, 0..N-1")
  groups["compression"].add_argument(
      "--aqsgd-buffers", metavar="device|host|DIR",
      help="where AQ-SGD's per-example tables live: on the device, in host RAM, or in memory-mapped .npy files "
           "under DIR (simulate executor, aqsgd+ forward spec)" + recipe_default(exp, "aqsgd_buffers"))
  output = groups["output"]
  output.add_argument("--out", help=f"output folder (default: runs/{exp.name})")
  output.add_argument("--run-name", help="name of this run's files (default: the preset, else the specs)")
  output.add_argument("--resume", action="store_true", help="continue from this run's latest checkpoint")
  output.add_argument("--init-from", help="baseline run folder (with ckpt/) for warm starts (baseN presets)")
  output.add_argument("--no-progress", action="store_true", help="no progress bar")
  for flag, (group, text, kwargs) in exp.flags.items():
    groups[group].add_argument("--" + flag.replace("_", "-"), help=text + recipe_default(exp, flag), **kwargs)
  return p


def merged(exp: Experiment, args: argparse.Namespace, preset: str | None) -> dict:
  """RunDefaults, updated by the recipe, then the preset, then the flags given."""
  config = {**RUN_DEFAULTS, **exp.recipes[args.recipe or exp.default_recipe]}
  config.update(exp.presets[preset] if preset else {})
  config.update({k: v for k, v in vars(args).items() if v is not None and v is not False})
  return config


def preset_table(exp: Experiment, args: argparse.Namespace) -> str:
  """--list-presets: each preset's specs, the bytes one train step sends over all boundaries with the
  recipe and flags given (traced abstractly: no data read), and the paper's row it reproduces."""
  dense, shapes = {}, {}  # per run shape (config without its compression fields): fp32 bytes, boundary shapes
  lines = [f"{'preset':22s} {'fwd':24s} {'bwd':16s} {'fwd B/step':>11s} {'bwd B/step':>11s} {'fewer':>6s}  "
           "paper row (and what else the preset sets)"]
  for name in exp.presets:
    config = merged(exp, args, name)
    shape_key = json.dumps({k: v for k, v in config.items() if k not in COMPRESSION_KEYS}, sort_keys=True, default=str)
    if shape_key not in shapes:
      pipe, _, batch, _ = exp.abstract({**config, "fwd": "none", "bwd": "none"})
      shapes[shape_key] = (pipe.microbatches, pipeline.activation_shapes(pipe, batch))
      dense[shape_key] = simulate.wire_bytes_per_step(pipe, batch)["fwd"]
    m, activations = shapes[shape_key]
    boundary = parse_boundary(config["fwd"], config["bwd"], num_examples=1)
    sent = [boundary.wire_bytes(a.shape, a.dtype) for a in activations]
    fwd, bwd = m * sum(f for f, _ in sent), m * sum(b for _, b in sent)
    extra = [f"first {config['warmup_epochs']} epoch(s) dense"] if config.get("warmup_epochs") else []
    extra += [f"warm start after {config['init_epoch']} baseline epochs"] if config.get("init_epoch") else []
    lines.append(f"{name:22s} {config['fwd']:24s} {config['bwd']:16s} {fwd:11,d} {bwd:11,d} "
                 f"{2 * dense[shape_key] / (fwd + bwd):5.1f}x  {exp.paper_row(name)}"
                 + (f" ({'; '.join(extra)})" if extra else ""))
  recipe = args.recipe or exp.default_recipe
  lines.append(f"bytes per train step over all {len(activations)} boundaries with --recipe {recipe} and the flags "
               "given (dense warm-up epochs send fp32); fewer: fp32 bytes both ways / the preset's")
  return "\n".join(lines)


def resolve(exp: Experiment, args: argparse.Namespace) -> dict:
  """recipe < preset < flags; validates the preset name and the compression specs."""
  if args.preset is not None and args.preset not in exp.presets:
    raise ValueError(f"unknown preset {args.preset!r}; valid presets: {', '.join(exp.presets)}")
  config = merged(exp, args, args.preset)
  config.pop("list_presets", None)
  config["recipe"] = args.recipe or exp.default_recipe
  for key, least in AT_LEAST.items():
    if config.get(key) is not None and config[key] < least:
      raise ValueError(f"--{key.replace('_', '-')} must be at least {least}, got {config[key]}")
  if not (math.isfinite(config["lr"]) and config["lr"] > 0):
    raise ValueError(f"--lr must be a finite positive number, got {config['lr']}")
  if not 0 <= config["seed"] < 2**63:
    raise ValueError(f"--seed must be an integer in 0..2^63-1, got {config['seed']}")
  name = config.get("run_name")
  if name is not None and not RUN_NAME.fullmatch(name):
    suggestion = re.sub(r"[^A-Za-z0-9._+-]+", "_", name).strip("._+-") or "run1"
    raise ValueError(f"--run-name {name!r} must be one folder name (letters, digits and . _ + -, not starting with "
                     f". _ + -), e.g. {suggestion}")
  boundary = parse_boundary(config["fwd"], config["bwd"], num_examples=1)  # fail early on a bad spec
  buffers = config["aqsgd_buffers"]
  if buffers != "device" and not isinstance(boundary.fwd, AQSGD):
    raise ValueError(f"--aqsgd-buffers {buffers} holds AQ-SGD tables, but the forward spec {config['fwd']!r} keeps "
                     "none; use an aqsgd+ spec or leave the buffers on the device")
  if buffers != "device" and config["executor"] != "simulate":
    raise ValueError(f"--aqsgd-buffers {buffers} needs --executor simulate; the {config['executor']} executor "
                     "keeps AQ-SGD tables on the stage devices")
  if config.get("init_epoch") and not config.get("init_from"):
    raise ValueError(f"preset {args.preset!r} warm-starts from a baseline after {config['init_epoch']} epochs: "
                     "run the baseline preset first and pass its folder with --init-from")
  specs = "__".join(config[k] for k in ("fwd", "bwd", "bottleneck") if config.get(k))
  config.setdefault("run_name", args.preset or re.sub(r"[^A-Za-z0-9.+-]+", "_", specs))
  config.setdefault("out", str(pathlib.Path("runs") / exp.name))
  return config


def check_executor_flags(config: dict):
  """The executor's flags go together, and a batch splits into data shards x microbatches."""
  shards, m = config["data_parallel"], config["microbatches"]
  if config["executor"] == "simulate":
    given = [f"--{k.replace('_', '-')} {config[k]}" for k in ("schedule", "grad_compression", "data_parallel")
             if config[k] != RUN_DEFAULTS[k]]
    if given:
      raise ValueError(f"{' and '.join(given)} need{'s' if len(given) == 1 else ''} --executor gpipe (the simulate "
                       "executor runs every stage in one program on one device): add --executor gpipe")
  if config["batch_size"] % (shards * m):
    raise ValueError(f"--batch-size {config['batch_size']} does not split into {shards} data shard(s) x "
                     f"--microbatches {m} equal microbatches; use a multiple of {shards * m} (e.g. --batch-size "
                     f"{max(1, config['batch_size'] // (shards * m)) * shards * m}) or other --microbatches")


def executor_for(config: dict, num_stages: int):
  """simulate or a GPipe (its flags checked now). AQ-SGD tables off the device get their executor from
  `hostbuffer.HostBuffered.for_pipeline` in `run`, once their folder is locked (it creates them)."""
  if config["executor"] == "simulate":
    return simulate.Simulate()
  grad = config["grad_compression"]
  return sharded.ShardedExecutor(sharded.make_mesh(num_stages, config["data_parallel"]),
                     parse_scheme(grad) if grad else None, schedule=config["schedule"])


def check_folder(path, flag: str):
  """`path` is a folder, or can be made one: its nearest existing ancestor is a folder we may write.

  Checked before anything is created; a folder the OS still refuses is named by `run_lock`."""
  path = pathlib.Path(path)
  existing = next(p for p in [path, *path.parents] if p.exists() or p == pathlib.Path(p.anchor or "."))
  if not existing.is_dir():
    where = "" if existing == path else f" ({existing} is a file)"
    raise ValueError(f"{flag} {path} is not a folder{where}; pass a folder (it is created if missing)")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ValueError(f"{flag} {path}: cannot write in {existing} (permission denied); pass a folder you can write")


def check_specs_fit(config: dict, pipe, batch):
  """Initialises the model and runs each boundary's compression abstractly (`jax.eval_shape`: nothing
  is allocated, run or compiled), so a spec that does not fit the model's activations fails now,
  naming the flag. (Whether AQ-SGD tables fit is checked once their size is printed.)"""
  for x in pipeline.activation_shapes(pipe, batch):
    for flag in ("fwd", "bwd"):
      scheme = getattr(pipe.boundary, flag)
      try:
        if not isinstance(scheme, Reuse):
          jax.eval_shape(lambda x: scheme.codec(x, jax.random.key(0)), x)
      except ValueError as err:
        raise ValueError(f"--{flag} {config[flag]} does not fit this model's boundary activations "
                         f"{x.dtype.name}{list(x.shape)}: {err}") from None


def check_devices(config: dict, command: str):
  """The gpipe executor needs stages x data-parallel devices; on CPU, says how to fake them."""
  needed = config["stages"] * config["data_parallel"]
  have = jax.devices()
  if config["executor"] == "gpipe" and len(have) < needed:
    hint = (f"; on CPU, make fake devices: XLA_FLAGS=--xla_force_host_platform_device_count={needed} "
            f"{command} ... (or use --executor simulate)" if have[0].platform == "cpu" else "")
    raise ValueError(f"--executor gpipe needs {needed} devices ({config['stages']} stages x "
                     f"{config['data_parallel']} data-parallel), found {len(have)} {have[0].platform}{hint}")


def check_batch_size(batch_size: int, train_examples: int, eval_examples: int):
  """Each split must hold at least one batch (the last partial batch is dropped)."""
  for split, n, flag in (("training", train_examples, "--train-examples"), ("evaluation", eval_examples,
                                                                           "--eval-examples")):
    if batch_size > n:
      raise ValueError(f"--batch-size {batch_size} is larger than the {split} set ({n} examples); use "
                       f"--batch-size {n} or less, or a larger {flag}")


def check_run_folder(config: dict, run_dir: pathlib.Path):
  """--resume needs this run's checkpoints, a new run must have none, --init-from needs the
  baseline's epoch; checked before anything is created."""
  saved = train.saved_epochs(run_dir / "ckpt")
  if config.get("resume") and not saved:
    raise ValueError(f"--resume: run {config['run_name']!r} has no checkpoint in {run_dir / 'ckpt'}; check --out and "
                     "--run-name, or start the run without --resume")
  if saved and not config.get("resume"):
    raise ValueError(f"run {config['run_name']!r} already has checkpoints in {run_dir / 'ckpt'} (epochs {saved}); "
                     "add --resume to continue it, or give this run another --run-name (nothing was overwritten)")
  if config.get("resume"):
    unreadable = train.unreadable_epochs(run_dir / "ckpt")
    if len(unreadable) == len(saved):
      raise ValueError(corrupt_checkpoint_advice(config, run_dir, checkpoint.CorruptCheckpointError(
          f"no intact checkpoint in {run_dir / 'ckpt'} (epochs {saved}): " + "; ".join(unreadable.values()))))
  if config.get("init_epoch") and not config.get("resume"):
    baseline = pathlib.Path(config["init_from"]) / "ckpt"
    epochs = train.saved_epochs(baseline)
    if not epochs:
      raise ValueError(f"--init-from {config['init_from']}: no checkpoints in {baseline}; pass the folder of a "
                       "baseline run (runs/<experiment>/<run name>)")
    if config["init_epoch"] not in epochs:
      raise ValueError(f"--init-from {config['init_from']} has checkpoints of epochs {epochs}, not of --init-epoch "
                       f"{config['init_epoch']}; pass one of those or train the baseline further")
    unreadable = train.unreadable_epochs(baseline)
    if config["init_epoch"] in unreadable:
      raise ValueError(corrupt_checkpoint_advice(config, run_dir, checkpoint.CorruptCheckpointError(
          unreadable[config["init_epoch"]])))


def check_resumed_config(config: dict, results_file: pathlib.Path):
  """A resumed run must keep its configuration (except RESUMABLE fields): names what changed."""
  try:
    before = results.read(results_file)["config"]
  except ValueError as err:  # missing or damaged: the run rewrites it after its next epoch
    print(f"note: {results_file} is {'missing' if not results_file.exists() else err}, so the resumed configuration "
          "cannot be compared with the original")
    return
  before = {**RUN_DEFAULTS, **before}  # results written before a default was stored used it
  changed = [f"{k} {before.get(k)!r} -> {config.get(k)!r}" for k in sorted(set(before) | set(config))
             if k not in RESUMABLE and before.get(k) != config.get(k)]
  if changed:
    raise ValueError(f"--resume with a changed configuration ({'; '.join(changed)}); resume with the original "
                     "values, or start a new run with another --run-name")


@contextlib.contextmanager
def run_lock(folder, change: str, flag: str):
  """`lock.FolderLock` of `folder` for a run of one or more processes: process 0 holds it for all
  (on a shared file system the others would find it taken); every process raises
  FolderInUseError when another run holds it, ValueError naming `flag` when the OS refuses it."""
  held, error = lock.FolderLock(folder, change), None
  if distributed.is_main_process():
    try:
      held.acquire()
    except lock.FolderInUseError as err:
      error = err
    except OSError as err:
      error = ValueError(f"{flag}: cannot create {err.filename or held.path} ({err.strerror}); pass {flag} a folder "
                         "you can write")
  if not distributed.main_process_value(error is None):
    raise error or lock.FolderInUseError(f"{folder} is in use by another run (see process 0's error)")
  try:
    yield held
  finally:
    held.release()


def run(exp: Experiment, config: dict):
  """Builds, checks everything it can before creating anything, trains and writes results after every
  epoch. Returns (state, history)."""
  out = pathlib.Path(config["out"])
  run_dir = out / config["run_name"]
  check_devices(config, f"python -m experiments.{exp.name}")
  check_executor_flags(config)
  check_folder(out, "--out")
  buffers = config["aqsgd_buffers"]
  if buffers not in ("device", "host"):
    check_folder(buffers, "--aqsgd-buffers")
  check_run_folder(config, run_dir)
  pipe, optimizer, data, initial_params = exp.build(config)
  executor = executor_for(config, pipe.num_stages)
  check_specs_fit(config, pipe, data.example_batch)
  serializable = {k: v for k, v in config.items() if isinstance(v, (int, float, str, bool, type(None)))}
  serializable["data"] = data.name
  if config.get("resume"):
    check_resumed_config(serializable, out / "results" / f"{config['run_name']}.json")

  def write(history):  # after every epoch: the results files and the run's plot
    results.write(out / "results", config["run_name"], serializable, history)
    plots.run_figure(out / "results" / f"{config['run_name']}.png", config["run_name"], history)

  init_from = (str(pathlib.Path(config["init_from"]).resolve() / "ckpt"), config["init_epoch"]) \
      if config.get("init_epoch") else None
  cfg = train.RunConfig(epochs=config["epochs"], steps=config.get("steps"),
                        warmup_epochs=config["warmup_epochs"],
                        checkpoint_dir=str((run_dir / "ckpt").resolve()), resume=config.get("resume", False),
                        init_from=init_from, progress=not config.get("no_progress", False))
  with contextlib.ExitStack() as locks:  # one run per run folder and per AQ-SGD table folder
    held = locks.enter_context(run_lock(run_dir, "--run-name or --out", "--out"))
    if buffers not in ("device", "host"):
      locks.enter_context(run_lock(pathlib.Path(buffers).resolve(), "--aqsgd-buffers DIR", "--aqsgd-buffers"))
    print(f"[{exp.name}] run {config['run_name']}: data = {data.name}; fwd {config['fwd']}, bwd {config['bwd']}; "
          f"{pipe.num_stages} stages x {pipe.microbatches} microbatches on {jax.devices()[0].platform}")
    print(f"[{exp.name}] configuration (recipe {config['recipe']} < preset {config.get('preset')} < flags): "
          + ", ".join(f"{k}={v}" for k, v in sorted(serializable.items()) if k not in ("data", "recipe", "preset")))
    if held.stale_pid is not None:
      print(f"note: took over the stale lock of run {config['run_name']!r} left by process {held.stale_pid}, "
            "which is not running")
    if buffers != "device":
      executor = hostbuffer.HostBuffered.for_pipeline(pipe, data.example_batch, None if buffers == "host" else buffers)
      print(executor.tables.summary)
    elif isinstance(pipe.boundary.fwd, AQSGD):
      print(hostbuffer.device_summary(pipe, data.example_batch))  # train.fit's init_state checks that they fit
    try:
      state, history = train.fit(pipe, optimizer, executor, data, cfg,
                                 jax.random.key(config["seed"]), on_epoch=write, initial_params=initial_params)
    except checkpoint.CorruptCheckpointError as err:
      raise ValueError(corrupt_checkpoint_advice(config, run_dir, err)) from None
  if history:
    last = history[-1]
    print(json.dumps({k: last[k] for k in ("epoch", "train_loss", "eval_off", "eval_on", "wire_bytes_fwd",
                                           "wire_bytes_bwd", "steps_per_s")}))
    print(f"results: {out / 'results' / config['run_name']}.json/.csv/.md, plot: "
          f"{out / 'results' / config['run_name']}.png")
  return state, history


def compile_run(exp: Experiment, config: dict) -> dryrun.DryRun:
  """--compile-for: the run's train and eval steps compiled for the target, reported; nothing trained or written."""
  target = targets.target(config["compile_for"])
  check_executor_flags(config)
  pipe, optimizer, batch, assumed = exp.abstract(config)
  check_specs_fit(config, pipe, batch)
  grad = config["grad_compression"]
  plan = dryrun.Plan(config["executor"], config["data_parallel"],
                     config["schedule"], parse_scheme(grad) if grad else None,
                     "device" if config["aqsgd_buffers"] == "device" else "host")
  print(f"[{exp.name}] --compile-for {target.name}: run {config['run_name']}; fwd {config['fwd']}, bwd {config['bwd']}; "
        f"{pipe.num_stages} stages x {pipe.microbatches} microbatches; batch "
        + ", ".join(f"{k} {tuple(v.shape)} {v.dtype}" for k, v in batch.items()) + (f"; {assumed}" if assumed else ""))
  report = dryrun.compile_for(target, pipe, optimizer, batch, plan, ("train",) if config.get("train_only") else
                              ("train", "eval"))
  print(report.text())
  return report


def corrupt_checkpoint_advice(config: dict, run_dir: pathlib.Path, err: checkpoint.CorruptCheckpointError) -> str:
  """What to do when every checkpoint a run would start from is corrupt (an older intact one is taken, with a
  warning)."""
  if config.get("resume"):
    return (f"--resume: {err}; nothing intact to resume from: move {run_dir} away (or delete it) and start the run "
            "again without --resume, or start it under another --run-name")
  return (f"--init-from {config['init_from']}: {err}; train the baseline again, or warm-start from another "
          "--init-epoch it saved")


def one_line_warning(message, category, filename, lineno, file=None, line=None):
  """`warnings.showwarning` for the CLIs: jaxcomp's own warnings as one `warning:` line, others as usual."""
  if pathlib.Path(filename).resolve().is_relative_to(pathlib.Path(train.__file__).resolve().parent):
    print("warning: " + " ".join(str(message).split()), file=file or sys.stderr)
  else:
    (file or sys.stderr).write(warnings.formatwarning(message, category, filename, lineno, line))


def main(exp: Experiment, argv=None):
  args = parser_for(exp).parse_args(argv)
  with warnings.catch_warnings():
    warnings.showwarning = one_line_warning
    try:
      if args.list_presets:
        print(preset_table(exp, args))
        return None
      if args.train_only and not args.compile_for:
        raise ValueError("--train-only chooses what --compile-for compiles; add --compile-for TARGET")
      if args.compile_for:
        targets.prepare_host(targets.target(args.compile_for))  # before any backend starts
        if not compile_run(exp, resolve(exp, args)).fits:
          sys.exit(1)
        return None
      distributed.initialize(args.coordinator, args.num_processes, args.process_id)
      return run(exp, resolve(exp, args))
    except (ValueError, OSError, RuntimeError, train.NonFiniteLossError, lock.FolderInUseError) as err:  # fixable
      sys.exit("error: " + " ".join(str(err).split()))
