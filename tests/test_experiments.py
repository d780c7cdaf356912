"""Experiment CLIs: 2-step smokes of the presets on the offline defaults, errors, report."""
import dataclasses
import json
import logging
import math
import pathlib
import re
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import gpt2_wikitext, report, resnet_cifar10
from experiments import config
from experiments.cli import main

RESNET_TINY = ["--steps", "2", "--width", "8", "--batch-size", "10", "--train-examples", "40",
               "--eval-examples", "20", "--no-progress"]
GPT2_TINY = ["--steps", "2", "--batch-size", "4", "--block-size", "32", "--train-examples", "16",
             "--eval-examples", "8", "--no-progress"]


def _result(out, run):
  return json.loads((out / "results" / f"{run}.json").read_text())


DENSE_RESNET_BYTES = 10 * (32 * 32 * 8 + 16 * 16 * 16 + 8 * 8 * 32) * 4  # batch x boundary activations x fp32


def _check_resnet_run(run, preset):
  last = run["history"][-1]
  assert "NOT CIFAR-10" in run["config"]["data"]
  assert set(last["eval_on"]) == set(last["eval_off"]) == {"accuracy", "loss"}
  if preset == "baseline":
    assert last["wire_bytes_fwd"] == last["wire_bytes_bwd"] == DENSE_RESNET_BYTES
  else:
    assert last["wire_bytes_fwd"] < DENSE_RESNET_BYTES / 3


# by default baseline and top10 run (and are checked the same way) in test_report_table_and_plot
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["baseline", "fw2-bw4", "fw4-bw8", "ef21-top10", "top10", "ef21-top5"])
def test_resnet_presets_smoke(tmp_path, preset):
  main(resnet_cifar10.EXPERIMENT, ["--preset", preset, "--out", str(tmp_path), *RESNET_TINY])
  _check_resnet_run(_result(tmp_path, preset), preset)


def _check_gpt2_run(run, preset):
  assert run["config"]["data"].startswith("WikiText-2 validation split (tokenized release")
  assert run["config"]["data"].endswith("articles 1-54 train, 55-60 eval (NOT the papers' WikiText-2 train/test); "
                                        "byte tokens")
  assert run["config"]["model"] == "tiny" and run["config"]["recipe"] == "tiny"
  last = run["history"][-1]
  assert last["eval_on"]["perplexity"] > 1 and last["mode"] == ("warmup" if preset.startswith("aqsgd") else "train")
  for which in ("eval_on", "eval_off"):  # corpus perplexity over 2 eval batches: exp(mean token CE)
    assert last[which]["perplexity"] == pytest.approx(math.exp(last[which]["loss"]), rel=1e-12)


# by default top10-reuse runs (and is checked the same way) in test_gpipe_executor_from_the_cli
@pytest.mark.parametrize("preset", ["aqsgd-fw2-bw4", *(pytest.param(p, marks=pytest.mark.slow)
                                                       for p in ("top10-reuse", "top10-separate", "direct-fw3-bw6"))])
def test_gpt2_presets_smoke(tmp_path, preset):
  main(gpt2_wikitext.EXPERIMENT, ["--preset", preset, "--out", str(tmp_path), *GPT2_TINY, "--eval-every", "1",
                                  "--target-loss", "10"])
  run = _result(tmp_path, preset)
  _check_gpt2_run(run, preset)
  assert [e["step"] for r in run["history"] for e in r["evals"]] == [1, 2]
  assert run["target"] == {"loss": 10.0, "step": 1, "evaluated": 2,
                           **min(({"best_loss": e["eval_on"]["loss"], "best_step": e["step"]}
                                  for r in run["history"] for e in r["evals"]), key=lambda b: b["best_loss"])}
  assert (tmp_path / "results" / f"{preset}.png").stat().st_size > 10_000  # the run's own plot


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_a_learned_bottleneck_from_the_cli(tmp_path):
  main(gpt2_wikitext.EXPERIMENT, ["--bottleneck", "subspace:8", "--fwd", "maxabs:4", "--out", str(tmp_path),
                                  *GPT2_TINY])
  last = _result(tmp_path, "maxabs_4_none_subspace_8")["history"][-1]
  assert last["wire_bytes_bwd"] == 3 * 4 * 32 * 8 * 4  # 3 boundaries x 4 x 32 tokens x r = 8 fp32 gradients


def test_list_presets_shows_each_paper_row_and_the_bytes_it_sends(capsys):
  from experiments import paper
  from jaxcomp.compress.spec import parse_boundary
  from jaxcomp.parallel import simulate
  main(gpt2_wikitext.EXPERIMENT, ["--list-presets", "--batch-size", "4", "--block-size", "32", "--microbatches", "2"])
  lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
  assert set(gpt2_wikitext.PRESETS) <= set(lines)
  run = config.resolve(gpt2_wikitext.EXPERIMENT, batch_size=4, block_size=32, microbatches=2)
  pipe, _, batch, _ = gpt2_wikitext.abstract(run)
  for preset, (loss, ppl) in paper.GPT2.items():
    spec = gpt2_wikitext.PRESETS[preset]
    sent = simulate.wire_bytes_per_step(
        dataclasses.replace(pipe, boundary=parse_boundary(spec.get("fwd", "none"), spec.get("bwd", "none"))), batch)
    assert f" {sent['fwd']:,} " in lines[preset] and f" {sent['bwd']:,} " in lines[preset], (preset, sent)
    assert f"eval loss {loss}, ppl {ppl}" in lines[preset]
  assert "AQ-SGD" in lines["aqsgd-fw2-bw4"] and "first 1 epoch(s) dense" in lines["aqsgd-fw2-bw4"]


def test_help_groups_the_flags_and_shows_each_recipes_default(capsys):
  with pytest.raises(SystemExit):
    main(gpt2_wikitext.EXPERIMENT, ["--help"])
  out = capsys.readouterr().out
  titles = [title.split(" (")[0] for title in re.findall(r"^(\S.*):$", out, re.M)]
  assert titles == ["options", "compression", "model and training", "parallelism and multi-host", "tied parameters",
                    "data", "output and resume"]
  text = re.sub(r"\s+", " ", out)
  assert "--epochs EPOCHS training epochs (default: 2; 4 with --recipe paper; 3000 with --recipe protocol; 1 with" in text
  assert "--block-size BLOCK_SIZE tokens per example (default: 128; 1024 with --recipe paper; 1024 with --recipe " \
         "protocol)" in text
  # unset by the default recipe: RUN_DEFAULTS', the experiment's own default, or the CLI's words for it
  assert "after the last (default: epoch ends; 25 with --recipe protocol; 25 with --recipe" in text
  assert "falls linearly to 0 (1: from the start) (default: 1.0; 0.7 with --recipe protocol; 0.7 with" in text
  assert "(default: simulate; sharded with --recipe protocol)" in text
  assert "--warmup-epochs WARMUP_EPOCHS epochs sent uncompressed first (AQ-SGD fills its buffers) (default: 0)" in text


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_text_files_with_byte_tokens_and_an_explicit_recipe(tmp_path, capsys):
  (tmp_path / "train.txt").write_text("".join(f" = Article {i} = \n \n words of article {i} . \n" * 3
                                              for i in range(10)))
  (tmp_path / "eval.txt").write_text(" = Held out = \n \n other words . \n" * 20)
  main(gpt2_wikitext.EXPERIMENT, ["--recipe", "paper", "--model", "tiny", "--tokenizer", "bytes",
                                  "--train-file", str(tmp_path / "train.txt"), "--valid-file", str(tmp_path / "eval.txt"),
                                  "--out", str(tmp_path), *GPT2_TINY])
  out = capsys.readouterr().out
  assert "configuration (recipe paper < preset None < flags): batch_size=4, block_size=32" in out
  assert "epochs=4," in out and "lr=5e-05," in out and "model=tiny," in out and "tokenizer=bytes," in out
  config = _result(tmp_path, "none_none")["config"]
  assert config["data"] == f"text files {tmp_path / 'train.txt'} (train), {tmp_path / 'eval.txt'} (eval); byte tokens"
  assert (config["recipe"], config["model"], config["lr"], config["epochs"]) == ("paper", "tiny", 5e-5, 4)


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_sharded_executor_from_the_cli(tmp_path):
  main(gpt2_wikitext.EXPERIMENT, ["--preset", "top10-reuse", "--executor", "sharded", "--microbatches", "2",
                                  "--stages", "2", "--data-parallel", "2", "--grad-compression", "ef+quant:4",
                                  "--out", str(tmp_path), *GPT2_TINY])
  run = _result(tmp_path, "top10-reuse")
  _check_gpt2_run(run, "top10-reuse")
  last = run["history"][-1]
  assert last["steps_per_s"] is not None and last["wire_bytes_data"] > 0


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_the_tied_exchange_from_the_cli_and_a_resume_that_changes_it(tmp_path, capsys):
  """--untie-embeddings (GPT-2's head a copy of the embedding, trained on its own: nothing tied, nothing exchanged)
  and --tied-compression on the gpipe executor; a resumed run with another choice is one error line, whether the
  results file or only the checkpoint says what the run chose."""
  gpipe = ["--executor", "gpipe", "--stages", "2", "--microbatches", "2", "--out", str(tmp_path), *GPT2_TINY]
  main(gpt2_wikitext.EXPERIMENT, [*gpipe, "--untie-embeddings", "--run-name", "untied", "--epochs", "1"])
  main(gpt2_wikitext.EXPERIMENT, [*gpipe, "--tied-compression", "ef+maxabs:4:group=64:scales=group",
                                  "--run-name", "blocks"])
  untied, blocks = _result(tmp_path, "untied"), _result(tmp_path, "blocks")
  assert untied["config"]["untie_embeddings"] is True and "wire_bytes_tied" not in untied["history"][-1]
  assert blocks["config"]["tied_compression"] == "ef+maxabs:4:group=64:scales=group"
  segment = 257 * 64  # the byte vocabulary's embedding, [257, 64]
  assert blocks["history"][-1]["wire_bytes_tied"] == 2 * (segment // 2 + segment // 64 * 4)  # 4-bit codes, a scale / 64
  capsys.readouterr()
  assert _refused(gpt2_wikitext.EXPERIMENT, [*gpipe, "--run-name", "untied", "--resume", "--epochs", "2"]) == (
      "error: --resume with a changed configuration (untie_embeddings True -> False); resume with the original "
      "values, or start a new run with another --run-name")
  (tmp_path / "results" / "untied.json").unlink()  # only the checkpoint remembers
  message = _refused(gpt2_wikitext.EXPERIMENT, [*gpipe, "--run-name", "untied", "--resume", "--epochs", "2"])
  assert message.startswith("error: the checkpoint of epoch 1 in ") and "was saved by a run with other tied " \
      "parameters (tied [] -> [[[0, ['wte']], [1, ['wte']]]]; init_copies [[[0, ['wte']], [1, ['wte']]]] -> [])" \
      in message, message


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_interleaved_schedule_from_the_cli(tmp_path, capsys):
  """--schedule interleaved:2 on 2 stage devices cuts the 4-block GPT-2 into 4 stages (its tied embedding
  and head on devices 0 and 1)."""
  main(gpt2_wikitext.EXPERIMENT, ["--executor", "sharded", "--schedule", "interleaved:2", "--stages", "2",
                                  "--microbatches", "2", "--out", str(tmp_path), *GPT2_TINY])
  assert "4 stages x 2 microbatches" in capsys.readouterr().out
  run = _result(tmp_path, "none_none")
  assert run["config"]["schedule"] == "interleaved:2"
  _check_gpt2_run(run, "none_none")


def test_warm_start_preset_needs_a_baseline():
  with pytest.raises(SystemExit, match="run the baseline preset first and pass its folder with --init-from"):
    main(resnet_cifar10.EXPERIMENT, ["--preset", "ef21-top10-base20", *RESNET_TINY])


@pytest.mark.parametrize("argv, match", [
    (["--preset", "top11"], "unknown preset 'top11'; valid presets: baseline, fw4-bw8"),
    (["--fwd", "quant:17"], "bits must be an integer in 1..16, got 17"),
    (["--fwd", "zip:3"], "unknown compressor 'zip:3'"),
    (["--bwd", "reuse"], "index reuse needs a single TopK forward"),
])
def test_cli_errors_name_the_bad_value(argv, match):
  with pytest.raises(SystemExit, match=match):
    main(resnet_cifar10.EXPERIMENT, argv)


def test_the_gpt2_tokenizer_without_its_files_says_where_they_come_from(tmp_path):
  with pytest.raises(SystemExit, match=r"--pretrained gpt2 downloads them with the weights, or pass --tokenizer-dir "
                                       r"DIR .*--tokenizer bytes is for a model trained from scratch"):
    main(gpt2_wikitext.EXPERIMENT, ["--tokenizer", "gpt2", "--out", str(tmp_path)])


def _refused(exp, argv):
  """The one `error:` line main exits with (the interpreter prints it to stderr, exit status 1)."""
  with pytest.raises(SystemExit) as exit_:
    main(exp, argv)
  message = exit_.value.code
  assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, message
  return message


def _tree(folder):
  return sorted((str(p.relative_to(folder)), p.stat().st_mtime_ns) for p in folder.rglob("*")) if folder.exists() else []


@pytest.mark.parametrize("flags, message", [
    (["--batch-size", "0"], "error: --batch-size must be at least 1, got 0"),
    (["--train-examples", "0"], "error: --train-examples must be at least 1, got 0"),
    (["--batch-size", "30"], "error: --batch-size 30 is larger than the evaluation set (20 examples); use "
                             "--batch-size 20 or less, or a larger --eval-examples"),
    (["--train-examples", "5"], "error: --batch-size 10 is larger than the training set (5 examples); use "
                                "--batch-size 5 or less, or a larger --train-examples"),
    (["--run-name", "a/b"], "error: --run-name 'a/b' must be one folder name (letters, digits and . _ + -, not "
                            "starting with . _ + -), e.g. a_b"),
    (["--resume"], "error: --resume: run 'none_none' has no checkpoint in OUT/none_none/ckpt; check --out and "
                   "--run-name, or start the run without --resume"),
    (["--preset", "ef21-top10-base20", "--init-from", "OUT/nowhere"],
     "error: --init-from OUT/nowhere: no checkpoints in OUT/nowhere/ckpt; pass the folder of a baseline run"),
    (["--data-dir", "OUT/typo"], "error: CIFAR-10 --data-dir OUT/typo is not a folder"),
    (["--stages", "3"], "error: --stages 3: ResNet18 splits into [1, 2, 4] stages; pass one of those"),
    (["--executor", "sharded", "--data-parallel", "4"],
     "error: --executor sharded needs 16 devices (4 stages x 4 data-parallel), found 8 cpu; on CPU, make fake devices: "
     "XLA_FLAGS=--xla_force_host_platform_device_count=16 python -m experiments.resnet_cifar10 ... (or use "
     "--executor simulate)"),
])
def test_cli_errors_after_parsing_are_one_line_and_create_nothing(tmp_path, flags, message):
  out = tmp_path / "out"
  flags = [f.replace("OUT", str(out)) for f in flags]
  assert _refused(resnet_cifar10.EXPERIMENT, [*RESNET_TINY, "--out", str(out), *flags]).startswith(
      message.replace("OUT", str(out)))
  assert not out.exists()


GPT2_ISSUE = ["--train-examples", "64", "--eval-examples", "16", "--batch-size", "8", "--epochs", "1", "--no-progress"]
WIDTH_64 = "does not fit this model's boundary activations float32[8, 128, 64]: "


@pytest.mark.parametrize("flags, message", [
    (["--fwd", "maxabs:4:group=7"], f"--fwd maxabs:4:group=7 {WIDTH_64}maxabs group=7 does not divide the 64 features"),
    (["--fwd", "hadamard:128+maxabs:4"], f"--fwd hadamard:128+maxabs:4 {WIDTH_64}Hadamard block 128 does not divide"),
    (["--bwd", "maxabs:4:group=48"], f"--bwd maxabs:4:group=48 {WIDTH_64}maxabs group=48 does not divide"),
    (["--fwd", "adaptive:2:4:0.25:group=5"], f"--fwd adaptive:2:4:0.25:group=5 {WIDTH_64}adaptive group=5 does not"),
    (["--schedule", "1f1b", "--executor", "simulate"], "--schedule 1f1b needs --executor sharded (the simulate executor"),
    (["--executor", "sharded", "--schedule", "zb-h1", "--overlap"], "overlapped sends (--overlap) need at least 2S "
                                                                  "microbatches per data shard: got M=1 for S=4"),
    (["--schedule", "interleaved:0"], "--schedule: schedule must be one of ['gpipe', '1f1b', '1f1b-fused', 'zb-h1'] or "
                                      "interleaved:V (V >= 1 chunks per device), got 'interleaved:0'"),
    (["--schedule", "interleaved:2"], "--schedule interleaved:2 needs --executor sharded"),
    (["--executor", "sharded", "--schedule", "interleaved:2", "--stages", "4", "--microbatches", "4"],
     "--stages 4 x 2 chunks per device (--schedule interleaved:2): this GPT-2 has 4 blocks, so it splits into 1..4"),
    (["--executor", "sharded", "--schedule", "interleaved:2", "--stages", "2", "--microbatches", "3"],
     "--schedule interleaved:2 needs --microbatches a multiple of --stages: got --microbatches 3 for --stages 2; use "
     "--microbatches 4"),
    (["--executor", "sharded", "--schedule", "interleaved:2", "--stages", "2", "--microbatches", "2", "--overlap"],
     "overlapped sends (--overlap) need at least 2S microbatches per data shard: got M=2 for S=2 stages; use "
     "--microbatches 4"),
    (["--microbatches", "3"], "--batch-size 8 does not split into 1 data shard(s) x --microbatches 3 equal "
                              "microbatches; use a multiple of 3 (e.g. --batch-size 6) or other --microbatches"),
    (["--grad-compression", "ef+quant:4"], "--grad-compression ef+quant:4 needs --executor sharded"),
    (["--fwd", "aqsgd+quant:4", "--aqsgd-buffers", "FILE"], "--aqsgd-buffers FILE is not a folder; pass a folder"),
    (["--lr", "nan"], "--lr must be a finite positive number, got nan"),
    (["--lr", "inf"], "--lr must be a finite positive number, got inf"),
    (["--out", "FILE"], "--out FILE is not a folder; pass a folder (it is created if missing)"),
    (["--out", "FILE/runs"], "--out FILE/runs is not a folder (FILE is a file); pass a folder"),
    (["--block-size", "100000"], "the eval text of WikiText-2 validation split"),
    (["--block-size", "1"], "--block-size must be at least 2, got 1"),
    (["--warmup-epochs", "-1"], "--warmup-epochs must be at least 0, got -1"),
    (["--seed", "-1"], "--seed must be an integer in 0..2^63-1, got -1"),
    (["--stages", "100"], "--stages 100: this GPT-2 has 4 blocks, so it splits into 1..4 stages; pass one of those"),
    (["--bottleneck", "proj:100"], "--bottleneck proj:100: bottleneck rank 100 is larger than the 64 features at the "
                                   "boundaries; pass a rank of at most 64"),
    (["--bottleneck", "lowrank:8"], "--bottleneck lowrank:8: bottleneck kind must be one of proj, subspace"),
    (["--outliers", "4x64"], "--outliers '4x64': expected N:SCALE[:MASSIVE], e.g. 4:64:1024"),
    (["--outliers", "65:64"], "--outliers '65:64': N must be in 1..64 (the model's width)"),
    (["--outliers", "1:64:100"], "--outliers '1:64:100': massive=100.0 sits in two outlier channels"),
    (["--eval-every", "0"], "--eval-every must be at least 1, got 0"),
    (["--target-loss", "nan"], "--target-loss must be a finite number, got nan"),
    (["--stop-at-target"], "--stop-at-target ends the run at --target-loss: give --target-loss L"),
    (["--optimizer", "muon"], "--optimizer muon splits a Protocol NanoGPT model's parameters"),
    (["--model", "protocol-tiny", "--dropout", "0.1"], "--outliers and --dropout change GPT-2 models; --model "
                                                       "protocol-tiny has neither"),
    (["--cooldown", "0"], "--cooldown must be in (0, 1] (the share of the schedule that decays), got 0.0"),
    (["--weight-decay", "-1"], "--weight-decay must be a finite number >= 0, got -1.0"),
    (["--model", "protocol-tiny", "--optimizer", "muon", "--embed-lr", "-1"],
     "--embed-lr must be a finite number >= 0, got -1.0"),
])
def test_bad_input_is_one_error_line_before_anything_is_created(tmp_path, capsys, flags, message):
  """Each is refused before the run line is printed or a folder is made (the specs by an abstract trace)."""
  file = tmp_path / "FILE"
  file.write_text("")
  flags = [f.replace("FILE", str(file)) for f in flags]
  error = _refused(gpt2_wikitext.EXPERIMENT, [*GPT2_ISSUE, "--out", str(tmp_path / "out"), *flags])
  assert error.startswith("error: " + message.replace("FILE", str(file))), error
  assert capsys.readouterr().out == "" and sorted(p.name for p in tmp_path.iterdir()) == ["FILE"]
  if "100000" in flags:
    assert error.endswith("block_size 100000 makes 1 examples, fewer than the 8 of one batch; use --block-size "
                          "15372 or less (or a smaller --batch-size)")


@pytest.mark.skipif(not pathlib.Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_out_folder_the_os_refuses_is_one_error_line(tmp_path, capsys):
  error = _refused(gpt2_wikitext.EXPERIMENT, [*GPT2_ISSUE, "--out", "/proc/jaxcomp-test-out"])
  assert error.startswith("error: --out") and error.endswith("a folder you can write"), error
  assert capsys.readouterr().out == "" and not pathlib.Path("/proc/jaxcomp-test-out").exists()


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_resume_and_warm_start_take_what_matches_and_refuse_the_rest(tmp_path, caplog, capsys):
  out = ["--out", str(tmp_path), *RESNET_TINY, "--epochs", "3"]
  main(resnet_cifar10.EXPERIMENT, ["--preset", "baseline", *out])
  capsys.readouterr()
  damaged = tmp_path / "damaged"
  for folder in ("baseline", "results"):
    shutil.copytree(tmp_path / folder, damaged / folder)
  for f in (damaged / "baseline" / "ckpt").rglob("*"):
    if f.is_file():
      f.write_bytes(b"")  # every checkpoint file truncated
  kept = _tree(damaged / "baseline")
  assert _refused(resnet_cifar10.EXPERIMENT, ["--preset", "baseline", *out, "--out", str(damaged), "--resume"]) == (
      f"error: --resume: no intact checkpoint in {damaged / 'baseline' / 'ckpt'} (epochs [1]): the checkpoint of epoch "
      f"1 in {damaged / 'baseline' / 'ckpt'} is corrupt: its meta does not read back (JSONDecodeError); nothing intact "
      f"to resume from: move {damaged / 'baseline'} away (or delete it) and start the run again without --resume, or "
      "start it under another --run-name")
  assert _refused(resnet_cifar10.EXPERIMENT, ["--preset", "ef21-top10-base20", "--init-epoch", "1", *out, "--out",
                                              str(damaged), "--init-from", str(damaged / "baseline")]).startswith(
      f"error: --init-from {damaged / 'baseline'}: the checkpoint of epoch 1 in {damaged / 'baseline' / 'ckpt'} is "
      "corrupt: its meta does not read back (JSONDecodeError); train the baseline again, or warm-start from another")
  printed = capsys.readouterr()
  assert printed.out == ""  # refused before the run line
  errors = printed.err
  assert "Failed to json parse" not in caplog.text + errors  # Orbax's ERROR for what we handle
  assert _tree(damaged / "baseline") == kept and sorted(p.name for p in damaged.iterdir()) == ["baseline", "results"]
  before = _tree(tmp_path)
  message = _refused(resnet_cifar10.EXPERIMENT, ["--preset", "baseline", *out, "--resume", "--lr", "0.1",
                                                 "--seed", "3", "--fwd", "quant:4"])
  assert message == ("error: --resume with a changed configuration (fwd 'none' -> 'quant:4'; lr 0.01 -> 0.1; "
                     "seed 0 -> 3); resume with the original values, or start a new run with another --run-name")
  assert _refused(resnet_cifar10.EXPERIMENT, ["--preset", "baseline", *out]).startswith(
      "error: run 'baseline' already has checkpoints in ")
  message = _refused(resnet_cifar10.EXPERIMENT, ["--preset", "ef21-top10-base20", "--init-epoch", "1", *out,
                                                 "--width", "16", "--init-from", str(tmp_path / "baseline")])
  assert message.startswith(f"error: warm start: the checkpoint of epoch 1 in {tmp_path / 'baseline' / 'ckpt'} holds "
                            "a different model (") and message.endswith(
      "); warm-start from a run of the same model (size/width, stages, vocabulary)")
  assert _refused(resnet_cifar10.EXPERIMENT, ["--preset", "ef21-top10-base20", "--init-epoch", "2", *out,
                                              "--init-from", str(tmp_path / "baseline")]) == (
      f"error: --init-from {tmp_path / 'baseline'} has checkpoints of epochs [1], not of --init-epoch 2; pass one of "
      "those or train the baseline further")
  assert _tree(tmp_path) == before  # nothing created or overwritten
  (tmp_path / "results" / "baseline.json").write_text("{")  # damaged results: noted, rewritten after the epoch
  main(resnet_cifar10.EXPERIMENT, ["--preset", "baseline", *out, "--resume", "--steps", "4"])  # epochs may change
  printed = capsys.readouterr()
  errors += printed.err
  assert (f"note: {tmp_path / 'results' / 'baseline.json'} is not readable as JSON: JSONDecodeError, so the resumed "
          "configuration cannot be compared with the original") in printed.out
  assert _result(tmp_path, "baseline")["config"]["steps"] == 4
  main(resnet_cifar10.EXPERIMENT, ["--preset", "ef21-top10-base20", "--init-epoch", "1", *out, "--steps", "6",
                                   "--init-from", str(tmp_path / "baseline")])  # 4 steps per epoch: epoch 2 only
  assert [r["epoch"] for r in _result(tmp_path, "ef21-top10-base20")["history"]] == [2]
  logs = caplog.text + errors + capsys.readouterr().err  # saves, resumes, warm-start reads: none of Orbax's noise
  assert "Skipping merge of OCDBT" not in logs and "could not be restored" not in logs, logs
  logging.getLogger("absl").warning("a real warning")
  assert "a real warning" in caplog.text


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_the_progress_bar_counts_steps_after_the_compiling_step(tmp_path, capsys):
  main(gpt2_wikitext.EXPERIMENT, ["--out", str(tmp_path), *[f for f in GPT2_TINY if f != "--no-progress"]])
  err = capsys.readouterr().err
  assert "epoch 1/2: compiling the train step" in err
  assert re.search(r"epoch 1/2 \(compiled in [\d.]+ s\):  25%\|[^|]*\| 1/4 \[00:00<\?, \?it/s\]", err), err
  assert "0/4" not in err  # the counting bar starts after the first step


def test_errors_reach_stderr_with_exit_status_1(tmp_path):
  import subprocess
  import sys
  done = subprocess.run([sys.executable, "-m", "experiments.gpt2_wikitext", "--batch-size", "0",
                         "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
  assert (done.returncode, done.stdout, done.stderr) == (1, "", "error: --batch-size must be at least 1, got 0\n")
  assert not (tmp_path / "out").exists()


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_report_table_and_plot(tmp_path):
  for preset in ("baseline", "top10"):
    main(resnet_cifar10.EXPERIMENT, ["--preset", preset, "--out", str(tmp_path), *RESNET_TINY])
    _check_resnet_run(_result(tmp_path, preset), preset)
  report.main([str(tmp_path / "results"), "--paper", "resnet"])
  table = (tmp_path / "results" / "report.md").read_text()
  assert "| top10 |" in table and "| 75.89 | 91.87 |" in table
  assert (tmp_path / "results" / "curves.png").stat().st_size > 10_000


def test_jaxcomp_warnings_are_one_line_in_the_clis(capsys):
  import io

  from experiments.cli import one_line_warning
  from jaxcomp.runtime import train
  ours, theirs = io.StringIO(), io.StringIO()
  one_line_warning(UserWarning("the checkpoint of epoch 2 is corrupt;\n  trying the previous"), UserWarning,
                   train.__file__, 1, ours)
  one_line_warning(UserWarning("from elsewhere"), UserWarning, json.__file__, 7, theirs)
  assert ours.getvalue() == "warning: the checkpoint of epoch 2 is corrupt; trying the previous\n"
  assert theirs.getvalue().startswith(f"{json.__file__}:7: UserWarning: from elsewhere")


def test_resuming_a_run_recorded_before_its_defaults_were_stored(tmp_path):
  """Results written before RunDefaults existed lack those keys: they compare as the defaults they ran with."""
  from experiments.config import RUN_DEFAULTS, check_resumed_config
  from jaxcomp.runtime import results
  old = {"fwd": "quant:4", "bwd": "quant:8", "lr": 0.01}
  results.write(tmp_path, "r", old, [])
  check_resumed_config({**RUN_DEFAULTS, **old, "epochs": 3}, tmp_path / "r.json")
  with pytest.raises(ValueError, match=r"executor 'simulate' -> 'sharded'"):
    check_resumed_config({**RUN_DEFAULTS, **old, "executor": "sharded"}, tmp_path / "r.json")


def test_the_sharded_executors_old_name_is_still_taken_and_recorded_as_sharded(tmp_path):
  """--executor gpipe (the sharded executor's name before the schedules had names) parses as sharded, and a run
  recorded under it resumes as sharded, unchanged."""
  from experiments.cli import parser_for
  from experiments.config import RUN_DEFAULTS, check_resumed_config, executor_name
  from jaxcomp.runtime import results
  assert parser_for(gpt2_wikitext.EXPERIMENT).parse_args(["--executor", "gpipe"]).executor == "sharded"
  assert executor_name("gpipe") == executor_name("sharded") == "sharded"
  with pytest.raises(ValueError, match=r"--executor must be one of \['simulate', 'sharded'\], got 'pipedream'"):
    executor_name("pipedream")
  results.write(tmp_path, "r", {**RUN_DEFAULTS, "executor": "gpipe", "schedule": "1f1b", "stages": 4}, [])
  check_resumed_config({**RUN_DEFAULTS, "executor": "sharded", "schedule": "1f1b", "stages": 4}, tmp_path / "r.json")


def test_a_run_resumes_on_another_schedule_with_the_models_stages(tmp_path):
  """The schedule and the stage devices may change (the checkpoint converts the rows), the model's stages not."""
  from experiments.config import RUN_DEFAULTS, check_resumed_config
  from jaxcomp.runtime import results
  folder = tmp_path
  results.write(folder, "r", {**RUN_DEFAULTS, "executor": "sharded", "schedule": "1f1b", "stages": 4}, [])
  for schedule, stages in (("zb-h1", 4), ("interleaved:2", 2), ("interleaved:4", 1)):
    check_resumed_config({**RUN_DEFAULTS, "executor": "sharded", "schedule": schedule, "stages": stages},
                         folder / "r.json")
  with pytest.raises(ValueError, match=r"the model's stages \(--stages x V of --schedule interleaved:V\) 4 -> 8"):
    check_resumed_config({**RUN_DEFAULTS, "executor": "sharded", "schedule": "interleaved:2", "stages": 4},
                         folder / "r.json")


def test_boundary_error_weighs_every_channel_the_same():
  """An error of its own size in 1 of 4 channels of small variation is 1/4 by the channel mean, however small a
  share of the pooled energy that channel has (the outlier model's ordinary channels beside its x64 ones)."""
  from experiments import boundary_error
  a = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 4)) * np.array([1e-3, 64.0, 64.0, 64.0]), jnp.float32)
  error = jnp.zeros_like(a).at[..., 0].set(boundary_error.varying(a)[..., 0])
  assert float(boundary_error.channel_varying_error(error, a)) == pytest.approx(0.25, rel=1e-5)
  assert float(jnp.sum(error ** 2) / jnp.sum(boundary_error.varying(a) ** 2)) < 1e-6  # pooled, it vanishes


def test_boundary_error_measures_each_boundary_and_refuses_aqsgd(tmp_path, capsys):
  """Dense messages err by 0 and carry the exact gradient (cosine 1); `maxabs:2` errs; the messages' inputs are
  saved; AQ-SGD (rows per training example) is one error line."""
  from experiments import boundary_error
  rows = boundary_error.main([*GPT2_TINY, "--fwd", "none", "--bwd", "maxabs:2", "--every", "1",
                              "--save", str(tmp_path / "m.npz"), "--json", str(tmp_path / "m.json")])
  assert [r["step"] for r in rows] == [0, 1, 2] and rows[0]["train_loss"] is None
  assert all(r["fwd"] == [0.0, 0.0, 0.0] and len(r["grad_cos"]) == 4 for r in rows)
  assert all(0.01 < e < 1.0 for r in rows for e in r["bwd"])
  assert rows[-1]["grad_cos"][-1] == pytest.approx(1.0, abs=1e-5)  # the last stage gets the exact gradient
  with np.load(tmp_path / "m.npz") as saved:
    assert sorted(saved) == ["bwd_0", "bwd_1", "bwd_2", "fwd_0", "fwd_1", "fwd_2"]
    assert saved["fwd_0"].shape == (4, 32, 64)
  assert json.loads((tmp_path / "m.json").read_text())["rows"] == rows
  with pytest.raises(ValueError, match="no rows in AQ-SGD's per-example table"):
    boundary_error.main([*GPT2_TINY, "--fwd", "aqsgd+maxabs:2", "--bwd", "none"])
