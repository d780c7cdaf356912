"""GPT-2 presets that isolate AQ-SGD's warm-up, the report's bytes columns, and results it cannot report."""
import pytest

from experiments import gpt2_wikitext, report
from jaxcomp.runtime import results


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


GPT2_RECORD = {"epoch": 1, "eval_off": {"loss": 2.5, "perplexity": 12.18},
               "eval_on": {"loss": 2.6, "perplexity": 13.46}, "wire_bytes_fwd": 100, "wire_bytes_bwd": 200,
               "steps_per_s": None}


def _report_error(argv) -> str:
  with pytest.raises(SystemExit) as exit_:
    report.main(argv)
  message = exit_.value.code
  assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, message
  return message


@pytest.mark.parametrize("content, why", [("not json", "not readable as JSON: JSONDecodeError"),
                                          ('{"foo": 1}', "not a run's results: a JSON object with run, config and "
                                                         "history"),
                                          ("[1, 2, 3]", "not a run's results")])
def test_report_skips_and_names_files_that_are_not_results(tmp_path, capsys, content, why):
  (tmp_path / "x.json").write_text(content)
  assert _report_error([str(tmp_path), "--paper", "gpt2"]).startswith(
      f"error: no finished runs to report under {tmp_path} with --paper gpt2; skipped x.json ({why}")
  assert not (tmp_path / "report.md").exists()
  results.write(tmp_path, "top10-reuse", {}, [GPT2_RECORD])
  report.main([str(tmp_path), "--paper", "gpt2"])
  out, err = capsys.readouterr()
  assert err.startswith(f"note: skipped x.json ({why}") and "| top10-reuse |" in out


def test_report_names_the_paper_its_runs_belong_to(tmp_path):
  results.write(tmp_path, "top10-reuse", {}, [GPT2_RECORD])
  assert _report_error([str(tmp_path), "--paper", "resnet"]) == (
      f"error: no finished runs to report under {tmp_path} with --paper resnet; skipped top10-reuse.json (a gpt2 run: "
      "use --paper gpt2)")


def test_report_of_an_empty_or_missing_folder_says_so(tmp_path):
  assert _report_error([str(tmp_path), "--paper", "gpt2"]) == (
      f"error: no finished runs to report under {tmp_path} with --paper gpt2: it holds no <run>.json results files; "
      "pass the results folder of finished runs, e.g. runs/resnet_cifar10/results")
  assert _report_error([str(tmp_path / "nowhere"), "--paper", "gpt2"]).startswith(
      f"error: {tmp_path / 'nowhere'} is not a folder (it does not exist); pass the results folder")


def test_report_that_cannot_be_written_is_one_error_line(tmp_path):
  results.write(tmp_path, "top10-reuse", {}, [GPT2_RECORD])
  (tmp_path / "report.md").mkdir()
  assert _report_error([str(tmp_path), "--paper", "gpt2"]).startswith(
      f"error: cannot write the report into {tmp_path} (Is a directory); copy the results folder")


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
