"""An experiment's command line: its flags, --list-presets, --compile-for, and errors as one `error:` line.

An experiment module calls `main(EXPERIMENT)`; its flags become a `config.RunConfig` (`config_from_args`:
recipe < preset < flags, printed before training) that `runner.run` trains or `compile_run` compiles for an
accelerator. Library code says what is so (a report, an error); this module says which flags would change it.
"""
import argparse
import dataclasses
import json
import pathlib
import sys
import warnings

from experiments import checks, config, runner
from jaxcomp import pipeline
from jaxcomp.analysis import dryrun, targets
from jaxcomp.compress.spec import parse_boundary
from jaxcomp.parallel import executors, memory, schedules, simulate
from jaxcomp.runtime import distributed, lock, train

GROUPS = {  # --help's argument groups: key -> title
    "compression": "compression (what crosses the stage boundaries)",
    "training": "model and training",
    "parallel": "parallelism and multi-host (SLURM, Open MPI and Cloud TPU pods are detected without the "
                "multi-process flags)",
    "tied": "tied parameters (GPT-2's embedding on the first stage and its head on the last: their gradient "
            "exchange each step)",
    "data": "data",
    "output": "output and resume",
}
COMMON_FLAGS = {  # flag -> (group, type, help); defaults come from the recipe
    "fwd": ("compression", str, "forward (activation) compression spec, e.g. quant:4, topk:0.1, aqsgd+topk:0.5"),
    "bwd": ("compression", str, "backward (gradient) compression spec, e.g. quant:8, reuse"),
    "warmup_epochs": ("compression", int, "epochs sent uncompressed first (AQ-SGD fills its buffers)"),
    "grad_compression": ("compression", str,
                         "compress data-parallel weight gradients, e.g. ef+quant:4 (sharded; dense in warm-up)"),
    "tied_compression": ("tied", str, "compress the tied parameters' gradient exchange with a data-parallel gradient "
                         "scheme, e.g. ef+maxabs:4:group=64: each end sends C(g + e), both apply the same sum of "
                         "the two decoded messages (every train step, warm-up included)"),
    "epochs": ("training", int, "training epochs"),
    "steps": ("training", int, "stop after this many steps in total (short runs)"),
    "seed": ("training", int, "random seed (init, data order, stochastic rounding)"),
    "batch_size": ("training", int, "global batch size"),
    "lr": ("training", float, "peak learning rate"),
    "init_epoch": ("training", int, "warm start from the baseline's checkpoint after this many epochs (baseN)"),
    "eval_every": ("training", int, "also evaluate (compression on and off) after every N steps and after the last"),
    "target_loss": ("training", float, "record the first evaluated step whose eval loss with compression on is <= L "
                    "(results' target: its step, or the best loss seen)"),
    "stages": ("parallel", int, "pipeline stages"),
    "microbatches": ("parallel", int, "GPipe microbatches per batch (per data shard)"),
    "data_parallel": ("parallel", int, "data-parallel replicas (sharded executor)"),
    "train_examples": ("data", int, "use only the first N training examples (quick runs)"),
    "eval_examples": ("data", int, "use only the first N evaluation examples"),
}
UNSET_MEANS = {"steps": "every epoch's", "train_examples": "all", "eval_examples": "all", "eval_every": "epoch ends",
               "target_loss": "none", "lr_steps": "every epoch's steps",
               "grad_compression": "none, the dense mean", "bottleneck": "none",
               "tied_compression": "none, the dense exchange"}  # --help's words for None
# settings that change what a step sends, not the shapes of what it sends (--list-presets traces a shape once)
COMPRESSION_KEYS = ("preset", "fwd", "bwd", "warmup_epochs", "init_epoch", "grad_compression", "tied_compression")


def recipe_default(exp: config.Experiment, key: str) -> str:
  """' (default: V)' from the recipes (' (default: V; W with --recipe R)' where they differ), '' if none sets it;
  where the default recipe does not set it, V is RUN_DEFAULTS', the experiment's own (`exp.options`) or UNSET_MEANS'
  words ('(W with --recipe R)' without any)."""
  values = {name: recipe[key] for name, recipe in exp.recipes.items() if key in recipe}
  default = values.get(exp.default_recipe)
  if default is None:
    own = {f.name: f.default for f in dataclasses.fields(exp.options) if f.default is not dataclasses.MISSING}
    default = next((v for v in (config.RUN_DEFAULTS.get(key), own.get(key), UNSET_MEANS.get(key)) if v is not None),
                   None)
  others = [f"{v} with --recipe {name}" for name, v in values.items() if v != default and (v is not None or
                                                                                           default is not None)]
  if default is None:
    return f" ({'; '.join(others)})" if others else ""
  return f" (default: {'; '.join([str(default), *others])})"


def parser_for(exp: config.Experiment) -> argparse.ArgumentParser:
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
  groups["training"].add_argument("--stop-at-target", action="store_true",
                                  help="end the run at the first evaluated step that reaches --target-loss")
  groups["tied"].add_argument("--untie-embeddings", action="store_true",
                              help="GPT-2: the head starts as a copy of the embedding (pretrained weights load into "
                                   "both) and then trains on its own: no tied exchange")
  parallel = groups["parallel"]
  parallel.add_argument("--executor", type=config.executor_name, choices=config.EXECUTORS,
                        help="simulate: every stage on one device; sharded: stage s on device s (gpipe, its name "
                             "before, is still taken)" + recipe_default(exp, "executor"))
  parallel.add_argument("--schedule", metavar="{" + ",".join(schedules.SCHEDULES) + ",interleaved:V}",
                        help="the sharded executor's tick schedule: gpipe, 1f1b (at most S microbatch inputs per stage), "
                             "1f1b-fused (at most 2S-1, fewer ticks), zb-h1 (1F1B with the weight gradients "
                             "deferred into the bubbles: about a third of its bubble, S inputs on every stage) or "
                             "interleaved:V (interleaved 1F1B: the model cut into --stages x V stages, V per device "
                             "round-robin; bubble (S-1)/(VM+S-1); --microbatches a multiple of --stages)"
                             + recipe_default(exp, "schedule"))
  parallel.add_argument("--overlap", action="store_true",
                        help="overlapped sends (sharded executor, every --schedule): each boundary message crosses its link while the "
                             "stages compute the next tick, decoded where it is used; S-1 more ticks each way, needs "
                             "--microbatches >= 2 x --stages; the same numbers")
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


def flags_of(args: argparse.Namespace) -> dict:
  """The settings the command line gives (recipe and preset apart), in the parser's order."""
  return {k: v for k, v in vars(args).items() if k not in ("recipe", "preset", "list_presets")}


def config_from_args(exp: config.Experiment, args: argparse.Namespace) -> config.RunConfig:
  """recipe < preset < flags, checked and typed (`config.resolve`)."""
  return config.resolve(exp, args.recipe, args.preset, **flags_of(args))


def preset_table(exp: config.Experiment, args: argparse.Namespace) -> str:
  """--list-presets: each preset's specs, the bytes one train step sends over all boundaries with the
  recipe and flags given (traced abstractly: no data read), and the paper's row it reproduces."""
  dense, shapes = {}, {}  # per run shape (settings but what is sent): fp32 bytes, boundary shapes
  lines = [f"{'preset':22s} {'fwd':24s} {'bwd':16s} {'fwd B/step':>11s} {'bwd B/step':>11s} {'fewer':>6s}  "
           "paper row (and what else the preset sets)"]
  for name in exp.presets:
    choices = config.layered(exp, args.recipe, name, **flags_of(args))
    shape_key = json.dumps({k: v for k, v in choices.items() if k not in COMPRESSION_KEYS}, sort_keys=True, default=str)
    if shape_key not in shapes:
      pipe, _, batch, _ = exp.abstract(config.typed(exp.options, {**choices, "fwd": "none", "bwd": "none"}))
      shapes[shape_key] = (pipe.microbatches, pipeline.activation_shapes(pipe, batch))
      dense[shape_key] = simulate.wire_bytes_per_step(pipe, batch)["fwd"]
    m, activations = shapes[shape_key]
    boundary = parse_boundary(choices["fwd"], choices["bwd"], num_examples=1)
    sent = [boundary.wire_bytes(a.shape, a.dtype) for a in activations]
    fwd, bwd = m * sum(f for f, _ in sent), m * sum(b for _, b in sent)
    extra = [f"first {choices['warmup_epochs']} epoch(s) dense"] if choices.get("warmup_epochs") else []
    extra += [f"warm start after {choices['init_epoch']} baseline epochs"] if choices.get("init_epoch") else []
    lines.append(f"{name:22s} {choices['fwd']:24s} {choices['bwd']:16s} {fwd:11,d} {bwd:11,d} "
                 f"{2 * dense[shape_key] / (fwd + bwd):5.1f}x  {exp.paper_row(name)}"
                 + (f" ({'; '.join(extra)})" if extra else ""))
  recipe = args.recipe or exp.default_recipe
  lines.append(f"bytes per train step over all {len(activations)} boundaries with --recipe {recipe} and the flags "
               "given (dense warm-up epochs send fp32); fewer: fp32 bytes both ways / the preset's")
  return "\n".join(lines)


def fit_advice(report: dryrun.DryRun, cfg: config.RunConfig) -> list[str]:
  """Flags that would lower the peak of a run that does not fit, from what the report says."""
  out, chosen = [], config.executor_config(cfg.executor, cfg.training.batch_size)
  if report.aqsgd_table_bytes > report.target.chip.hbm_bytes / 4:
    out.append(f"--aqsgd-buffers host (the AQ-SGD tables take {report.aqsgd_table_bytes / 2**30:.1f} GiB per device;"
               " host buffers need --executor simulate)")
  if isinstance(chosen, executors.SimulateConfig) and report.target.devices > 1:
    out.append(f"--executor sharded (each of the {report.target.devices} chips holds its stage only)")
  if isinstance(chosen, executors.ShardedConfig):
    if isinstance(chosen.schedule, schedules.GPipe):
      out.append("--schedule 1f1b (a stage stashes at most S-s microbatch inputs, not M)")
    out.append("more --stages (fewer blocks per chip), or more --microbatches (smaller activations per tick)")
  out.append("a smaller --batch-size")
  return out


def dry_run_text(report: dryrun.DryRun, cfg: config.RunConfig) -> str:
  """The report, with the flags that would help a run that does not fit."""
  return report.text(fit_advice(report, cfg))


def compile_run(exp: config.Experiment, cfg: config.RunConfig) -> dryrun.DryRun:
  """--compile-for: the run's train and eval steps compiled for the target, reported; nothing trained or written."""
  target = targets.target(cfg.launch.compile_for)
  checks.check_executor(cfg)
  pipe, optimizer, batch, assumed = exp.abstract(cfg)
  checks.check_specs_fit(cfg, pipe, batch)
  executor = config.executor_for(cfg.executor, targets.compile_only_devices(target), cfg.training.batch_size)
  print(f"[{exp.name}] --compile-for {target.name}: run {cfg.output.run_name}; fwd {cfg.compression.fwd}, bwd "
        f"{cfg.compression.bwd}; {pipe.num_stages} stages x {pipe.microbatches} microbatches; batch "
        + ", ".join(f"{k} {tuple(v.shape)} {v.dtype}" for k, v in batch.items()) + (f"; {assumed}" if assumed else ""))
  report = dryrun.compile_for(target, executor, pipe, optimizer, batch,
                              ("train",) if cfg.launch.train_only else ("train", "eval"))
  print(dry_run_text(report, cfg))
  return report


def one_line_warning(message, category, filename, lineno, file=None, line=None):
  """`warnings.showwarning` for the CLIs: jaxcomp's own warnings as one `warning:` line, others as usual."""
  if pathlib.Path(filename).resolve().is_relative_to(pathlib.Path(train.__file__).resolve().parent):
    print("warning: " + " ".join(str(message).split()), file=file or sys.stderr)
  else:
    (file or sys.stderr).write(warnings.formatwarning(message, category, filename, lineno, line))


def main(exp: config.Experiment, argv=None, hooks=()):
  """The experiment's command line: `argv` (default sys.argv) run, or compiled with --compile-for; `hooks`
  (`hooks.Hook`s) go to the training driver."""
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
        if not compile_run(exp, config_from_args(exp, args)).fits:
          sys.exit(1)
        return None
      distributed.initialize(args.coordinator, args.num_processes, args.process_id)
      return runner.run(exp, config_from_args(exp, args), hooks)
    except memory.TablesDoNotFit as err:  # AQ-SGD tables on the device: the CLI can keep them in host memory
      sys.exit("error: " + " ".join(str(err).split()) + " (CLI: --aqsgd-buffers host|DIR)")
    except (ValueError, OSError, RuntimeError, ImportError, train.NonFiniteLossError,
            lock.FolderInUseError) as err:  # fixable (ImportError: an optional extra not installed)
      sys.exit("error: " + " ".join(str(err).split()))
