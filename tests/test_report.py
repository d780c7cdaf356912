"""GPT-2 presets that isolate AQ-SGD's warm-up, and the report's bytes columns."""
from experiments import gpt2_wikitext, report


def test_every_aqsgd_preset_has_a_direct_twin_with_the_same_warmup():
  aqsgd = [name for name in gpt2_wikitext.PRESETS if name.startswith("aqsgd-")]
  assert len(aqsgd) == 3
  for name in aqsgd:
    ours, twin = gpt2_wikitext.PRESETS[name], gpt2_wikitext.PRESETS[name.replace("aqsgd-", "direct-") + "-warm1"]
    assert twin == {**ours, "fwd": ours["fwd"].removeprefix("aqsgd+")}
    assert twin["warmup_epochs"] == ours["warmup_epochs"] == 1


def test_report_shows_the_runs_average_bytes_per_step():
  record = {"epoch": 2, "eval_off": {"loss": 2.5}, "eval_on": {"loss": 2.6}, "wire_bytes_fwd": 100,
            "wire_bytes_bwd": 200, "steps_per_s": None}
  runs = [{"run": "aqsgd-fw2-bw4", "config": {}, "history": [{**record, "avg_wire_bytes_per_step_fwd": 550.0,
                                                              "avg_wire_bytes_per_step_bwd": 1100.0}]},
          {"run": "old-run", "config": {}, "history": [record]}]
  lines = report.table(runs, "gpt2").splitlines()
  assert "run avg fwd bytes/step" in lines[0]
  assert "| 100 | 200 | 550 | 1,100 |" in lines[2]
  assert "| 100 | 200 |  |  |" in lines[3]  # results written before the column existed


def test_report_groups_runs_that_differ_only_by_seed(tmp_path):
  def run(name, seed, loss, **config):
    record = {"epoch": 2, "eval_off": {"loss": loss}, "eval_on": {"loss": loss + 1.0}, "wire_bytes_fwd": 100,
              "wire_bytes_bwd": 200, "steps_per_s": 2.0}
    return {"run": name, "config": {"fwd": "quant:4", "seed": seed, "run_name": name, "out": str(tmp_path), **config},
            "history": [{**record, "epoch": 1}, record]}
  runs = [run("a", 0, 2.0), run("a-seed1", 1, 2.2), run("a-seed2", 2, 2.4), run("a-again", 0, 3.0),
          run("b", 1, 5.0, lr=0.1)]
  assert [[r["run"] for r in g] for g in report.by_seed(runs)] == [["a", "a-seed1", "a-seed2"], ["a-again"], ["b"]]
  lines = report.table(runs, "gpt2").splitlines()
  assert lines[2].startswith("| a (seeds 0, 1, 2) |") and "| 2.20 ± 0.20 | 3.20 ± 0.20 |" in lines[2]
  assert "| a-again |" in lines[3] and "| 3.00 | 4.00 |" in lines[3]
  assert report.plot(runs, "gpt2", tmp_path / "curves.png").stat().st_size > 0
