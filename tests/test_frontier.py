"""Smoke test of the frontier sweep: two methods, a few steps, resumable, exact byte accounting."""
import argparse
import dataclasses
import json
import math

import jax
import pytest

from experiments import frontier, time_to_target
from jaxcomp.analysis import netsim
from jaxcomp.analysis.link import Link


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
  args = argparse.Namespace(steps=4, train_examples=16, eval_examples=8, batch_size=8, out=tmp_path, outliers=None,
                            recipe=None, eval_every=None, target_loss=None, stop_at_target=False,
                            microbatches=None)
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
                            outliers="4:64:1024", recipe=None, eval_every=None, target_loss=None, stop_at_target=False,
                            microbatches=None)
  run = frontier.run_config("tile64-fw3-bw4", args)
  assert run.options.outliers == "4:64:1024" and run.record()["outliers"] == "4:64:1024"
  (tmp_path / "results").mkdir()
  (tmp_path / "results" / "fp32.json").write_text(json.dumps(
      {"config": {"outliers": "4:64:1024"}, "history": [{"step": 4}]}))
  assert frontier.finished(tmp_path, "fp32", 4, "4:64:1024")["history"][-1]["step"] == 4
  with pytest.raises(ValueError, match="a run with --outliers 4:64:1024, this study has --outliers None"):
    frontier.finished(tmp_path, "fp32", 4)


def test_a_recipes_own_eval_every_is_the_default_a_rerun_expects(tmp_path):
  """Without --eval-every a run takes its recipe's (protocol-cpu: every 25 steps), and a rerun finds it done."""
  (tmp_path / "results").mkdir()
  (tmp_path / "results" / "fp32.json").write_text(json.dumps(
      {"config": {"outliers": None, "recipe": "protocol-cpu", "eval_every": 25}, "history": [{"step": 4}]}))
  assert frontier.finished(tmp_path, "fp32", 4, recipe="protocol-cpu", eval_every=None)["history"][-1]["step"] == 4
  with pytest.raises(ValueError, match="a run with --eval-every 25, this study has --eval-every 16"):
    frontier.finished(tmp_path, "fp32", 4, recipe="protocol-cpu", eval_every=16)


def _results(steps_losses, dense=(0, 0), epoch_steps=4, method="m", seed=0):
  """A run's results: scheduled evaluations (step, eval loss with compression on) over epochs of `epoch_steps`."""
  history = []
  for epoch, end in enumerate(range(epoch_steps, max(s for s, _ in steps_losses) + 1, epoch_steps)):
    evals = [{"step": s, "eval_on": {"loss": l}, "eval_off": {"loss": l}} for s, l in steps_losses
             if end - epoch_steps < s <= end]
    history.append({"epoch": epoch + 1, "step": end, "dense_steps": dense[epoch], "evals": evals,
                    "eval_on": evals[-1]["eval_on"], "eval_off": evals[-1]["eval_off"]})
  return {"run": method, "config": {"seed": seed}, "history": history}


def test_time_to_target_counts_steps_dense_warmup_and_seeds():
  ttt = time_to_target
  step = ttt.StepTime(seconds=2.0, dense_seconds=5.0, critical={"compute": 1.0, "link": 3.0, "exchange": 0.0},
                      source="test")
  # seed 0 reaches 2.5 at step 6, seed 1 at step 4; the first epoch (4 steps) was a dense warm-up
  runs = [_results([(2, 3.0), (4, 2.6), (6, 2.4), (8, 2.2)], dense=(4, 0)),
          _results([(2, 3.0), (4, 2.5), (6, 2.3), (8, 2.1)], dense=(4, 0), seed=1)]
  assert ttt.steps_to_target(runs[0], 2.5) == {"loss": 2.5, "step": 6, "best_loss": 2.2, "best_step": 8,
                                               "evaluated": 4, "dense_steps": 4}
  summary = {"fwd": "f", "bwd": "b", "bottleneck": None, "bytes_steady": 10.0, "bytes": 12.0}
  row = ttt.row("m", runs, summary, step, 2.5)
  assert (row["steps"], row["steps_std"], row["reached"], row["cap"]) == (5.0, pytest.approx(2 ** 0.5), 2, 8)
  # T = steps x 2 s + 4 warm-up steps x (5 - 2) s: 24 and 20
  assert (row["T"], row["T_std"]) == (22.0, pytest.approx(8 ** 0.5))
  missed = ttt.row("slow", [runs[0], _results([(2, 3.0), (4, 2.9), (6, 2.8), (8, 2.7)], seed=1)], summary, step, 2.5)
  assert missed["T"] is None and missed["reached"] == 1 and missed["best_loss"] == pytest.approx(2.45)
  fast = {**row, "method": "fp32", "T": 11.0}
  rows = ttt.relative([row, missed, fast, {**row, "method": "bf16", "T": 44.0}])
  assert (rows[0]["T_over_fp32"], rows[0]["T_over_bf16"], rows[1]["T_over_fp32"]) == (2.0, 0.5, None)
  text = ttt.table(rows, 2.5, Link.parse("200mbit:50ms"))
  assert "| m | `f` | `b` | 10.0 | 5 ± 1 | 2/2 | 2.1500 ± 0.0707 | 2 | 25 / 75 | 22 ± 2.828 | 2.000 | 0.500 |" in text
  assert "| slow | `f` | `b` | 10.0 | 6 ± 0 | 1/2 | 2.4500 ± 0.3536 | 2 | 25 / 75 | - | - | - |" in text
  assert text.splitlines()[-1].startswith("| slow |")  # no T: last


def test_a_run_stopped_at_its_target_is_finished_for_that_target_only(tmp_path):
  (tmp_path / "results").mkdir()
  run = _results([(2, 3.0), (4, 2.5)])
  run["config"].update(outliers=None, recipe="tiny", eval_every=2)
  (tmp_path / "results" / "m.json").write_text(json.dumps(run))
  assert frontier.finished(tmp_path, "m", 8, target=2.5, recipe=None, eval_every=2) == run
  assert frontier.finished(tmp_path, "m", 8, target=2.4, recipe=None, eval_every=2) is None
  assert frontier.finished(tmp_path, "m", 4, recipe=None, eval_every=2) == run  # the budget done
  with pytest.raises(ValueError, match="is a run with --eval-every 2, this study has --eval-every 4"):
    frontier.finished(tmp_path, "m", 8, target=2.5, recipe=None, eval_every=4)
  with pytest.raises(ValueError, match="is a run with --recipe tiny, this study has --recipe protocol-cpu"):
    frontier.finished(tmp_path, "m", 8, target=2.5, recipe="protocol-cpu", eval_every=2)


class TenMilliseconds:
  """A clock of the throughput benchmark's kind that runs nothing: every op takes 10 ms, every array is abstract."""
  source = "10 ms per op"
  input = staticmethod(lambda shape: shape)
  output = staticmethod(jax.eval_shape)
  seconds = staticmethod(lambda fn, *args: 0.01)


def test_the_predicted_step_over_a_slow_link_is_its_messages_and_the_meter_passes_through(tmp_path, monkeypatch):
  """fp32 on 4 stages, 1 microbatch: 1F1B sends 3 forward and 3 backward messages of 8 x 128 x 64 fp32 one after
  another; at 1 Mbit/s and 10 ms each they take 6 x (8 x 262,144 / 1e6 + 0.01) s, the rest is compute."""
  ttt = time_to_target
  meters = []
  simulate_step = netsim.simulate_step
  monkeypatch.setattr(netsim, "simulate_step", lambda *a, meter, **kw: meters.append(meter) or simulate_step(*a, **kw))
  args = argparse.Namespace(steps=4, train_examples=16, eval_examples=8, batch_size=8, out=tmp_path, outliers=None,
                            recipe=None, eval_every=None, target_loss=None, stop_at_target=False,
                            microbatches=None)
  step = ttt.StepTimes(Link.parse("1mbit:10ms"), "1f1b", meter="inbound", clock=TenMilliseconds())(
      frontier.run_config("fp32", args))
  link = 6 * (8 * 8 * 128 * 64 * 4 / 1e6 + 0.01)
  assert step.seconds == step.dense_seconds and step.critical["link"] == pytest.approx(link)
  assert step.critical["compute"] == pytest.approx(step.seconds - link) and step.critical["exchange"] == 0.0
  assert meters == ["inbound", "inbound"]


def test_with_overlap_netsim_times_the_overlapped_table(tmp_path, monkeypatch):
  """--overlap: the compressed and the dense step are both timed on the schedule's table of forwarding delay 2 (the
  executor's --overlap), with overlapped sends; without it on the plain table. 4 stages, 8 microbatches of 10 ms
  ops: messages crossing while the stages compute leave less link on the critical path."""
  ttt = time_to_target
  timed = []
  simulate_step = netsim.simulate_step
  monkeypatch.setattr(netsim, "simulate_step", lambda *a, schedule, **kw: timed.append(
      (schedule.forwarding_delay, kw["ticks"])) or simulate_step(*a, schedule=schedule, **kw))
  args = argparse.Namespace(steps=4, train_examples=16, eval_examples=8, batch_size=8, out=tmp_path, outliers=None,
                            recipe=None, eval_every=None, target_loss=None, stop_at_target=False, microbatches=8)
  cfg = frontier.run_config("direct-fw4-bw8", args)
  assert cfg.executor.microbatches == 8
  link = Link.parse("10mbit:1ms")
  overlapped = ttt.StepTimes(link, "1f1b", clock=TenMilliseconds(), overlap=True)(cfg)
  plain = ttt.StepTimes(link, "1f1b", clock=TenMilliseconds())(cfg)
  assert timed == [(2, True), (2, True), (1, True), (1, True)]  # the executor's ticks, on each table
  assert overlapped.critical["link"] < plain.critical["link"] and overlapped.seconds < plain.seconds


def test_the_link_for_a_dense_slowdown_slows_the_dense_step_that_much(tmp_path):
  """fp32 on the tiny recipe's 4 stages, ops of 10 ms: on the link found for a slowdown of 50 its step takes 50 times
  its step with free messages, and each message pays the latency share of one dense message's transfer."""
  ttt = time_to_target
  args = argparse.Namespace(steps=4, train_examples=16, eval_examples=8, batch_size=8, out=tmp_path, outliers=None,
                            recipe=None, eval_every=None, target_loss=None, stop_at_target=False, microbatches=None)
  cfg, times = frontier.run_config("fp32", args), ttt.StepTimes(Link.parse("1mbit"), "1f1b", clock=TenMilliseconds())
  link = times.link_for_slowdown(cfg, 50, 0.0745)
  unmetered = times.timeline(cfg, link=Link(math.inf)).makespan
  assert times.timeline(cfg, link=link).makespan == pytest.approx(50 * unmetered, rel=1e-6)
  assert link.latency_s == pytest.approx(0.0745 * 8 * 8 * 128 * 64 * 4 / link.bandwidth_bps)
  assert times.link == Link.parse("1mbit")  # found, not set
  for bad in (1.0, math.inf):
    with pytest.raises(ValueError, match="a dense slowdown is the step on the link over the step unmetered, so it "
                                         f"must be finite and > 1, got {bad}"):
      times.link_for_slowdown(cfg, bad, 0.0745)


def test_the_time_to_target_flags_are_checked(capsys):
  refused = [  # (argv, what its one error line says)
      (["--stop-at-target"], "--stop-at-target, --eval-every, --overlap and --dense-slowdown belong to the "
                             "time-to-target mode: "),
      # refused before any run: 4 stages of the tiny recipe, 1 microbatch
      (["--target-loss", "2", "--overlap", "--methods", "fp32"],
       "--schedule 1f1b --overlap: overlapped sends (--overlap) need at least 2S microbatches"),
      (["--target-loss", "2", "--meter", "receiver"], "--meter: invalid choice: 'receiver'"),
      (["--target-loss", "2", "--link", "200mb"], "link rate '200mb'"),
      (["--target-loss", "2", "--dense-slowdown", "0.5"],
       "'0.5': give how many times its unmetered step fp32's step takes on the link"),
      (["--target-loss", "2", "--dense-slowdown", "inf"], "'inf': give how many times"),
      (["--target-loss", "2", "--dense-slowdown", "record", "--link", "1mbit"],
       "not allowed with argument --dense-slowdown"),
  ]
  for argv, error in refused:
    with pytest.raises(SystemExit):
      frontier.main(argv)
    assert error in capsys.readouterr().err, argv
  assert frontier.slowdown_arg("record") == pytest.approx(100.475 / 0.53945)


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_time_to_target_table_and_plot(tmp_path):
  argv = ["--steps", "4", "--train-examples", "16", "--eval-examples", "8", "--batch-size", "8", "--methods",
          "direct-fw4-bw8", "--out", str(tmp_path), "--target-loss", "5.45", "--eval-every", "2", "--repeats", "1",
          "--stop-at-target"]
  rows = {r["method"]: r for r in frontier.main(argv)}
  assert list(rows) == ["fp32", "bf16", "direct-fw4-bw8"]  # fp32 and bf16 always run
  for r in rows.values():
    assert r["reached"] == 1 and r["steps"] in (2, 4) and r["T"] == pytest.approx(r["steps"] * r["step_s"])
  assert rows["fp32"]["T_over_fp32"] == 1.0 and rows["bf16"]["step_s"] < rows["fp32"]["step_s"]
  assert (tmp_path / "time_to_target.png").stat().st_size > 0
  assert "| direct-fw4-bw8 |" in (tmp_path / "time_to_target.md").read_text()


def test_time_to_target_help_says_which_commands_compute_it(capsys):
  with pytest.raises(SystemExit) as done:
    time_to_target.main(["--help"])
  assert done.value.code == 0
  out = " ".join(capsys.readouterr().out.split())
  assert "python -m experiments.frontier --target-loss L --link BW:LAT" in out and "python -m jaxcomp.plan" in out


def test_a_warm_up_epoch_is_charged_dense_and_later_first_visits_forward_dense_only():
  history = [{"step": 4, "mode": "warmup", "dense_steps": 4}, {"step": 8, "mode": "train", "dense_steps": 2}]
  timed = time_to_target.StepTime(1.0, 10.0, {}, "test", first_visit_seconds=4.0)
  assert time_to_target.seconds_at(history, 8, timed) == 4 * 10.0 + 2 * 4.0 + 2 * 1.0
  assert time_to_target.seconds_at(history, 5, timed) == 4 * 10.0 + 4.0  # an epoch's dense steps are its first
  unknown = dataclasses.replace(timed, first_visit_seconds=None)  # first visits charged as dense
  assert time_to_target.seconds_at(history, 8, unknown) == 6 * 10.0 + 2 * 1.0
