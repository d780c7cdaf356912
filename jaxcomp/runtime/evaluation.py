"""A run's evaluations: the evaluation set's metrics, the evaluation schedule and the step to target.

`evaluate` averages an eval step's metrics over the evaluation set, weighted by batch size. Evaluation schedule
(`RunConfig.eval_every`): a run also evaluates, with compression on and off, after every `eval_every`-th step
(global steps N, 2N, ...) and after its last step; each epoch's record lists those evaluations (`evals`). The
run's evaluated steps are these, or without `eval_every` its epoch ends (`evaluations`). With `target_loss` L, the
first evaluated step whose eval loss with compression on is <= L is the run's step to target (`target_summary`);
`stop_at_target` ends the run there (its epoch recorded and checkpointed as one cut short by `steps`). A resumed
run continues the schedule; the last step of an earlier, shorter run is not on it and leaves it (`on_schedule`).
"""
import math
from typing import Callable


def evaluate(eval_step, state, batches, summary: Callable[[dict], dict] = dict, place=lambda b: b) -> dict:
  """summary(metrics averaged over the evaluation set, weighted by batch size); `place` puts a
  batch where the step reads it."""
  totals, count = {}, 0
  for batch in batches:
    n = len(next(iter(batch.values())))
    for k, v in eval_step(state, place(batch)).items():
      totals[k] = totals.get(k, 0.0) + float(v) * n
    count += n
  return summary({k: v / count for k, v in totals.items()})


def due(step: int, eval_every: int | None) -> bool:
  """Whether global step `step` is on the schedule of `eval_every` (None: no schedule)."""
  return bool(eval_every) and step % eval_every == 0


def on_schedule(history: list[dict], eval_every: int) -> list[dict]:
  """`history` with each epoch's `evals` on the schedule of `eval_every` only (a resumed run: the last step of an
  earlier, shorter run is off it)."""
  return [{**r, "evals": [e for e in r["evals"] if due(e["step"], eval_every)]} if "evals" in r else r
          for r in history]


def reaches(evaluated: dict, target_loss: float | None) -> bool:
  """Whether an evaluated step's eval loss with compression on is at or below `target_loss` (None: no target)."""
  return target_loss is not None and evaluated["eval_on"].get("loss", math.inf) <= target_loss


def evaluations(history: list[dict]) -> list[dict]:
  """The run's evaluated steps in order, each {"step", "eval_on", "eval_off"}: the `evals` its epochs list (a run
  with `RunConfig.eval_every`), else its epoch ends."""
  if any("evals" in r for r in history):
    return [e for r in history for e in r.get("evals", ())]
  return [{"step": r["step"], "eval_on": r["eval_on"], "eval_off": r["eval_off"]} for r in history]


def target_summary(history: list[dict], target_loss: float) -> dict:
  """When the run reached `target_loss`: {"loss": the target, "step": the first evaluated step whose eval loss with
  compression on is <= it (None: none), "best_loss", "best_step": the lowest such loss and its step, "evaluated":
  how many evaluated steps there were}."""
  evals = evaluations(history)
  best = min(evals, key=lambda e: e["eval_on"]["loss"], default=None)
  return {"loss": target_loss, "step": next((e["step"] for e in evals if e["eval_on"]["loss"] <= target_loss), None),
          "best_loss": best and best["eval_on"]["loss"], "best_step": best and best["step"], "evaluated": len(evals)}
