"""Smoke test of the frontier sweep: two methods, a few steps, resumable, exact byte accounting."""
import argparse
import json

import pytest

from experiments import frontier


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_two_methods_table_plot_and_rerun_skips(tmp_path, capsys):
  argv = ["--steps", "4", "--train-examples", "16", "--eval-examples", "8", "--batch-size", "8",
          "--methods", "fp32,aqsgd-fw2-bw4", "--out", str(tmp_path)]
  rows = {r["method"]: r for r in frontier.main(argv)}
  assert (tmp_path / "frontier.png").stat().st_size > 0
  assert "aqsgd-fw2-bw4" in (tmp_path / "frontier.md").read_text()
  # fp32: 3 boundaries x 64 features x 4 bytes each way per token
  assert rows["fp32"]["bytes_fwd"] == rows["fp32"]["bytes_bwd"] == 3 * 64 * 4
  # AQ-SGD: epoch 1 (2 steps) dense, epoch 2 compressed: the average counts the warm-up
  aq = rows["aqsgd-fw2-bw4"]
  assert aq["bytes_steady"] < aq["bytes"] < rows["fp32"]["bytes"]
  assert aq["bytes"] == pytest.approx((rows["fp32"]["bytes"] + aq["bytes_steady"]) / 2)
  assert aq["per_example_buffers"] and not rows["fp32"]["per_example_buffers"]
  capsys.readouterr()
  frontier.main(argv)  # rerun: nothing trains again
  assert capsys.readouterr().out.count("done, skipped") == 2


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_interrupted_method_resumes(tmp_path):
  argv = ["--steps", "4", "--train-examples", "16", "--eval-examples", "8", "--methods", "bf16", "--out", str(tmp_path)]
  frontier.main([*argv[:1], "3", *argv[2:]])  # a shorter budget stands in for an interrupted run
  first = json.loads((tmp_path / "results" / "bf16.json").read_text())["history"]
  assert first[-1]["step"] == 3
  assert frontier.finished(tmp_path, "bf16", 4) is None
  frontier.main(argv)
  history = json.loads((tmp_path / "results" / "bf16.json").read_text())["history"]
  assert history[-1]["step"] == 4 and len(history) == 2


def test_pareto_and_domination():
  row = lambda m, b, l, buf=False: {"method": m, "bytes": b, "loss_off": l, "per_example_buffers": buf}
  rows = [row("aqsgd-fw2-bw4", 100, 2.0, True), row("a", 50, 2.0), row("b", 40, 2.5), row("c", 200, 1.9),
          row("d", 90, 2.1)]
  assert frontier.pareto(rows) == {"a", "b", "c"}
  assert [r["method"] for r in frontier.dominating(rows)] == ["a"]


def test_seeds_run_separately_and_the_table_compares_means(tmp_path):
  args = argparse.Namespace(steps=4, train_examples=16, eval_examples=8, batch_size=8, out=tmp_path, outliers=None)
  assert frontier.run_name("fp32", 0) == "fp32" and frontier.run_name("fp32", 2) == "fp32-seed2"
  run = frontier.run_config("fp32", args, 2)
  assert run.training.seed == 2 and run.output.run_name == "fp32-seed2"

  def row(method, seed, nbytes, loss):
    return {"method": method, "seed": seed, "fwd": "none", "bwd": "none", "warmup_epochs": 0, "bytes_fwd": nbytes / 2,
            "bytes_bwd": nbytes / 2, "bytes": nbytes, "bytes_steady": nbytes, "loss_off": loss, "loss_on": loss + 0.1,
            "per_example_buffers": False}
  # d's best seed (1.0) beats everything, its mean (2.333) does not: a dominates it on means
  rows = frontier.over_seeds([row("a", s, 2.0, loss) for s, loss in enumerate((2.0, 2.2, 2.4))]
                             + [row("b", s, 1.0, loss) for s, loss in enumerate((2.3, 2.5, 2.1))]
                             + [row("d", s, 2.5, loss) for s, loss in enumerate((1.0, 3.0, 3.0))])
  a = rows[0]
  assert [r["method"] for r in rows] == ["a", "b", "d"] and a["seeds"] == [0, 1, 2]
  assert a["loss_off"] == pytest.approx(2.2) and a["loss_off_std"] == pytest.approx(0.2)
  assert a["loss_on"] == pytest.approx(2.3) and a["bytes_std"] == 0.0
  assert frontier.pareto(rows) == {"a", "b"}
  text = frontier.table(rows)
  assert "| 2.2000 ± 0.2000 | 2.3000 ± 0.2000 | 3 |" in text
  assert frontier.plot(rows, tmp_path / "f.png", "t").stat().st_size > 0
  one = frontier.over_seeds([row("a", 0, 2.0, 2.0)])
  assert one[0]["loss_off_std"] == 0.0 and "| 2.0000 | 2.1000 | 1 |" in frontier.table(one)


def test_list_methods_names_every_method_with_its_specs(capsys):
  assert frontier.main(["--list-methods"]) == []
  lines = capsys.readouterr().out.splitlines()[1:]
  assert [line.split()[0] for line in lines] == list(frontier.METHODS)
  assert lines[list(frontier.METHODS).index("subspace16-fw3-bw4")].split()[1:] == [
      "maxabs:3", "maxabs:4:stoch", "0", "subspace:16"]


def test_outlier_model_runs_carry_the_flag_and_keep_their_own_folder(tmp_path):
  args = argparse.Namespace(steps=4, train_examples=16, eval_examples=8, batch_size=8, out=tmp_path,
                            outliers="4:64:1024")
  run = frontier.run_config("tile64-fw3-bw4", args)
  assert run.options.outliers == "4:64:1024" and run.record()["outliers"] == "4:64:1024"
  (tmp_path / "results").mkdir()
  (tmp_path / "results" / "fp32.json").write_text(json.dumps(
      {"config": {"outliers": "4:64:1024"}, "history": [{"step": 4}]}))
  assert frontier.finished(tmp_path, "fp32", 4, "4:64:1024")["history"][-1]["step"] == 4
  with pytest.raises(ValueError, match="a run with --outliers 4:64:1024, this frontier has --outliers None"):
    frontier.finished(tmp_path, "fp32", 4)
