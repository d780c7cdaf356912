"""The step-inflation ladder: inflation per rung and seed from results files, the fitted model and its projections,
and (slow) a ladder of two toy rungs end to end, resumed."""
import json
import math

import numpy as np
import pytest

from experiments import inflation as ladder_inflation
from experiments import ladder
from jaxcomp.analysis import inflation, step_table


def _results(folder, name, evals, step=None):
  """A results file whose run evaluated (step, loss) pairs `evals`."""
  folder.mkdir(parents=True, exist_ok=True)
  history = [{"step": step or evals[-1][0], "eval_on": {"loss": evals[-1][1]},
              "evals": [{"step": s, "eval_on": {"loss": v}, "eval_off": {"loss": v}} for s, v in evals]}]
  (folder / f"{name}.json").write_text(json.dumps({"config": {}, "history": history}))


def test_inflation_is_steps_to_the_budgets_loss_over_fp32s_on_the_same_cap(tmp_path):
  """Target = fp32's budget run's last loss (2.0); fp32 on the cap reaches it at 80, TopK at 120 (1.5x); a run that
  ends at the cap without reaching it is censored (> 300 / 80); one interrupted before either is no point yet."""
  rung = tmp_path / "w128-h100"
  _results(rung / "budget" / "results", "fp32", [(50, 2.5), (100, 2.0)])
  _results(rung / "cap" / "results", "fp32", [(40, 2.4), (80, 1.99)])
  _results(rung / "cap" / "results", "topk", [(80, 2.2), (120, 2.0)])
  _results(rung / "cap" / "results", "slow", [(150, 2.3), (300, 2.1)])
  _results(rung / "cap" / "results", "cut", [(20, 2.6)])
  points = ladder_inflation.rung_points(rung, ["fp32", "topk", "slow", "cut"], cap=3, horizon=100)
  assert points["fp32"][0]["inflation"] == 1.0 and points["topk"][0]["inflation"] == 1.5
  assert points["slow"][0]["censored"] and points["slow"][0]["inflation"] == 300 / 80
  assert points["cut"] == []
  report = {"cap": 3, "rungs": {"w128-h100": {"width": 128, "horizon": 100, "methods": points}}, "models": {}}
  assert "| topk | 1.50 (n=1) |" in ladder_inflation.render(report, {250: 1.66})
  assert "(1 > 3.75) (n=1)" in ladder_inflation.render(report, {250: 1.66})


def test_the_fit_recovers_a_power_law_and_its_projection_says_when_it_extrapolates():
  rng = np.random.default_rng(0)
  pts = [(h, w, 1.2 * (h / 100) ** 0.15 * (w / 128) ** -0.1 * math.exp(rng.normal(0, 0.01)))
         for h in (100, 300, 1000) for w in (128, 256, 512) for _ in range(2)]
  model = inflation.fit(pts)
  assert model["coef"]["a"] == pytest.approx(math.log(1.2), abs=0.02)
  assert model["coef"]["b"] == pytest.approx(0.15, abs=0.02) and model["coef"]["c"] == pytest.approx(-0.1, abs=0.02)
  inside = inflation.project(model, 300, 256)
  assert not inside["extrapolated"] and inside["low"] < inside["inflation"] < inside["high"]
  far = inflation.project(model, 2925, 1024)
  assert far["extrapolated"] and far["high"] - far["low"] > inside["high"] - inside["low"]
  assert not inflation.bends(pts)


def test_a_trend_flat_at_one_end_and_steep_at_the_other_bends():
  pts = [(h, 128, v) for h, v in ((100, 1.2), (100, 1.21), (300, 1.2), (300, 1.19), (1000, 2.4), (1000, 2.42))]
  assert inflation.bends(pts)
  assert inflation.fit([(100, 128, 1.3)]) is None  # one point fits nothing


def test_the_plan_trains_seed_by_seed_each_rungs_budget_first():
  order = ladder.plan([128], [100, 300], [2, 1], ["fp32", "m"])
  assert order == [(128, 100, 0, None), (128, 100, 0, "fp32"), (128, 100, 0, "m"),
                   (128, 300, 0, None), (128, 300, 0, "fp32"), (128, 300, 0, "m"),
                   (128, 100, 1, None), (128, 100, 1, "fp32"), (128, 100, 1, "m")]


@pytest.mark.slow
def test_a_toy_ladder_runs_and_a_rerun_skips_what_finished(tmp_path, capsys):
  argv = ["--horizons", "6", "--seeds", "1", "--cap", "2", "--methods", "fp32,bf16", "--eval-examples", "16",
          "--out", str(tmp_path)]
  report = ladder.main(argv)
  assert report["rungs"]["w128-h6"]["methods"]["bf16"][0]["fp32_steps"] <= 6
  capsys.readouterr()
  ladder.main(argv)
  assert capsys.readouterr().out.count("done, skipped") == 3


def test_a_run_killed_before_its_first_checkpoint_starts_afresh(tmp_path):
  """Its folder holds an empty ckpt/ (the run was stopped before it saved one): the study trains it anew instead of
  asking the runner to resume a checkpoint that does not exist."""
  import types

  from experiments import study
  (tmp_path / "fp32" / "ckpt").mkdir(parents=True)
  args = types.SimpleNamespace(recipe=None, steps=1, train_examples=16, batch_size=8, eval_examples=8, out=tmp_path,
                               outliers=None, eval_every=None, microbatches=None, target_loss=None,
                               stop_at_target=False)
  done = study.run_or_resume("fp32", args, 0, {}, "test")
  assert done["history"][-1]["step"] == 1


def test_the_export_writes_the_scratch_regime_and_keeps_the_fine_tuning_one(tmp_path):
  """--report --export into a copy of the shipped table: its scratch regime is this ladder's (with its own
  provenance), its finetune regime exactly what it was."""
  rung = tmp_path / "runs" / "w128-h100"
  _results(rung / "budget" / "results", "fp32", [(50, 2.5), (100, 2.0)])
  _results(rung / "cap" / "results", "fp32", [(40, 2.4), (80, 1.99)])
  _results(rung / "cap" / "results", "bf16", [(80, 2.2), (120, 2.0)])
  table = tmp_path / "table.json"
  table.write_text(step_table.SHIPPED.read_text())
  ladder.main(["--report", "--horizons", "100", "--methods", "fp32,bf16", "--out", str(tmp_path / "runs"),
               "--export", str(table)])
  scratch = step_table.load(table, "scratch")
  assert [p["inflation"] for p in scratch["rungs"]["w128-h100"]["methods"]["bf16"]] == [1.5]
  assert "experiments.ladder" in scratch["provenance"]["command"]
  assert step_table.load(table, "finetune") == step_table.load(None, "finetune")
