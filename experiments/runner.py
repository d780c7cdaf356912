"""A run of an experiment: checked, built, trained under its folder's lock, its results written after every epoch."""
import contextlib
import dataclasses
import json
import pathlib

import jax

from experiments import checks, config, plots
from jaxcomp.compress.schemes import AQSGD
from jaxcomp.parallel import executors, hostbuffer
from jaxcomp.runtime import checkpoint, distributed, evaluation, lock, logfilter, results, train


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


def run(exp: config.Experiment, cfg: config.RunConfig, hooks=()):
  """Builds, checks everything it can before creating anything, trains (`hooks`: `hooks.Hook`s for the driver) and
  writes results after every epoch. Returns (state, history)."""
  logfilter.silence_orbax_noise()  # its checkpoints would repeat two harmless Orbax warnings per epoch and resume
  out = pathlib.Path(cfg.output.out)
  name = cfg.output.run_name
  run_dir = out / name
  chosen = config.executor_config(cfg.executor, cfg.training.batch_size)
  checks.check_devices(cfg, chosen.devices_needed, f"python -m experiments.{exp.name}")
  checks.check_executor(cfg)
  checks.check_folder(out, "--out")
  host_tables = isinstance(chosen, executors.HostBufferedConfig)
  table_folder = chosen.directory if host_tables else None  # None: host memory (or no host tables)
  if table_folder:
    checks.check_folder(table_folder, "--aqsgd-buffers")
  checks.check_run_folder(cfg, run_dir)
  pipe, optimizer, data, initial_params = exp.build(cfg)
  executor = executors.make_executor(chosen)
  checks.check_specs_fit(cfg, pipe, data.example_batch)
  record = {k: v for k, v in cfg.record().items() if isinstance(v, (int, float, str, bool, type(None)))}
  record["data"] = data.name
  if cfg.output.resume:
    config.check_resumed_config(record, out / "results" / f"{name}.json")

  training = cfg.training
  target = (lambda history: {"target": evaluation.target_summary(history, training.target_loss)}) \
      if training.target_loss is not None else (lambda history: {})

  def write(history):  # after every epoch: the results files and the run's plot
    results.write(out / "results", name, record, history, **target(history))
    plots.run_figure(out / "results" / f"{name}.png", name, history)

  init_from = (str(pathlib.Path(training.init_from).resolve() / "ckpt"), training.init_epoch) \
      if training.init_epoch else None
  driver = train.RunConfig(epochs=training.epochs, steps=training.steps, warmup_epochs=cfg.compression.warmup_epochs,
                           checkpoint_dir=str((run_dir / "ckpt").resolve()), resume=cfg.output.resume,
                           init_from=init_from, progress=not cfg.output.no_progress, eval_every=training.eval_every,
                           target_loss=training.target_loss, stop_at_target=training.stop_at_target)
  with contextlib.ExitStack() as locks:  # one run per run folder and per AQ-SGD table folder
    held = locks.enter_context(run_lock(run_dir, "--run-name or --out", "--out"))
    if table_folder:
      locks.enter_context(run_lock(pathlib.Path(table_folder).resolve(), "--aqsgd-buffers DIR", "--aqsgd-buffers"))
    print(f"[{exp.name}] run {name}: data = {data.name}; fwd {cfg.compression.fwd}, bwd {cfg.compression.bwd}; "
          f"{pipe.num_stages} stages x {pipe.microbatches} microbatches on {jax.devices()[0].platform}")
    print(f"[{exp.name}] configuration (recipe {cfg.recipe} < preset {cfg.preset} < flags): "
          + ", ".join(f"{k}={v}" for k, v in sorted(record.items()) if k not in ("data", "recipe", "preset")))
    if held.stale_pid is not None:
      print(f"note: took over the stale lock of run {name!r} left by process {held.stale_pid}, which is not running")
    if host_tables:
      tables = hostbuffer.HostTables.for_pipeline(pipe, data.example_batch, table_folder)
      executor = dataclasses.replace(executor, tables=tables)
      print(tables.summary)
    elif isinstance(pipe.boundary.fwd, AQSGD):
      print(hostbuffer.device_summary(pipe, data.example_batch))  # train.fit's init_state checks that they fit
    try:
      state, history = train.fit(pipe, optimizer, executor, data, driver, jax.random.key(training.seed),
                                 on_epoch=write, initial_params=initial_params, hooks=hooks)
    except checkpoint.CorruptCheckpointError as err:
      raise ValueError(checks.corrupt_checkpoint_advice(cfg, run_dir, err)) from None
  if history:
    last = history[-1]
    print(json.dumps({k: last[k] for k in ("epoch", "train_loss", "eval_off", "eval_on", "wire_bytes_fwd",
                                           "wire_bytes_bwd", "steps_per_s")}))
    for summary in target(history).values():
      print(f"target eval loss {summary['loss']:g} (compression on): "
            + (f"reached at step {summary['step']}" if summary["step"] is not None else
               f"not reached in {last['step']} steps; best {summary['best_loss']:.4f} at step {summary['best_step']}")
            + f" ({summary['evaluated']} evaluated steps)")
    print(f"results: {out / 'results' / name}.json/.csv/.md, plot: {out / 'results' / name}.png")
  return state, history
