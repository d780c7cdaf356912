"""A run's configuration: one frozen, typed value, built once from recipe < preset < flags.

An experiment declares its recipes (named defaults), its presets (paper row -> overrides) and its
own settings (`Experiment.options`, a frozen dataclass); every other setting is one of the sections
below. `resolve` layers them: `RUN_DEFAULTS`, the recipe, the preset, then the flags given (by name:
the CLI's, or a benchmark's keyword arguments), checks the result (`checks.check_choices`) and types
it into a `RunConfig`. A setting's name is its flag's (`--batch-size` is `batch_size`) and names one
field of one section.

Results files keep the configuration flat, as `RunConfig.record` gives it: every setting that the
defaults, the recipe, the preset or a flag gave, in that order (a setting nobody gave is left out);
a resumed run compares its record with the one its results file holds (`check_resumed_config`).
`executor_config` reads the executor settings into a typed `executors.Config` (the one place --executor's name
is read) and `executor_for` builds it (`executors.make_executor`).
"""
import dataclasses
import functools
import pathlib
import re
from typing import Any, Callable

from experiments import checks
from jaxcomp import pipeline
from jaxcomp.compress.spec import parse_scheme
from jaxcomp.parallel import executors, schedules
from jaxcomp.runtime import results


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExecutorConfig:
  """Where the stages run and how a batch is split (--executor, --schedule, --data-parallel, ...)."""
  executor: str = "simulate"  # simulate: every stage on one device; sharded: stage s on device s (`EXECUTORS`)
  schedule: str = "gpipe"  # the sharded executor's tick schedule (`schedules.SCHEDULES`, or interleaved:V)
  overlap: bool = False  # overlapped sends: each message crosses its link while the stages compute the next tick
  data_parallel: int = 1  # replicas of the pipeline (sharded)
  aqsgd_buffers: str = "device"  # AQ-SGD tables on the device, in host memory ("host") or memory-mapped (a folder)
  grad_compression: str | None = None  # the data-parallel weight-gradient exchange's scheme (None: the dense mean)
  stages: int  # stage devices
  microbatches: int  # per batch (per data shard)

  @functools.cached_property
  def pipeline_schedule(self) -> schedules.Schedule:
    """--schedule and --overlap as the typed schedule the sharded executor runs (read once)."""
    return schedules.parse(self.schedule, self.overlap)

  @property
  def model_stages(self) -> int:
    """The stages the model is cut into: one per stage device, V per device with --schedule interleaved:V."""
    return self.pipeline_schedule.model_stages(self.stages)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompressionConfig:
  """What crosses the stage boundaries (--fwd, --bwd, --warmup-epochs, --bottleneck)."""
  fwd: str
  bwd: str
  warmup_epochs: int = 0  # epochs sent dense first (AQ-SGD fills its buffers)
  bottleneck: str | None = None  # a learned rank-R projection at every boundary (GPT-2)
  tied_compression: str | None = None  # the tied parameters' gradient exchange's scheme (None: dense, exact)
  untie_embeddings: bool = False  # GPT-2's head starts as a copy of the embedding and trains on its own


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingConfig:
  """The optimisation's length, seed, batch and learning rate, and its warm start."""
  epochs: int
  steps: int | None = None  # stop after this many steps in total
  seed: int
  batch_size: int  # the global batch
  lr: float
  init_epoch: int | None = None  # warm start from the baseline's checkpoint of this epoch ...
  init_from: str | None = None  # ... in this run folder
  eval_every: int | None = None  # also evaluate every this many steps and after the last (`train.RunConfig`)
  target_loss: float | None = None  # record the first evaluated step whose eval loss (compression on) is <= this
  stop_at_target: bool = False  # and end the run there


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
  """How much of the data a run uses (None: all of it)."""
  train_examples: int | None = None
  eval_examples: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class OutputConfig:
  """Where results and checkpoints go, and whether the run continues an earlier one."""
  out: str | None = None  # runs/<experiment> (set by `resolve`)
  run_name: str | None = None  # the preset, else the specs (set by `resolve`)
  resume: bool = False
  no_progress: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchConfig:
  """How this process takes part: multi-process start-up, or a dry run for an accelerator target."""
  coordinator: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  compile_for: str | None = None
  train_only: bool = False  # a dry run compiles the train step alone


SECTIONS = {"executor": ExecutorConfig, "compression": CompressionConfig, "training": TrainingConfig,
            "data": DataConfig, "output": OutputConfig, "launch": LaunchConfig}
# what a run uses where neither its recipe, its preset nor a flag says otherwise: every results file records
# these, first, in this order
RUN_DEFAULTS = {name: field.default for name in ("executor", "schedule", "data_parallel", "aqsgd_buffers",
                                                  "warmup_epochs", "grad_compression", "bottleneck",
                                                  "tied_compression", "untie_embeddings")
                for section in SECTIONS.values() for field in dataclasses.fields(section) if field.name == name}
# may change when a run is resumed: where and how long it runs is not what it computes (overlapped sends
# and every schedule give the same numbers bitwise; the stage devices may change with the schedule as long as
# the model keeps its stages, --stages x V: `check_resumed_config`)
RESUMABLE = ("epochs", "steps", "resume", "no_progress", "out", "coordinator", "num_processes", "process_id",
             "compile_for", "train_only", "overlap", "schedule", "stages", "target_loss", "stop_at_target")

@dataclasses.dataclass(frozen=True)
class Experiment:
  """What an experiment declares; `build` and `abstract` read a `RunConfig`."""
  name: str
  recipes: dict  # recipe name (e.g. "paper", "tiny") -> defaults
  default_recipe: str
  presets: dict  # preset name -> overrides
  build: Callable  # RunConfig -> (Pipeline, optimizer, train.Data, initial params or None)
  abstract: Callable  # RunConfig -> (Pipeline, optimizer, batch, assumption): no data read (dry runs)
  options: type  # its own settings: a frozen dataclass, `RunConfig.options`
  flags: dict = dataclasses.field(default_factory=dict)  # their flags: name -> (group, help, argparse kwargs)
  paper_row: Callable = lambda preset: ""  # preset name -> the paper's row it reproduces (--list-presets)


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """One run's every setting, typed and grouped; `record` is the flat form results files keep."""
  recipe: str
  preset: str | None
  executor: ExecutorConfig
  compression: CompressionConfig
  training: TrainingConfig
  data: DataConfig
  output: OutputConfig
  launch: LaunchConfig
  options: Any  # the experiment's own settings (`Experiment.options`)
  recorded: tuple[str, ...] = ()  # the settings given, in the order they were given (`record`)

  def settings(self) -> dict[str, Any]:
    """Every setting by name (the flags' names), recipe and preset included."""
    out = {"recipe": self.recipe, "preset": self.preset}
    for part in (*SECTIONS, "options"):
      value = getattr(self, part)
      out.update({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    return out

  def record(self) -> dict[str, Any]:
    """The settings given (`recorded`), by name, as results files keep them."""
    settings = self.settings()
    return {name: settings[name] for name in self.recorded}


def typed(options: type, choices: dict) -> RunConfig:
  """The RunConfig of flat `choices` (names as the flags'); a name no section or `options` has is a ValueError."""
  parts = {**SECTIONS, "options": options}
  owner = {f.name: part for part, kind in parts.items() for f in dataclasses.fields(kind)}
  unknown = [name for name in choices if name not in owner and name not in ("recipe", "preset")]
  if unknown:
    raise ValueError(f"unknown settings {unknown}; a setting is one of {sorted(owner)}")
  values = {part: {} for part in parts}
  for name, value in choices.items():
    if name in owner:
      values[owner[name]][name] = value
  built = {part: kind(**values[part]) for part, kind in parts.items()}
  return RunConfig(choices["recipe"], choices.get("preset"), **built, recorded=tuple(choices))


def layered(exp: Experiment, recipe: str | None = None, preset: str | None = None, **flags) -> dict:
  """RUN_DEFAULTS, updated by the recipe, then the preset, then the flags given (None and False are not
  given), flat and unchecked, in that order."""
  choices = {**RUN_DEFAULTS, **exp.recipes[recipe or exp.default_recipe], **(exp.presets[preset] if preset else {})}
  given = {"preset": preset, "recipe": recipe, **flags}
  choices.update({k: v for k, v in given.items() if v is not None and v is not False})
  choices.setdefault("recipe", exp.default_recipe)
  return choices


def resolve(exp: Experiment, recipe: str | None = None, preset: str | None = None, **flags) -> RunConfig:
  """recipe < preset < flags (`layered`), checked (`checks.check_choices`: ranges, the compression specs, the
  settings that go together), with the run name and output folder defaulted, typed."""
  if preset is not None and preset not in exp.presets:
    raise ValueError(f"unknown preset {preset!r}; valid presets: {', '.join(exp.presets)}")
  choices = layered(exp, recipe, preset, **flags)
  checks.check_choices(choices, preset)
  specs = "__".join(choices[k] for k in ("fwd", "bwd", "bottleneck") if choices.get(k))
  choices.setdefault("run_name", preset or re.sub(r"[^A-Za-z0-9.+-]+", "_", specs))
  choices.setdefault("out", str(pathlib.Path("runs") / exp.name))
  run = typed(exp.options, choices)
  executor_config(run.executor, run.training.batch_size)  # settings that do not go together: refused now
  return run


EXECUTORS = ("simulate", "sharded")  # --executor's choices
EXECUTOR_ALIASES = {"gpipe": "sharded"}  # --executor's names before: still taken, recorded as the name now


def executor_name(text: str) -> str:
  """--executor's value as an executor's name (`EXECUTORS`; "gpipe", the sharded executor's name before the
  schedules had names, is "sharded"); a ValueError naming the choices otherwise."""
  name = EXECUTOR_ALIASES.get(text, text)
  if name not in EXECUTORS:
    raise ValueError(f"--executor must be one of {list(EXECUTORS)}, got {text!r}")
  return name


def executor_config(settings: ExecutorConfig, batch_size: int | None = None) -> executors.Config:
  """The executor the settings name, typed: the one place --executor's name (and --aqsgd-buffers' device | host |
  DIR) is read. simulate: `SimulateConfig`, or with AQ-SGD tables off the device `HostBufferedConfig` for batches
  of `batch_size`; sharded: `ShardedConfig` (its stages x data mesh, the typed schedule, the data-parallel
  exchange's scheme). A ValueError names the settings that do not go together, and the fix."""
  buffers = settings.aqsgd_buffers
  if executor_name(settings.executor) == "simulate":
    defaults = {f.name: f.default for f in dataclasses.fields(settings)}
    flag = lambda k: f"--{k.replace('_', '-')}" + ("" if isinstance(defaults[k], bool) else f" {getattr(settings, k)}")
    given = [flag(k) for k in ("schedule", "overlap", "grad_compression", "data_parallel")
             if getattr(settings, k) != defaults[k]]
    if given:
      raise ValueError(f"{' and '.join(given)} need{'s' if len(given) == 1 else ''} --executor sharded (the simulate "
                       "executor runs every stage in one program on one device): add --executor sharded")
    if buffers == "device":
      return executors.SimulateConfig()
    return executors.HostBufferedConfig(batch_size=batch_size, directory=None if buffers == "host" else buffers)
  if buffers != "device":
    raise ValueError(f"--aqsgd-buffers {buffers} needs --executor simulate; the sharded executor keeps AQ-SGD tables "
                     "on the stage devices")
  grad = settings.grad_compression
  return executors.ShardedConfig(stages=settings.stages, data_parallel=settings.data_parallel,
                                 schedule=settings.pipeline_schedule, grad_scheme=parse_scheme(grad) if grad else None)


def executor_for(settings: ExecutorConfig, devices=None, batch_size: int | None = None) -> pipeline.Executor:
  """The executor the settings name (`executor_config`), on `devices` (default: this process's; a dry run's
  compile-only ones)."""
  return executors.make_executor(executor_config(settings, batch_size), devices)


def check_resumed_config(record: dict, results_file: pathlib.Path):
  """A resumed run must keep its configuration (except RESUMABLE settings): names what changed. Results
  written before a default was stored ran with it (RUN_DEFAULTS fill them)."""
  try:
    before = results.read(results_file)["config"]
  except ValueError as err:  # missing or damaged: the run rewrites it after its next epoch
    print(f"note: {results_file} is {'missing' if not results_file.exists() else err}, so the resumed configuration "
          "cannot be compared with the original")
    return
  before = {**RUN_DEFAULTS, **before}
  # a record of the executor's name before (gpipe) compares as its name now
  before, record = ({**r, "executor": executor_name(r["executor"])} for r in (before, record))
  changed = [f"{k} {before.get(k)!r} -> {record.get(k)!r}" for k in sorted(set(before) | set(record))
             if k not in RESUMABLE and before.get(k) != record.get(k)]
  model_stages = lambda r: r.get("stages") and schedules.parse(r["schedule"]).model_stages(r["stages"])
  if model_stages(before) != model_stages(record):
    changed.append(f"the model's stages (--stages x V of --schedule interleaved:V) {model_stages(before)} -> "
                   f"{model_stages(record)}")
  if changed:
    raise ValueError(f"--resume with a changed configuration ({'; '.join(changed)}); resume with the original "
                     "values, or start a new run with another --run-name")
