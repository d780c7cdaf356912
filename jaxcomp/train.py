"""The training driver every experiment shares: epochs, evaluation, checkpoints, resume.

Per epoch: train with a progress bar (AQ-SGD warm-up epochs in Mode.WARMUP), evaluate with
compression on and off, record loss/metrics, bytes on the wire (per compressed step, the
epoch's total and the run's average per step) and steps/s, save
an Orbax checkpoint, hand the history to `on_epoch` (results writing). A NaN/Inf loss stops
the run at once with `NonFiniteLossError`; the last good checkpoint is never overwritten.
Resume restores the latest checkpoint; data order, keys and every state continue exactly,
also from an epoch that `RunConfig.steps` cut short (its checkpoint records how many of the
epoch's batches were done and their losses; the resumed run finishes that epoch).

AQ-SGD first visits (Algorithm 1): a batch holding an example that no step has sent yet (one
dropped with an epoch's last partial batch, or any batch when warmup_epochs=0) runs as a
Mode.WARMUP step: its activations go dense and m(xi) = a. `FirstVisits` tracks which
examples were sent (replayed from the data order on resume), and their bytes are counted.

The executor is `simulate`, a `gpipe.GPipe` or `hostbuffer.HostBuffered`; two optional hooks
serve the last (AQ-SGD tables in host memory): a train step with `takes_next_ids` is called
step(state, batch, next_ids) with the next batch's ids in the epoch (None after its last), so
it can prefetch; an executor's `host_state` (numpy arrays outside the TrainState) is saved
with every checkpoint and restored in place on resume.
"""
import dataclasses
import itertools
import math
import time
from typing import Any, Callable, Iterator

import numpy as np
from tqdm.auto import tqdm

from jaxcomp import pipeline as pl
from jaxcomp.boundary import Mode
from jaxcomp.feedback import AQSGD
from jaxcomp.checkpoint import Checkpointer


class NonFiniteLossError(RuntimeError):
  """The training loss became NaN or Inf."""


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

  def __post_init__(self):
    if self.epochs < 1:
      raise ValueError(f"epochs must be >= 1, got {self.epochs}")
    if self.steps is not None and self.steps < 1:
      raise ValueError(f"steps must be >= 1, got {self.steps}")


class FirstVisits:
  """Which training examples AQ-SGD has already sent in full (m(xi) holds their activation).

  A batch with an unsent example must run as a dense (Mode.WARMUP) step; every step sends
  all of its batch's examples at least once, so after it they are all seen.
  """

  def __init__(self, pipe: pl.Pipeline):
    fwd = pipe.boundary.fwd
    self.seen = np.zeros(fwd.num_examples, bool) if isinstance(fwd, AQSGD) else None

  def mode(self, epoch_mode: Mode, ids) -> Mode:
    """The mode of a step on examples `ids`: dense if any of them is a first visit."""
    if self.seen is not None and not self.seen[np.asarray(ids)].all():
      return Mode.WARMUP
    return epoch_mode

  def sent(self, ids):
    if self.seen is not None:
      self.seen[np.asarray(ids)] = True


def evaluate(eval_step, state, batches, summary: Callable[[dict], dict] = dict) -> dict:
  """summary(metrics averaged over the evaluation set, weighted by batch size)."""
  totals, count = {}, 0
  for batch in batches:
    n = len(next(iter(batch.values())))
    for k, v in eval_step(state, batch).items():
      totals[k] = totals.get(k, 0.0) + float(v) * n
    count += n
  return summary({k: v / count for k, v in totals.items()})


def _with_next(batches):
  """(batch, the batch after it or None) pairs."""
  batches = iter(batches)
  current = next(batches, None)
  while current is not None:
    following = next(batches, None)
    yield current, following
    current = following


def _train_step(step, state, batch, following):
  """step(state, batch), plus the next batch's ids for steps that prefetch (`takes_next_ids`)."""
  if getattr(step, "takes_next_ids", False):
    return step(state, batch, None if following is None else following["id"])
  return step(state, batch)


def _step_mode(visits: FirstVisits, epoch_mode: Mode, batch) -> Mode:
  """The step's mode (dense for first visits); marks the batch's examples as sent."""
  if "id" not in batch:
    return epoch_mode
  mode = visits.mode(epoch_mode, batch["id"])
  visits.sent(batch["id"])
  return mode


def fit(pipe: pl.Pipeline, optimizer, executor, data: Data, cfg: RunConfig, rng,
        on_epoch: Callable[[list[dict]], Any] | None = None, initial_params=None):
  """Trains `pipe` (from `initial_params`, e.g. pretrained, if given); returns (state, history)."""
  state = executor.init_state(pipe, optimizer, rng, data.example_batch, initial_params)
  host_state = getattr(executor, "host_state", None)
  ckpt = Checkpointer(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
  history, start_epoch = [], 0
  if ckpt and not cfg.resume and ckpt.latest_epoch() is not None:
    raise ValueError(f"{cfg.checkpoint_dir} already holds checkpoints (epochs {ckpt.epochs()}); resume the run "
                     "or give the new run another name/folder (nothing was overwritten)")
  done_losses = []  # of the first epoch to run, when a resumed run is inside it
  if cfg.resume and ckpt and ckpt.latest_epoch() is not None:
    state, meta = ckpt.restore(ckpt.latest_epoch(), state, host_state=host_state)
    history, start_epoch = meta["history"], meta["epoch"]
    done_losses = meta.get("epoch_losses", [])
    if done_losses:
      history = history[:-1]  # that epoch's record is redone when the epoch is finished
  elif cfg.init_from:
    directory, epoch = cfg.init_from
    baseline = Checkpointer(directory)
    state, meta = baseline.restore(epoch, state, model_only=True)
    baseline.close()
    if meta.get("epoch_losses"):
      raise ValueError(f"the checkpoint of epoch {epoch} in {directory} holds an unfinished epoch "
                       f"({len(meta['epoch_losses'])} of its batches); warm-start from a finished one")
    start_epoch = epoch
  wire = {m: executor.wire_bytes_per_step(pipe, data.example_batch, m) for m in (Mode.TRAIN, Mode.WARMUP)}
  steps = {}
  eval_steps = {c: executor.make_eval_step(pipe, c) for c in (True, False)}
  global_step = int(state.step)
  epoch_mode = lambda epoch: Mode.WARMUP if epoch < cfg.warmup_epochs else Mode.TRAIN
  visits = FirstVisits(pipe)
  if cfg.resume and visits.seen is not None:  # examples sent in finished epochs, from the data order
    for epoch in range(start_epoch):
      for batch in data.train_batches(epoch):
        visits.sent(batch["id"])
  for epoch in range(start_epoch, cfg.epochs):
    if cfg.steps is not None and global_step >= cfg.steps:
      break
    mode = epoch_mode(epoch)
    losses, done_losses = done_losses, []
    skip = len(losses)
    sent, dense_steps = {k: 0 for k in wire[mode]}, 0

    def count(step_mode):
      nonlocal dense_steps
      dense_steps += step_mode is Mode.WARMUP
      for k, v in wire[step_mode].items():
        sent[k] += v

    for batch in itertools.islice(data.train_batches(epoch), skip):  # this epoch's steps before a resume
      count(_step_mode(visits, mode, batch))
    todo = data.steps_per_epoch - skip
    if cfg.steps is not None:
      todo = min(todo, cfg.steps - global_step)
    bar = tqdm(total=data.steps_per_epoch, initial=skip, desc=f"epoch {epoch + 1}/{cfg.epochs}",
               disable=not cfg.progress, leave=False)
    timed_steps, start = 0, None
    batches = _with_next(itertools.islice(data.train_batches(epoch), skip, skip + todo))
    for i, (batch, following) in enumerate(batches, start=skip):
      step_mode = _step_mode(visits, mode, batch)
      if step_mode not in steps:
        steps[step_mode] = executor.make_train_step(pipe, optimizer, step_mode)
      state, metrics = _train_step(steps[step_mode], state, batch, following)
      count(step_mode)
      loss = float(metrics["loss"])
      if not math.isfinite(loss):
        bar.close()
        last = ckpt.latest_epoch() if ckpt else None
        raise NonFiniteLossError(
            f"training loss is {loss} at epoch {epoch + 1}, step {i + 1} of the epoch (global step "
            f"{global_step + 1}); stopped. Last good checkpoint: "
            f"{f'epoch {last} in {cfg.checkpoint_dir}' if last is not None else 'none'}")
      losses.append(loss)
      global_step += 1
      if start is None:
        start = time.perf_counter()  # the first step compiles: not timed
      else:
        timed_steps += 1
      bar.update(1)
      bar.set_postfix(loss=f"{loss:.4f}")
    elapsed = time.perf_counter() - start if start is not None else 0.0
    bar.close()
    finished = len(losses) == data.steps_per_epoch
    record = {
        "epoch": epoch + 1, "step": global_step, "mode": mode.value, "epoch_batches": len(losses),
        "train_loss": float(np.mean(losses)) if losses else float("nan"),
        "eval_on": evaluate(eval_steps[True], state, data.eval_batches(), data.eval_summary),
        "eval_off": evaluate(eval_steps[False], state, data.eval_batches(), data.eval_summary),
        **{f"wire_bytes_{k}": v for k, v in wire[mode].items()},
        "dense_steps": dense_steps,  # warm-up and AQ-SGD first-visit steps (sent uncompressed)
        **{f"epoch_wire_bytes_{k}": v for k, v in sent.items()},
        "steps_per_s": timed_steps / elapsed if timed_steps and elapsed > 0 else None,
    }
    history.append(record)
    total_steps = sum(r["epoch_batches"] for r in history)
    for k in sent:  # the run so far: warm-up epochs and first visits included
      record[f"avg_wire_bytes_per_step_{k}"] = sum(r[f"epoch_wire_bytes_{k}"] for r in history) / max(total_steps, 1)
    if ckpt:
      position = {"epoch": epoch + 1} if finished else {"epoch": epoch, "epoch_losses": losses}
      ckpt.save(epoch + 1, state, {**position, "history": history}, host_state)
    if on_epoch:
      on_epoch(history)
  if ckpt:
    ckpt.close()
  return state, history
