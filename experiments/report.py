"""Markdown table of finished runs beside the papers' numbers, and learning-curve plots.

    python -m experiments.report runs/resnet_cifar10/results --paper resnet
    python -m experiments.report runs/gpt2_wikitext/results --paper gpt2

For each run (one JSON per run): the last epoch's evaluation with compression off and on,
bytes on the wire per compressed step and the run's average per step (dense warm-up and
AQ-SGD first-visit steps included), steps/s, and the paper's (off, on) for the same preset.
Runs whose configurations differ only by `--seed` (and run name, output folder, resume flags)
are one row: the evaluation columns give mean ± sample std over their seeds. Plot (curves.png):
the evaluation metric per epoch, compression off (solid) and on (dashed), one line per row (the
mean over its seeds, a band of ± std), beside each row's last evaluation against its bytes per
train step.
"""
import argparse
import json
import pathlib
import sys

import numpy as np

from experiments import config, paper, plots
from jaxcomp.runtime import results

PAPERS = {  # reported numbers, metric, its label, scale, names of the two reported columns
    "resnet": (paper.RESNET, "accuracy", "test acc %", 100.0, ("paper off", "paper on")),
    "gpt2": (paper.GPT2, "loss", "eval loss", 1.0, ("paper loss", "paper ppl")),
}
SIGNATURE = {"resnet": "accuracy", "gpt2": "perplexity"}  # an evaluation metric that only that paper's runs record
NUMBERS = ("epoch", "wire_bytes_fwd", "wire_bytes_bwd")  # per epoch record, besides the evaluations


def check_reportable(run: dict, which: str):
  """ValueError saying why `run` (a results file's content, `results.read`) cannot go in `which` paper's report."""
  metrics = {PAPERS[which][1], SIGNATURE[which]}
  for record in run["history"]:
    evaluations = [record.get(k) if isinstance(record.get(k), dict) else {} for k in ("eval_off", "eval_on")]
    if not all(isinstance(e.get(m), (int, float)) for e in evaluations for m in metrics):
      other = [p for p, m in SIGNATURE.items() if p != which and all(m in e for e in evaluations)]
      raise ValueError(f"a {other[0]} run: use --paper {other[0]}" if other else
                       f"epoch {record.get('epoch')} lacks eval_off/eval_on {' and '.join(sorted(metrics))}")
    missing = [k for k in NUMBERS if not isinstance(record.get(k), (int, float))]
    if missing:
      raise ValueError(f"epoch {record.get('epoch')} lacks {', '.join(missing)}")


SEED_FREE = ("seed", "run_name", *config.RESUMABLE)  # may differ between the runs of one row


def by_seed(runs: list[dict]) -> list[list[dict]]:
  """Runs grouped by their configuration apart from SEED_FREE fields, one run per seed in a
  group (a repeated seed starts another group), in first-seen order."""
  groups = []  # (key, runs)
  for run in runs:
    key = json.dumps({k: v for k, v in run["config"].items() if k not in SEED_FREE}, sort_keys=True, default=str)
    seed = run["config"].get("seed")
    group = next((g for k, g in groups if k == key and seed not in [r["config"].get("seed") for r in g]), None)
    if group is None:
      groups.append((key, [run]))
    else:
      group.append(run)
  return [g for _, g in groups]


def mean_std(values, digits: int) -> str:
  """`mean ± sample std` (the value alone for one run)."""
  text = f"{np.mean(values):.{digits}f}"
  return text + (f" ± {np.std(values, ddof=1):.{digits}f}" if len(values) > 1 else "")


def row_name(group: list[dict]) -> str:
  """A row's name: the run's, or the first run's and its seeds."""
  if len(group) == 1:
    return group[0]["run"]
  return f"{group[0]['run']} (seeds {', '.join(str(r['config'].get('seed')) for r in group)})"


def table(runs: list[dict], which: str) -> str:
  reported, metric, label, scale, (ref_a, ref_b) = PAPERS[which]
  lines = [f"| run | data | epochs | {label} off | {label} on | {ref_a} | {ref_b} | fwd bytes/step "
           "| bwd bytes/step | run avg fwd bytes/step | run avg bwd bytes/step | steps/s |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  average = lambda last, k: f"{last[k]:,.0f}" if k in last else ""  # results written before it existed: blank
  for group in by_seed(runs):
    run, lasts = group[0], [r["history"][-1] for r in group]
    last = lasts[0]
    ref = reported.get(run["config"].get("preset") or run["run"], ("", ""))
    speeds = [x["steps_per_s"] for x in lasts if x.get("steps_per_s")]
    evals = {way: [x[way][metric] * scale for x in lasts] for way in ("eval_off", "eval_on")}
    lines.append(f"| {row_name(group)} | {run['config'].get('data', '')} | {last['epoch']} "
                 f"| {mean_std(evals['eval_off'], 2)} | {mean_std(evals['eval_on'], 2)} "
                 f"| {ref[0]} | {ref[1]} | {last['wire_bytes_fwd']:,} | {last['wire_bytes_bwd']:,} "
                 f"| {average(last, 'avg_wire_bytes_per_step_fwd')} | {average(last, 'avg_wire_bytes_per_step_bwd')} "
                 f"| {f'{np.mean(speeds):.2f}' if speeds else ''} |")
  return "\n".join(lines)


def plot(runs: list[dict], which: str, path: pathlib.Path) -> pathlib.Path:
  """The learning curves beside quality vs bytes per step, one colour per row."""
  _, metric, label, scale, _ = PAPERS[which]
  groups = by_seed(runs)
  return plots.report_figure(path, groups, [row_name(g) for g in groups], metric, scale, label)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("results_dir")
  parser.add_argument("--paper", choices=sorted(PAPERS), required=True)
  args = parser.parse_args(argv)
  out = pathlib.Path(args.results_dir)
  if not out.is_dir():
    raise SystemExit(f"error: {out} is not a folder{'' if out.exists() else ' (it does not exist)'}; pass the "
                     "results folder of finished runs, e.g. runs/resnet_cifar10/results")
  skipped, runs = {}, []
  for run in results.load(out, skipped):
    try:
      check_reportable(run, args.paper)
    except ValueError as err:
      skipped[f"{run['run']}.json"] = str(err)
      continue
    if run["history"]:
      runs.append(run)
    else:
      skipped[f"{run['run']}.json"] = "no finished epoch yet"
  why = "; ".join(f"{name} ({reason})" for name, reason in sorted(skipped.items()))
  if not runs:
    raise SystemExit(f"error: no finished runs to report under {out} with --paper {args.paper}"
                     + (f"; skipped {why}" if why else ": it holds no <run>.json results files; pass the results "
                        "folder of finished runs, e.g. runs/resnet_cifar10/results"))
  if why:
    print(f"note: skipped {why}", file=sys.stderr)
  text = table(runs, args.paper)
  try:
    (out / "report.md").write_text(text + "\n")
    png = plot(runs, args.paper, out / "curves.png")
  except OSError as err:
    raise SystemExit(f"error: cannot write the report into {out} ({err.strerror}); copy the results folder "
                     "somewhere writable and report from there") from None
  print(text)
  print(f"\nwrote {out / 'report.md'} and {png}")


if __name__ == "__main__":
  main()
