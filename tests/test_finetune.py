"""Fine-tuning, as the papers do: a run trained here as the start of another (its weights, a fresh optimizer at step
0), GPT-2 tiny at other widths, the papers' text through Hugging Face datasets (a stand-in loader: no network), and
(slow) the study end to end at toy size, resumed."""
import argparse
import shutil
import sys

import jax
import numpy as np
import pytest

from experiments import config, finetune, finetune_report, gpt2_wikitext, runner
from jaxcomp.analysis import step_table
from jaxcomp.data import hub_text, text
from jaxcomp.runtime.pretrained import checkpoint_params

TOY = dict(batch_size=4, train_examples=8, eval_examples=4, no_progress=True, model_width=16)


def _pretrain(tmp_path, **flags):
  """A toy run of 2 steps on the shipped King James Bible: (its folder, its final state)."""
  cfg = config.resolve(gpt2_wikitext.EXPERIMENT, "tiny", text="kjv", steps=2, epochs=1, out=str(tmp_path),
                       run_name="pre", **{**TOY, **flags})
  state, _ = runner.run(gpt2_wikitext.EXPERIMENT, cfg)
  return tmp_path / "pre", state


def test_a_run_trained_here_is_fine_tuned_from_its_last_weights_with_a_fresh_optimizer_at_step_zero(tmp_path):
  folder, state = _pretrain(tmp_path)
  cfg = config.resolve(gpt2_wikitext.EXPERIMENT, "finetune-cpu", pretrained=str(folder), epochs=1,
                       out=str(tmp_path / "ft"), **TOY)
  pipe, optimizer, data, params = gpt2_wikitext.build(cfg)
  assert "Shakespeare" in data.name
  got, saved = jax.tree.leaves(params), jax.tree.leaves(state.params)
  assert len(got) == len(saved) > 0
  for a, b in zip(got, saved):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  _, history = runner.run(gpt2_wikitext.EXPERIMENT, cfg)
  assert [r["step"] for r in history] == [2]  # its own 8 / 4 steps from 0, not the pretraining's 2 and on


def test_fine_tuning_another_model_than_the_saved_one_says_so(tmp_path):
  folder, _ = _pretrain(tmp_path)
  cfg = config.resolve(gpt2_wikitext.EXPERIMENT, "finetune-cpu", pretrained=str(folder), out=str(tmp_path / "ft"),
                       **{**TOY, "model_width": 32})
  with pytest.raises(ValueError, match="holds another model than this run's.*fine-tune with the model"):
    gpt2_wikitext.build(cfg)
  pipe, optimizer, data, _ = gpt2_wikitext.build(config.resolve(gpt2_wikitext.EXPERIMENT, "finetune-cpu", **TOY))
  with pytest.raises(ValueError, match="no checkpoint there"):
    checkpoint_params(tmp_path / "nowhere", pipe, optimizer, data.example_batch)


def test_model_width_scales_gpt2_tiny_and_is_refused_where_it_does_not_apply():
  own = lambda **kw: gpt2_wikitext.Options(**{**dict(model="tiny", pretrained=None, weight_decay=0.0, grad_clip=None,
                                                     block_size=128, tokenizer="bytes"), **kw})
  assert gpt2_wikitext.model_config(own(model_width=128), 257).n_embd == 128
  assert gpt2_wikitext.model_config(own(), 257).n_embd == 64
  with pytest.raises(ValueError, match="--model-width 66: GPT-2 tiny has 4 heads"):
    gpt2_wikitext.model_config(own(model_width=66), 257)
  with pytest.raises(ValueError, match="--model-width scales tiny and protocol-tiny; --model small"):
    gpt2_wikitext.model_config(own(model="small", model_width=128), 257)


def _hub_rows(content: str) -> dict:
  """A split as Hugging Face's wikitext-2-raw-v1 rows hold it: one row per line of the raw file, newline kept, a
  blank line an empty row."""
  return {"text": ["" if not line.strip() else line for line in content.splitlines(keepends=True)]}


def test_the_papers_text_comes_from_the_hub_as_its_rows_joined():
  valid = text.read_text(text.SHIPPED_FILE)
  seen = {}

  def load_dataset(repo, configuration, cache_dir=None):
    seen.update(repo=repo, configuration=configuration)
    return {"train": _hub_rows(valid[:5000]), "validation": _hub_rows(valid[5000:9000])}

  corpus = hub_text.hub_corpus("wikitext2-raw", load_dataset=load_dataset)
  assert seen == {"repo": "Salesforce/wikitext", "configuration": "wikitext-2-raw-v1"}
  assert corpus.train == "".join(_hub_rows(valid[:5000])["text"]) and corpus.train.startswith(" = ")
  assert "WikiText-2 raw v1" in corpus.name
  with pytest.raises(ValueError, match="has no validation split"):
    hub_text.hub_corpus("wikitext2-raw", load_dataset=lambda *a, **k: {"train": _hub_rows(valid)})


def test_the_hub_text_without_datasets_says_what_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
  with pytest.raises(ValueError, match=r"pip install -e \.\[data\]"):
    hub_text.hub_corpus("wikitext2-raw")


def test_data_from_the_hub_and_another_text_are_one_choice(tmp_path):
  with pytest.raises(SystemExit) as exit:
    gpt2_wikitext.cli.main(gpt2_wikitext.EXPERIMENT, ["--data", "wikitext2-raw", "--text", "kjv", "--steps", "1",
                                                      "--out", str(tmp_path)])
  assert exit.value.code == "error: --data wikitext2-raw downloads its text and --text kjv names another: choose one"
  assert not any(tmp_path.iterdir())  # refused before anything was written


def _evals(losses_on, losses_off):
  return {"history": [{"step": 4 * k, "evals": [{"step": 4 * k, "eval_on": {"loss": on}, "eval_off": {"loss": off}}]}
                      for k, (on, off) in enumerate(zip(losses_on, losses_off), 1)]}


def test_the_same_loss_is_where_fp32s_mean_served_curve_made_nine_tenths_of_its_gain():
  fp32 = [_evals([3.0, 2.5, 2.2, 2.0], [3.0, 2.5, 2.2, 2.0]), _evals([3.2, 2.7, 2.4, 2.2], [3.2, 2.7, 2.4, 2.2])]
  assert finetune_report.target_loss(fp32) == pytest.approx(3.1 - 0.9 * (3.1 - 2.1))
  # served: the better of on and off at each evaluation (TopK's on, a quantizer's off)
  method = _evals([2.9, 2.6, 2.3, 2.25], [3.5, 2.4, 2.5, 2.1])
  assert [finetune_report.loss_at(method)[s] for s in (4, 8, 12, 16)] == [2.9, 2.4, 2.3, 2.1]
  assert finetune_report.steps_to(method, 2.2) == 16 and finetune_report.steps_to(method, 2.0) is None


def test_the_study_exports_its_inflation_as_the_finetune_regime_and_keeps_the_table_s_others(tmp_path):
  seeded = lambda run, seed: {**run, "config": {"seed": seed}}
  runs = {"fp32": [seeded(_evals([3.0, 2.5, 2.05, 2.0], [3.0, 2.5, 2.05, 2.0]), 0)],
          "aqsgd-fw3-bw6": [seeded(_evals([3.0, 2.8, 2.4, 2.3], [3.0, 2.6, 2.3, 2.05]), 0)],
          "top10-reuse": [seeded(_evals([3.0, 2.9, 2.8, 2.7], [3.1, 3.0, 2.9, 2.8]), 0)]}
  rung = finetune_report.inflation_rung(runs, width=64, budget=16)  # the same loss: 3.0 - 0.9 x 1.0 = 2.1
  assert [(p["inflation"], p["censored"]) for p in rung["methods"]["aqsgd-fw3-bw6"]] == [(16 / 12, False)]
  assert [(p["inflation"], p["censored"]) for p in rung["methods"]["top10-reuse"]] == [(16 / 12, True)]
  table = tmp_path / "table.json"
  table.write_text(step_table.SHIPPED.read_text())
  finetune.export(argparse.Namespace(export=table), {"w64-h16": rung})
  scratch = step_table.load(table, "scratch")
  assert scratch["rungs"] == step_table.load(None, "scratch")["rungs"]  # kept as it was
  tuned = step_table.load(table, "finetune")
  assert "experiments.finetune" in tuned["provenance"]["command"] and tuned["regime"] == "finetune"
  assert step_table.inflation(tuned, "aqsgd-fw3-bw6", 2925, 1024).value == pytest.approx(16 / 12)


TOY_STUDY = ["--widths", "16", "--seeds", "1", "--pretrain-steps", "2", "--epochs", "2", "--train-examples", "16",
             "--eval-examples", "8", "--eval-every", "1", "--repeats", "1"]


def test_a_one_method_toy_study_runs_and_reports(tmp_path):
  """A toy study of fp32 alone trains and reports; its report's tables are whole (rows on consecutive lines)."""
  text_out = finetune.main([*TOY_STUDY, "--methods", "fp32", "--out", str(tmp_path)])
  assert "## Width 16" in text_out and "| fp32 |" in text_out
  assert "|\n\n|" not in text_out  # a blank line inside a markdown table ends it
  assert (tmp_path / "pretrain" / "results" / "pretrain-w16.json").is_file()


def test_a_pretrained_run_whose_checkpoint_is_gone_is_trained_again(tmp_path, capsys):
  """Shipped results hold no weights: a finished pretraining without its checkpoint is trained again, not skipped
  (its fine-tuning runs load its weights)."""
  argv = [*TOY_STUDY, "--methods", "fp32", "--out", str(tmp_path)]
  finetune.main(argv)
  shutil.rmtree(tmp_path / "pretrain" / "pretrain-w16" / "ckpt")
  shutil.rmtree(tmp_path / "w16")  # the fine-tuning run too, so that it loads the weights again
  capsys.readouterr()
  finetune.main(argv)
  out = capsys.readouterr().out
  assert "[gpt2_wikitext] run pretrain-w16" in out and "pretrain-w16: done, skipped" not in out
  assert (tmp_path / "pretrain" / "pretrain-w16" / "ckpt").is_dir()


@pytest.mark.slow
def test_a_toy_study_pretrains_once_fine_tunes_reports_and_a_rerun_trains_nothing(tmp_path, capsys):
  argv = [*TOY_STUDY, "--methods", "fp32,aqsgd-fw2-bw4,top10-reuse", "--out", str(tmp_path)]
  text_out = finetune.main(argv)
  assert "## Width 16" in text_out and "| top10-reuse |" in text_out and "100mbps" in text_out
  assert (tmp_path / "figure4-w16.png").is_file() and (tmp_path / "figure3-w16.png").is_file()
  capsys.readouterr()
  finetune.main(argv)
  out = capsys.readouterr().out
  assert out.count("done, skipped") == 4 and "[gpt2_wikitext] run" not in out


def test_a_hub_model_without_huggingface_hub_is_one_error_line_saying_what_to_install(monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, "huggingface_hub", None)
  with pytest.raises(SystemExit) as exit:
    gpt2_wikitext.cli.main(gpt2_wikitext.EXPERIMENT, ["--recipe", "paper", "--pretrained", "gpt2", "--steps", "1",
                                                      "--out", str(tmp_path)])
  assert exit.value.code.startswith("error: 'gpt2' is not a local directory and huggingface_hub is not installed")
  assert "pip install -e .[data]" in exit.value.code
