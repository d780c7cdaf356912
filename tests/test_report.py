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
