"""The training driver every experiment shares: epochs, evaluation, checkpoints, resume.

Per epoch: train with a progress bar (AQ-SGD warm-up epochs in Mode.WARMUP), evaluate with
compression on and off, record loss/metrics, bytes on the wire (per compressed step, the
epoch's total and the run's average per step) and steps/s, save
an Orbax checkpoint, hand the history to `on_epoch` (results writing). A NaN/Inf loss, or a step
that returns NaN/Inf parameters, stops the run at once with `NonFiniteLossError`; the last good
checkpoint is never overwritten, and an epoch whose evaluation loss is NaN/Inf is not
checkpointed (its record is written, then the run stops the same way). A checkpoint holds the
executor's own state (each process writes its own shards) and restores into the simulate layout
(`checkpoint`), so a run resumes or warm-starts from one of any executor, mesh shape or process
count; resume takes the newest intact checkpoint, warning about corrupt newer ones.
The evaluation schedule (`RunConfig.eval_every`, `target_loss`, `stop_at_target`): `evaluation`.

Resume restores the latest checkpoint; data order, keys and every state continue exactly,
also from an epoch that `RunConfig.steps` cut short (its checkpoint records how many of the
epoch's batches were done and their losses; the resumed run finishes that epoch).

AQ-SGD first visits (Algorithm 1): a batch holding an example that no step has sent yet (one
dropped with an epoch's last partial batch, or any batch when warmup_epochs=0) runs as a
Mode.FIRST_VISIT step: its activations go dense and m(xi) = a, its gradients stay
compressed. `FirstVisits` tracks which examples were sent (replayed from the data order on
resume), and their bytes are counted.

The executor is a `pipeline.Executor`: `simulate.Simulate`, a `sharded.ShardedExecutor` or a
`hostbuffer.HostBuffered` (AQ-SGD tables in host memory). For the last, a train step with
`takes_next_ids` is called step(state, batch, next_ids) with the next batch's ids in the epoch
(None after its last), so it can prefetch, and the executor's `host_state` (numpy arrays outside
the TrainState) is saved with every checkpoint and restored in place on resume.

Multi-process (`distributed.initialize`): every process runs `fit` with the same data; an
executor with a `mesh` gets each batch as a global array of which each process transfers only
its own data shards' rows; checkpoints are written by all processes together, each its own
shards; `on_epoch`
(results files) and the progress bar run on process 0 only.
"""
import dataclasses
import itertools
import math
import pathlib
import re
import time
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp import pipeline
from jaxcomp.compress.boundary import Mode
from jaxcomp.compress.schemes import AQSGD
from jaxcomp.runtime import checkpoint, distributed, evaluation
from jaxcomp.runtime.hooks import Hook
from jaxcomp.runtime.checkpoint import Checkpointer


class NonFiniteLossError(RuntimeError):
  """The training loss, or the parameters a step returns, became NaN or Inf."""


@jax.jit
def all_finite(tree) -> jax.Array:
  """Whether every entry of every array in `tree` is finite (a model can drop a NaN input from its loss,
  e.g. in a max-pool, while its gradient still carries it into the parameters)."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


@dataclasses.dataclass(frozen=True)
class Data:
  """What the driver needs from a dataset.

  train_batches(epoch): that epoch's batches (dicts of numpy arrays) in an order fixed by
  the seed and the epoch (checkpoints are taken at epoch ends, so resuming needs no more);
  eval_batches(): the evaluation set; eval_summary(means) -> metrics derives corpus-level
  metrics (e.g. perplexity) from the batch-weighted means.
  """
  train_batches: Callable[[int], Iterator[dict]]
  steps_per_epoch: int
  eval_batches: Callable[[], Iterator[dict]]
  example_batch: dict
  name: str = ""
  eval_summary: Callable[[dict], dict] = dict


@dataclasses.dataclass(frozen=True)
class RunConfig:
  epochs: int
  steps: int | None = None  # stop after this many steps in total (short runs)
  warmup_epochs: int = 0  # AQ-SGD: epochs sent uncompressed while buffers fill
  checkpoint_dir: str | None = None
  resume: bool = False
  init_from: tuple[str, int] | None = None  # (baseline checkpoint dir, epoch): warm start
  progress: bool = True
  eval_every: int | None = None  # also evaluate after every this many steps and after the last (`evaluation`)
  target_loss: float | None = None  # the eval loss (compression on) whose first evaluated step is recorded
  stop_at_target: bool = False  # end the run at that step

  def __post_init__(self):
    if self.epochs < 1:
      raise ValueError(f"epochs must be >= 1, got {self.epochs}")
    if self.steps is not None and self.steps < 1:
      raise ValueError(f"steps must be >= 1, got {self.steps}")
    if self.eval_every is not None and self.eval_every < 1:
      raise ValueError(f"eval_every must be >= 1, got {self.eval_every}")
    if self.target_loss is not None and not math.isfinite(self.target_loss):
      raise ValueError(f"target_loss must be a finite number, got {self.target_loss}")
    if self.stop_at_target and self.target_loss is None:
      raise ValueError("stop_at_target needs a target_loss")


class FirstVisits:
  """Which training examples AQ-SGD has already sent in full (m(xi) holds their activation).

  A batch with an unsent example runs as a Mode.FIRST_VISIT step: its activations go dense
  (a message has one static shape, so the whole batch's), so m(xi) = a at both ends; its
  gradients stay compressed. Every step sends all of its batch's examples, so after it they
  are all seen. The set is the driver's: resume rebuilds it from the data order.
  """

  def __init__(self, pipe: pipeline.Pipeline):
    fwd = pipe.boundary.fwd
    self.seen = np.zeros(fwd.num_examples, bool) if isinstance(fwd, AQSGD) else None

  def mode(self, epoch_mode: Mode, ids) -> Mode:
    """The mode of a step on examples `ids` in an epoch of `epoch_mode`: FIRST_VISIT in a
    compressed epoch if any of them is a first visit."""
    if epoch_mode is Mode.TRAIN and self.seen is not None and not self.seen[np.asarray(ids)].all():
      return Mode.FIRST_VISIT
    return epoch_mode

  def sent(self, ids):
    if self.seen is not None:
      self.seen[np.asarray(ids)] = True


def _with_next(batches):
  """(batch, the batch after it or None) pairs."""
  batches = iter(batches)
  current = next(batches, None)
  while current is not None:
    following = next(batches, None)
    yield current, following
    current = following


def _step_arguments(step, batch, following, place) -> tuple:
  """What `step` takes after the state: the placed batch, plus the next batch's ids for steps that prefetch
  (`takes_next_ids`)."""
  if getattr(step, "takes_next_ids", False):
    return place(batch), None if following is None else following["id"]
  return (place(batch),)


def batch_placement(executor) -> Callable[[dict], dict]:
  """How batches reach an executor: split over its mesh's data axis when its mesh spans
  processes (each process transfers its own shards), else as they are."""
  if executor.mesh is None or jax.process_count() == 1:
    return lambda batch: batch
  return lambda batch: distributed.global_batch(batch, executor.mesh)


def _last_good(ckpt) -> str:
  last = ckpt.latest_epoch() if ckpt else None
  return f"Last good checkpoint: {f'epoch {last} in {ckpt.directory}' if last is not None else 'none'}"


def _step_mode(visits: FirstVisits, epoch_mode: Mode, batch) -> Mode:
  """The step's mode (dense for first visits); marks the batch's examples as sent."""
  if "id" not in batch:
    return epoch_mode
  mode = visits.mode(epoch_mode, batch["id"])
  visits.sent(batch["id"])
  return mode


def saved_epochs(checkpoint_dir) -> list[int]:
  """The epochs checkpointed in `checkpoint_dir`, oldest first; [] (and nothing created) if it is absent.

  Whether it exists is process 0's answer (`distributed.main_process_value`): all processes agree."""
  if not distributed.main_process_value(pathlib.Path(checkpoint_dir).is_dir()):
    return []
  ckpt = Checkpointer(checkpoint_dir)
  try:
    return sorted(ckpt.epochs())
  finally:
    ckpt.close()


def unreadable_epochs(checkpoint_dir) -> dict[int, str]:
  """{epoch: why} for each checkpoint in `checkpoint_dir` whose meta does not read back, newest first: the
  check a run makes before it starts (arrays are checked against their checksums when restored)."""
  if not distributed.main_process_value(pathlib.Path(checkpoint_dir).is_dir()):
    return {}
  ckpt, bad = Checkpointer(checkpoint_dir), {}
  try:
    for epoch in sorted(ckpt.epochs(), reverse=True):
      try:
        ckpt.meta(epoch)
      except checkpoint.CorruptCheckpointError as err:
        bad[epoch] = str(err)
    return bad
  finally:
    ckpt.close()


def first_sentence(err: Exception) -> str:
  """The error's first sentence (Orbax appends advice that does not apply to a wrong warm start)."""
  return re.split(r"(?<=\.)\s", str(err).strip(), maxsplit=1)[0]


def warm_start(state, directory, epoch: int):
  """(state with the model of the checkpoint of `epoch` in `directory`, epoch): a "baseN" start.

  A missing folder or epoch, an unfinished epoch, or a model of another shape is a ValueError.
  """
  epochs = saved_epochs(directory)
  if epoch not in epochs:
    raise ValueError(f"warm start: no checkpoint of epoch {epoch} in {directory} (saved epochs: {epochs or 'none'}); "
                     "train the baseline run that far first, or pass an epoch it saved")
  baseline = Checkpointer(directory)
  try:
    state, meta = baseline.restore(epoch, state, model_only=True)
  except (ValueError, TypeError, KeyError) as err:  # Orbax: the saved tree or shapes differ from this model's
    raise ValueError(f"warm start: the checkpoint of epoch {epoch} in {directory} holds a different model "
                     f"({first_sentence(err)}); warm-start from a run of "
                     "the same model (size/width, stages, vocabulary)") from None
  finally:
    baseline.close()
  if meta.get("epoch_losses"):
    raise ValueError(f"the checkpoint of epoch {epoch} in {directory} holds an unfinished epoch "
                     f"({len(meta['epoch_losses'])} of its batches); warm-start from a finished one")
  return state, epoch


@dataclasses.dataclass
class Run:
  """What a run carries from epoch to epoch (`start` makes it; `run_epoch` and `record` advance it)."""
  pipe: pipeline.Pipeline
  optimizer: Any
  executor: pipeline.Executor
  data: Data
  cfg: RunConfig
  state: pipeline.TrainState
  history: list
  start_epoch: int
  done_losses: list  # of the first epoch to run, when a resumed run is inside it
  ckpt: Checkpointer | None
  visits: FirstVisits
  global_step: int
  wire: dict  # bytes per step, per Mode
  eval_steps: dict  # with compression on (True) and off (False)
  place: Callable[[dict], dict]  # how a batch reaches the executor (`batch_placement`)
  done_evals: list = dataclasses.field(default_factory=list)  # of `done_losses`' steps (`RunConfig.eval_every`)
  reached: int | None = None  # the first evaluated step at or below `RunConfig.target_loss`
  steps: dict = dataclasses.field(default_factory=dict)  # compiled train steps, per Mode
  hooks: tuple[Hook, ...] = ()  # called in order at each event

  def call_hooks(self, event: str, *args):
    for hook in self.hooks:
      getattr(hook, event)(self, *args)

  def epoch_mode(self, epoch: int) -> Mode:
    return Mode.WARMUP if epoch < self.cfg.warmup_epochs else Mode.TRAIN

  def evaluate(self) -> dict:
    """{"step", "eval_on", "eval_off"}: the model now, evaluated with compression on and off."""
    data = self.data
    evaluated = {"step": self.global_step}
    for way, compressed in (("on", True), ("off", False)):
      self.call_hooks("before_evaluate", compressed)
      evaluated[f"eval_{way}"] = evaluation.evaluate(self.eval_steps[compressed], self.state, data.eval_batches(),
                                                     data.eval_summary, self.place)
    return evaluated

  def note(self, evaluated: dict):
    """An evaluated step (of the schedule): `reached` if it is the first to reach the target."""
    if self.reached is None and evaluation.reaches(evaluated, self.cfg.target_loss):
      self.reached = evaluated["step"]

  def finished(self) -> bool:
    """Whether the run is over before its last epoch: its `steps` done, or its target reached with
    `stop_at_target`."""
    cfg = self.cfg
    return (cfg.steps is not None and self.global_step >= cfg.steps) or (cfg.stop_at_target and
                                                                        self.reached is not None)


class EpochResult(NamedTuple):
  losses: list  # every step's loss of the epoch (resumed ones included)
  evals: list  # the epoch's scheduled evaluations (`RunConfig.eval_every`; resumed ones included)
  sent: dict  # bytes sent in the epoch, each way
  dense_steps: int  # warm-up and AQ-SGD first-visit steps (activations sent dense)
  steps_per_s: float | None  # steady-state steps (the compiling step excluded)


def start(pipe: pipeline.Pipeline, optimizer, executor: pipeline.Executor, data: Data, cfg: RunConfig, rng,
          initial_params=None) -> Run:
  """The run's state at its first epoch: fresh, warm-started from `cfg.init_from`, or resumed."""
  state = executor.init_state(pipe, optimizer, rng, data.example_batch, initial_params)
  saved = saved_epochs(cfg.checkpoint_dir) if cfg.checkpoint_dir else []
  if cfg.resume and not saved:
    raise ValueError(f"nothing to resume: no checkpoint in {cfg.checkpoint_dir}; start the run without resume")
  if saved and not cfg.resume:
    raise ValueError(f"{cfg.checkpoint_dir} already holds checkpoints (epochs {saved}); resume the run "
                     "or give the new run another name/folder (nothing was overwritten)")
  history, start_epoch, done_losses = [], 0, []
  # what checkpoints are restored into: the simulate layout's shapes (traced: nothing is gathered)
  like = jax.eval_shape(lambda s: executor.unstack(pipe, optimizer, s, data.example_batch), state)
  from_layout = lambda saved: checkpoint.executor_layout(executor, pipe, optimizer, saved, data.example_batch, state)
  if cfg.init_from and not cfg.resume:  # before this run's checkpoint folder exists: a failure leaves none
    restored, start_epoch = warm_start(like, *cfg.init_from)
    state = from_layout(restored)
  ckpt = Checkpointer(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
  if cfg.resume:
    epoch, restored, meta = ckpt.restore_latest(like, executor.host_state)
    saved_ties, ties = meta.get("ties", pipeline.ties(pipe)), pipeline.ties(pipe)  # older checkpoints: unrecorded
    if saved_ties != ties:
      changed = "; ".join(f"{k} {saved_ties.get(k)} -> {v}" for k, v in ties.items() if saved_ties.get(k) != v)
      raise ValueError(f"the checkpoint of epoch {epoch} in {cfg.checkpoint_dir} was saved by a run with other tied "
                       f"parameters ({changed}); resume with the same ties and tied exchange (copies that trained "
                       "apart cannot be tied again)")
    state = from_layout(restored)
    history, start_epoch = meta["history"], meta["epoch"]
    done_losses = meta.get("epoch_losses", [])
    if cfg.eval_every:  # the last step of an earlier, shorter run is off this run's evaluation schedule
      history = evaluation.on_schedule(history, cfg.eval_every)
  visits = FirstVisits(pipe)
  if cfg.resume and visits.seen is not None:  # examples sent in finished epochs, from the data order
    for epoch in range(start_epoch):
      for batch in data.train_batches(epoch):
        visits.sent(batch["id"])
  wire = {m: executor.wire_bytes_per_step(pipe, data.example_batch, m) for m in (Mode.TRAIN, Mode.WARMUP,
                                                                                 Mode.FIRST_VISIT)}
  eval_steps = {c: executor.make_eval_step(pipe, c) for c in (True, False)}
  run = Run(pipe, optimizer, executor, data, cfg, state, history, start_epoch, done_losses, ckpt, visits,
            int(state.step), wire, eval_steps, batch_placement(executor))
  for evaluated in evaluation.evaluations(history):
    run.note(evaluated)
  if done_losses and not run.finished():  # that epoch's record is redone when the epoch is finished
    run.done_evals, run.history = history[-1].get("evals", []), history[:-1]
  return run


def run_epoch(run: Run, epoch: int) -> EpochResult:
  """Trains one epoch (the rest of it after a resume inside it), advancing `run.state`; stops with
  NonFiniteLossError at a step whose loss or new parameters are not finite."""
  from tqdm.auto import tqdm  # here, not at import: dry runs and benchmarks import this module without tqdm
  cfg, data, mode, main = run.cfg, run.data, run.epoch_mode(epoch), distributed.is_main_process()
  losses, run.done_losses = run.done_losses, []
  evals, run.done_evals = run.done_evals, []
  skip = len(losses)
  sent, dense_steps = {k: 0 for k in run.wire[mode]}, 0

  def count(step_mode):
    nonlocal dense_steps
    dense_steps += step_mode.dense_forward
    for k, v in run.wire[step_mode].items():
      sent[k] += v

  for batch in itertools.islice(data.train_batches(epoch), skip):  # this epoch's steps before a resume
    count(_step_mode(run.visits, mode, batch))
  todo = data.steps_per_epoch - skip
  if cfg.steps is not None:
    todo = min(todo, cfg.steps - run.global_step)
  desc = f"epoch {epoch + 1}/{cfg.epochs}"
  # the first step (compiling when the step is new) runs under its own status line, outside the
  # bar, so the bar's rate and ETA count only steady-state steps
  bar, timed_steps, begin, evaluating = None, 0, None, 0.0  # evaluating: seconds spent in scheduled evaluations
  batches = _with_next(itertools.islice(data.train_batches(epoch), skip, skip + todo))
  for i, (batch, following) in enumerate(batches, start=skip):
    step_start = time.perf_counter()
    step_mode = _step_mode(run.visits, mode, batch)
    if bar is None:
      compiling = step_mode not in run.steps
      bar = tqdm(desc=f"{desc}: compiling the train step" if compiling else desc, bar_format="{desc} ({elapsed})",
                 disable=not (cfg.progress and main), leave=False)
    if step_mode not in run.steps:
      run.steps[step_mode] = run.executor.make_train_step(run.pipe, run.optimizer, step_mode)
    step = run.steps[step_mode]
    args = _step_arguments(step, batch, following, run.place)
    run.call_hooks("before_step", step_mode, step, args)
    run.state, metrics = step(run.state, *args)
    count(step_mode)
    loss = float(metrics["loss"])
    if not (math.isfinite(loss) and bool(all_finite(run.state.params))):
      bar.close()
      what = f"training loss is {loss}" if not math.isfinite(loss) else (
          f"training loss is {loss:.6g} but the step's new parameters hold NaN/Inf (from the batch or the gradients)")
      raise NonFiniteLossError(f"{what} at epoch {epoch + 1}, step {i + 1} of the epoch (global step "
                               f"{run.global_step + 1}); stopped. {_last_good(run.ckpt)}")
    losses.append(loss)
    run.global_step += 1
    if begin is None:
      begin = time.perf_counter()
      bar.close()
      bar = tqdm(total=data.steps_per_epoch, initial=i + 1, disable=not (cfg.progress and main), leave=False,
                 desc=f"{desc} (compiled in {begin - step_start:.1f} s)" if compiling else desc)
    else:
      timed_steps += 1
      bar.update(1)
    bar.set_postfix(loss=f"{loss:.4f}")
    if evaluation.due(run.global_step, cfg.eval_every):
      eval_start = time.perf_counter()
      evals.append(run.evaluate())
      run.note(evals[-1])
      evaluating += time.perf_counter() - eval_start
      eval_losses = [evals[-1][k].get("loss", 0.0) for k in ("eval_on", "eval_off")]
      bar.set_postfix(loss=f"{loss:.4f}", eval_on=f"{eval_losses[0]:.4f}")
      if run.finished() or not all(map(math.isfinite, eval_losses)):  # a diverged evaluation: `record` stops the run
        break
  elapsed = time.perf_counter() - begin - evaluating if begin is not None else 0.0
  if bar is not None:
    bar.close()
  return EpochResult(losses, evals, sent, dense_steps, timed_steps / elapsed if timed_steps and elapsed > 0 else None)


def record(run: Run, epoch: int, result: EpochResult, on_epoch=None, last: bool = False):
  """Evaluates with compression on and off (unless a scheduled evaluation just did), appends the epoch's record to
  the history, checkpoints (unless an evaluation diverged: then NonFiniteLossError after `on_epoch`), calls
  `on_epoch`. `last`: the run ends with this epoch, so its evaluation is a scheduled one (`RunConfig.eval_every`)."""
  mode, data, losses, evals = run.epoch_mode(epoch), run.data, result.losses, list(result.evals)
  if evals and evals[-1]["step"] == run.global_step:
    now = evals[-1]
  else:
    now = run.evaluate()
    if not run.cfg.eval_every or last:  # an evaluated step of the run (`evaluation`)
      run.note(now)
    if run.cfg.eval_every and last:
      evals.append(now)
  entry = {
      "epoch": epoch + 1, "step": run.global_step, "mode": mode.value, "epoch_batches": len(losses),
      "train_loss": float(np.mean(losses)) if losses else float("nan"),
      "eval_on": now["eval_on"], "eval_off": now["eval_off"],
      **{f"wire_bytes_{k}": v for k, v in run.wire[mode].items()},
      "dense_steps": result.dense_steps,  # warm-up and AQ-SGD first-visit steps (activations sent dense)
      **{f"epoch_wire_bytes_{k}": v for k, v in result.sent.items()},
      "steps_per_s": result.steps_per_s,
      **({"evals": evals} if run.cfg.eval_every else {}),
  }
  run.history.append(entry)
  total_steps = sum(r["epoch_batches"] for r in run.history)
  for k in result.sent:  # the run so far: warm-up epochs and first visits included
    entry[f"avg_wire_bytes_per_step_{k}"] = sum(r[f"epoch_wire_bytes_{k}"] for r in run.history) / max(total_steps, 1)
  eval_losses = [entry[k].get("loss", 0.0) for k in ("eval_on", "eval_off")]
  diverged = not all(math.isfinite(v) for v in [entry["train_loss"], *eval_losses])
  if run.ckpt and not diverged:
    finished = len(losses) == data.steps_per_epoch
    position = {"epoch": epoch + 1} if finished else {"epoch": epoch, "epoch_losses": losses}
    run.call_hooks("before_checkpoint")
    run.ckpt.save(epoch + 1, run.state, {**position, "history": run.history, "ties": pipeline.ties(run.pipe)},
                  run.executor.host_state,
                  run.executor.rows_description(run.pipe, run.optimizer, data.example_batch))
    run.call_hooks("after_checkpoint")
  if on_epoch and distributed.is_main_process():
    on_epoch(run.history)
  if diverged:
    raise NonFiniteLossError(f"epoch {epoch + 1} ends with train loss {entry['train_loss']}, evaluation losses "
                             f"{eval_losses}; stopped without checkpointing it. {_last_good(run.ckpt)}")


def fit(pipe: pipeline.Pipeline, optimizer, executor: pipeline.Executor, data: Data, cfg: RunConfig, rng,
        on_epoch: Callable[[list[dict]], Any] | None = None, initial_params=None, hooks=()):
  """Trains `pipe` (from `initial_params`, e.g. pretrained, if given); returns (state, history).

  `on_epoch(history)` runs on process 0 only; `hooks` (`Hook`s) run on every process."""
  run = start(pipe, optimizer, executor, data, cfg, rng, initial_params)
  run.hooks = tuple(hooks)
  try:
    for epoch in range(run.start_epoch, cfg.epochs):
      if run.finished():
        break
      result = run_epoch(run, epoch)
      record(run, epoch, result, on_epoch, last=epoch == cfg.epochs - 1 or run.finished())
  finally:  # steps that hold resources (a host-buffered step's prefetch thread) release them, however the run ends
    for step in run.steps.values():
      if hasattr(step, "close"):
        step.close()
  if run.ckpt:
    run.ckpt.close()
  run.call_hooks("after_fit")
  return run.state, run.history
