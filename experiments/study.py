"""A study's runs: one gpt2_wikitext run per method, seed and budget, skipped when finished and resumed when
interrupted (what `experiments.frontier` and `experiments.ladder` share)."""
import datetime
import json
import math
import os
import pathlib
import platform
import subprocess
import sys

from experiments import config, gpt2_wikitext, runner
from jaxcomp import methods
from jaxcomp.data import batching
from jaxcomp.runtime import evaluation, train


def run_name(method: str, seed: int) -> str:
  """The run of one method and seed: the method's name for seed 0, METHOD-seedK otherwise."""
  return method if seed == 0 else f"{method}-seed{seed}"


def run_config(name: str, args, seed: int = 0, resume: bool = False, **settings) -> config.RunConfig:
  """The gpt2_wikitext run of one method (`jaxcomp.methods`) and seed: its own run name, `args.steps` budget (the
  lr schedule over it when a recipe is given) and folder, with `settings` (other flags, e.g. text, width)."""
  spe = batching.num_batches(args.train_examples, args.batch_size)
  return config.resolve(gpt2_wikitext.EXPERIMENT, args.recipe, **methods.get(name).run_settings(),
                        steps=args.steps, epochs=math.ceil(args.steps / spe), batch_size=args.batch_size, seed=seed,
                        train_examples=args.train_examples, eval_examples=args.eval_examples,
                        out=str(args.out), run_name=run_name(name, seed), resume=resume, no_progress=True,
                        outliers=args.outliers,
                        lr_steps=args.steps if args.recipe else None, eval_every=args.eval_every,
                        microbatches=args.microbatches,
                        target_loss=args.target_loss, stop_at_target=args.stop_at_target, **settings)


def finished(out: pathlib.Path, name: str, steps: int, outliers: str | None = None, target: float | None = None,
             **settings) -> dict | None:
  """The method's results if they cover the whole budget, or evaluate at or below `target`, else None; ValueError
  if they are of a model with other `--outliers`, or other `settings` (`recipe`, `eval_every`: None for the
  defaults)."""
  path = out / "results" / f"{name}.json"
  if not path.is_file():
    return None
  run = json.loads(path.read_text())
  expected = {"outliers": outliers, **settings}
  recipe = expected.get("recipe") or gpt2_wikitext.EXPERIMENT.default_recipe
  if "recipe" in expected:
    expected["recipe"] = recipe
  if expected.get("eval_every", 0) is None:  # the recipe's own (protocol-cpu evaluates every 25 steps)
    expected["eval_every"] = gpt2_wikitext.RECIPES[recipe].get("eval_every")
  for key, value in expected.items():
    if run["config"].get(key) != value:
      raise ValueError(f"{path} is a run with --{key.replace('_', '-')} {run['config'].get(key)}, this study has "
                       f"--{key.replace('_', '-')} {value}: give each its own --out")
  if not run["history"]:
    return None
  reached = target is not None and evaluation.target_summary(run["history"], target)["step"] is not None
  return run if reached or run["history"][-1]["step"] >= steps else None


def run_or_resume(name: str, args, seed: int, checked: dict, tag: str, **settings) -> dict:
  """The finished results of method `name`'s run with `seed` on `args`' budget (`run_config`, with `settings`):
  read if done (`finished`, against `checked`: the settings a done run must have), else trained, resumed from its
  last checkpoint if an earlier run was interrupted."""
  out, run = pathlib.Path(args.out), run_name(name, seed)
  done = finished(out, run, args.steps, args.outliers, args.target_loss, **checked)
  if done is not None:
    print(f"[{tag}] {run}: done, skipped")
    return done
  resume = bool(train.saved_epochs(out / run / "ckpt"))  # interrupted after a checkpoint (not merely its folder)
  runner.run(gpt2_wikitext.EXPERIMENT, run_config(name, args, seed, resume=resume, **settings))
  return finished(out, run, args.steps, args.outliers, args.target_loss, **checked)


def provenance(module: str, **described) -> dict:
  """Where a study's exported figures come from: its command (`python -m experiments.MODULE` and this process's
  arguments), the commit, the machine and the date, with `described` (what it trained on)."""
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=pathlib.Path(__file__).parent).stdout.strip() or "unknown"
  return {"command": f"python -m experiments.{module} " + " ".join(sys.argv[1:]), "commit": commit,
          "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores".replace("  ", " "),
          "date": datetime.date.today().isoformat(), **described}


def export_regime(path: pathlib.Path, regime: str, table: dict) -> None:
  """Writes `table` (with its own provenance) as regime `regime` of the step-inflation file at `path`, the file's
  other regimes kept as they are (a file of one table without regimes counts as its `scratch`)."""
  data = json.loads(path.read_text()) if path.is_file() else {}
  regimes = data.get("regimes", {"scratch": data} if data else {})
  if "provenance" in data:  # the file-wide provenance belongs to the regime it was written for
    regimes = {k: {"provenance": data["provenance"], **v} for k, v in regimes.items()}
  regimes[regime] = table
  path.write_text(json.dumps({"regimes": regimes}, indent=1))
