"""The driver's events: its evaluation schedule, the target, and the hooks it calls (`hooks.Hook`)."""
import jax
import numpy as np
import pytest

from jaxcomp.compress.boundary import Mode
from jaxcomp.runtime import evaluation, hooks, train
from training_cases import toy_fit, toy_pipe


def dense_fit(tmp, epochs, **kw):
  return toy_fit(tmp, epochs, pipe=toy_pipe("none", "none"), **kw)


def test_eval_every_evaluates_every_nth_step_and_the_last(tmp_path):
  """6 batches an epoch, 2 epochs, --eval-every 5: steps 5 and 10, and 12 (the run's last step)."""
  _, history = dense_fit(tmp_path, 2, eval_every=5)
  assert [[e["step"] for e in r["evals"]] for r in history] == [[5], [10, 12]]
  assert history[1]["eval_on"] == history[1]["evals"][-1]["eval_on"]  # the last step's evaluation, not repeated
  assert history[0]["eval_off"] != history[0]["evals"][0]["eval_off"]  # epoch 1 ends at step 6, off the schedule
  assert [e["step"] for e in evaluation.evaluations(history)] == [5, 10, 12]
  assert all(r["steps_per_s"] > 0 for r in history)
  _, plain = dense_fit(tmp_path / "plain", 2)
  assert [e["step"] for e in evaluation.evaluations(plain)] == [6, 12]  # no schedule: the epoch ends


def test_the_first_evaluated_step_at_or_below_the_target_is_recorded(tmp_path):
  _, history = dense_fit(tmp_path / "a", 2, eval_every=2)
  losses = [(e["step"], e["eval_on"]["loss"]) for e in evaluation.evaluations(history)]
  assert len(losses) == 6 and losses[-1][1] < losses[0][1]
  target = sorted(loss for _, loss in losses)[2]  # the third lowest: reached before the end
  first = next(step for step, loss in losses if loss <= target)
  summary = evaluation.target_summary(history, target)
  assert summary["step"] == first < 12 and summary["evaluated"] == 6
  assert (summary["best_loss"], summary["best_step"]) == min(((l, s) for s, l in losses))
  never = evaluation.target_summary(history, min(l for _, l in losses) - 1.0)
  assert never["step"] is None and never["best_loss"] == summary["best_loss"]


def test_stop_at_target_ends_the_run_there_and_a_resumed_run_keeps_its_schedule(tmp_path):
  """6 batches an epoch, --eval-every 4: the target is the eval loss at step 8, inside epoch 2."""
  full, full_history = dense_fit(tmp_path / "full", 2, eval_every=4)
  target = evaluation.evaluations(full_history)[1]["eval_on"]["loss"]
  assert evaluation.target_summary(full_history, target)["step"] == 8  # (step 4's loss is higher)
  state, history = dense_fit(tmp_path / "b", 2, eval_every=4, target_loss=target, stop_at_target=True)
  assert int(state.step) == 8 == history[-1]["step"] and history[-1]["epoch_batches"] == 2
  assert evaluation.target_summary(history, target)["step"] == 8
  again, same = dense_fit(tmp_path / "b", 2, resume=True, eval_every=4, target_loss=target, stop_at_target=True)
  assert int(again.step) == 8 and same == history  # reached already: nothing more to train
  resumed, resumed_history = dense_fit(tmp_path / "b", 2, resume=True, eval_every=4, target_loss=target)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               full._replace(rng=0), resumed._replace(rng=0))
  untimed = lambda h: [{k: v for k, v in r.items() if k != "steps_per_s"} for r in h]
  assert untimed(resumed_history) == untimed(full_history)


def test_a_shorter_runs_last_evaluation_leaves_the_schedule_when_it_resumes(tmp_path):
  _, full_history = dense_fit(tmp_path / "full", 2, eval_every=4)
  _, cut = dense_fit(tmp_path / "b", 2, eval_every=4, steps=5)
  assert [e["step"] for e in evaluation.evaluations(cut)] == [4, 5]
  _, resumed = dense_fit(tmp_path / "b", 2, resume=True, eval_every=4)
  assert [e["step"] for e in evaluation.evaluations(resumed)] \
      == [e["step"] for e in evaluation.evaluations(full_history)] == [4, 8, 12]
  assert [e["eval_on"] for e in evaluation.evaluations(resumed)] \
      == [e["eval_on"] for e in evaluation.evaluations(full_history)]


def test_eval_schedule_settings_are_checked():
  with pytest.raises(ValueError, match="eval_every must be >= 1"):
    train.RunConfig(epochs=1, eval_every=0)
  with pytest.raises(ValueError, match="stop_at_target needs a target_loss"):
    train.RunConfig(epochs=1, stop_at_target=True)
  with pytest.raises(ValueError, match="target_loss must be a finite number"):
    train.RunConfig(epochs=1, target_loss=float("nan"))


class Recorder(hooks.Hook):
  """Every event the driver calls, in order, with what it says (the step counter when it calls)."""

  def __init__(self):
    self.events = []

  def before_step(self, run, mode, step, args):
    self.events.append(("step", mode, run.global_step, len(args)))

  def before_evaluate(self, run, compressed):
    self.events.append(("evaluate", compressed, run.global_step))

  def before_checkpoint(self, run):
    self.events.append(("checkpoint", run.global_step))

  def after_checkpoint(self, run):
    self.events.append(("saved", run.global_step))

  def after_fit(self, run):
    self.events.append(("fit", int(run.state.step)))


def test_hooks_see_every_step_evaluation_and_checkpoint_in_order_and_change_nothing(tmp_path):
  """AQ-SGD with a warm-up epoch (6 steps an epoch, 2 epochs, --eval-every 4): each step with its mode, both ways
  of each scheduled and end-of-epoch evaluation, a checkpoint around each epoch's save, then the end."""
  hook = Recorder()
  state, history = toy_fit(tmp_path / "hooked", 2, eval_every=4, hooks=[hook])
  steps = [e for e in hook.events if e[0] == "step"]
  assert [(mode, at) for _, mode, at, _ in steps] == [(Mode.WARMUP, k) for k in range(6)] + [
      (Mode.TRAIN, k) for k in range(6, 12)]
  assert all(n == 1 for *_, n in steps)  # the placed batch (no prefetching step here)
  others = [e for e in hook.events if e[0] != "step"]
  evaluate = lambda at: [("evaluate", True, at), ("evaluate", False, at)]
  assert others == [*evaluate(4), *evaluate(6), ("checkpoint", 6), ("saved", 6), *evaluate(8), *evaluate(12),
                    ("checkpoint", 12), ("saved", 12), ("fit", 12)]
  plain, plain_history = toy_fit(tmp_path / "plain", 2, eval_every=4)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), state._replace(rng=0),
               plain._replace(rng=0))
  untimed = lambda h: [{k: v for k, v in r.items() if k != "steps_per_s"} for r in h]
  assert untimed(history) == untimed(plain_history)
