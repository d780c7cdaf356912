"""The step-inflation ladder: how each method's steps to a target grow with the run's horizon and the model's width.

    python -m experiments.ladder                                   # horizons 100, 300, 1000 at width 128
    python -m experiments.ladder --horizons 300 --widths 128,256,512 --seeds 2
    python -m experiments.ladder --report                          # the tables and plots of what has finished

For each rung (width W, horizon H) and seed: fp32 trains H steps with its learning rate over H (the budget run); its
eval loss there is the rung's target. Then every method, fp32 included, trains with its learning rate over the cap
(`--cap` x H steps), evaluated every `eval_every(H)` steps and stopped at the target; its inflation is its steps to
the target over fp32's on the same cap. Every run is Protocol NanoGPT's model at CPU scale (`--recipe
protocol-cpu`, `protocol-tiny` at `--model-width W`) on the shipped `long` text (jaxcomp/data/TEXTS_README.md: about
2,800 steps of 16 x 128 byte tokens before a block repeats). A finished run is skipped and an interrupted one
resumes, so the ladder runs in pieces (`--max-runs`); `--report` writes <out>/ladder.md, ladder.json and
ladder.png from the finished rungs, with the fitted model of inflation against horizon and width
(`experiments.inflation`) and, beside the ReparamSSN port, its record's own curve.
"""
import argparse
import json
import pathlib
import sys
import types

from experiments import gpt2_wikitext, inflation, paper, study
from jaxcomp import methods

METHODS = ("fp32", "bf16", "top10-q8-reuse", "chan-tile64-fw3-bw4", "adapt34-bw4", "ssn", "ssn-fw4-bw4",
           "proj16-fw4-bw4")
TEXT = "long"
TRAIN_BLOCKS = 44_800  # of the long text's 44,831 training blocks of 128 byte tokens
BATCH = 16


def eval_every(horizon: int) -> int:
  """How often a rung's runs evaluate: every H/20 steps, at least 5."""
  return max(5, horizon // 20)


def rung_dir(out: pathlib.Path, width: int, horizon: int) -> pathlib.Path:
  return out / f"w{width}-h{horizon}"


def run_args(out: pathlib.Path, steps: int, horizon: int, target: float | None, eval_examples: int):
  """What `study.run_config` reads of a run: protocol-cpu at `steps` (its lr schedule over them)."""
  return types.SimpleNamespace(recipe="protocol-cpu", steps=steps, train_examples=TRAIN_BLOCKS, batch_size=BATCH,
                               eval_examples=eval_examples, out=out, outliers=None, eval_every=eval_every(horizon),
                               microbatches=None, target_loss=target, stop_at_target=target is not None)


def budget_run(out, width, horizon, seed, eval_examples) -> dict:
  """fp32's run of `horizon` steps (lr over them) at `width`: its last eval loss is the rung's target."""
  args = run_args(rung_dir(out, width, horizon) / "budget", horizon, horizon, None, eval_examples)
  checked = dict(recipe="protocol-cpu", eval_every=eval_every(horizon), text=TEXT, model_width=width)
  return study.run_or_resume(methods.DENSE, args, seed, checked, "ladder", text=TEXT, model_width=width)


def target_of(budget: dict) -> float:
  """The rung's target: fp32's eval loss (compression on: dense) at the end of its budget."""
  return budget["history"][-1]["eval_on"]["loss"]


def cap_run(out, width, horizon, cap, seed, method, target, eval_examples) -> dict:
  """`method`'s run on the cap (lr over cap x horizon steps), stopped at `target`."""
  args = run_args(rung_dir(out, width, horizon) / "cap", cap * horizon, horizon, target, eval_examples)
  checked = dict(recipe="protocol-cpu", eval_every=eval_every(horizon), text=TEXT, model_width=width,
                 target_loss=target)
  return study.run_or_resume(method, args, seed, checked, "ladder", text=TEXT, model_width=width)


def plan(widths, horizons, seeds, names):
  """The runs in the order they train: seed by seed (so each finished seed gives every rung a point), each rung's
  budget run before its methods."""
  order = []
  for seed in range(max(seeds)):
    for width in widths:
      for horizon, n in zip(horizons, seeds):
        if seed < n:
          order.append((width, horizon, seed, None))
          order += [(width, horizon, seed, name) for name in names]
  return order


def train(args) -> int:
  """Trains the ladder's runs that are not finished (at most --max-runs of them); how many it trained."""
  trained = 0
  targets = {}
  for width, horizon, seed, name in plan(args.widths, args.horizons, args.seeds, args.methods):
    if args.max_runs is not None and trained >= args.max_runs:
      break
    key, kind = (width, horizon, seed), "budget" if name is None else "cap"
    results = rung_dir(args.out, width, horizon) / kind / "results" / f"{study.run_name(name or methods.DENSE, seed)}.json"
    trained += not results.is_file()
    if name is None:
      targets[key] = target_of(budget_run(args.out, width, horizon, seed, args.eval_examples))
    else:
      cap_run(args.out, width, horizon, args.cap, seed, name, targets[key], args.eval_examples)
  return trained


def int_list(text: str) -> list[int]:
  try:
    values = [int(v) for v in text.split(",") if v.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated positive integers, e.g. 100,300,1000") from None
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated positive integers, e.g. 100,300,1000")
  return values


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m experiments.ladder", description=__doc__.splitlines()[0])
  parser.add_argument("--horizons", type=int_list, default=[100, 300, 1000], help="fp32 budgets H (default: "
                      "100,300,1000)")
  parser.add_argument("--widths", type=int_list, default=[128], help="protocol-tiny widths (default: 128)")
  parser.add_argument("--seeds", type=int_list, default=[3, 2, 2],
                      help="seeds per horizon, one number for all or one per horizon (default: 3,2,2)")
  parser.add_argument("--cap", type=int, default=3, help="every method's lr schedule and step cap: CAP x H "
                      "(default 3)")
  parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated (default: {','.join(METHODS)}; "
                      "any of jaxcomp.methods)")
  parser.add_argument("--eval-examples", type=int, default=256, help="evaluation blocks (default 256)")
  parser.add_argument("--max-runs", type=int, help="train at most N unfinished runs, then stop (a piece of the "
                      "ladder; rerun to go on)")
  parser.add_argument("--report", action="store_true", help="only write the tables and plots of finished rungs")
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/ladder"))
  parser.add_argument("--export", type=pathlib.Path, metavar="FILE",
                      help="also write the report as a step-inflation table with its provenance (the planner's "
                           "format, jaxcomp.analysis.step_table; jaxcomp/data/step_inflation.json is the shipped one)")
  args = parser.parse_args(argv)
  args.methods = list(dict.fromkeys([methods.DENSE, *[n.strip() for n in args.methods.split(",") if n.strip()]]))
  unknown = [n for n in args.methods if n not in methods.METHODS]
  if unknown:
    parser.error(f"--methods: unknown {unknown}; choose from {', '.join(methods.METHODS)}")
  if len(args.seeds) == 1:
    args.seeds = args.seeds * len(args.horizons)
  if len(args.seeds) != len(args.horizons) and not args.report:
    parser.error(f"--seeds {','.join(map(str, args.seeds))}: give one number or one per horizon "
                 f"({len(args.horizons)})")
  if args.cap < 1:
    parser.error(f"--cap {args.cap}: give an integer >= 1 (the cap is CAP x H steps)")
  if not args.report:
    train(args)
  report = inflation.ladder_report(args.out, args.widths, args.horizons, args.methods, args.cap)
  (args.out / "ladder.json").write_text(json.dumps(report, indent=1))
  text = inflation.render(report, paper.SSN_RECORD_INFLATION)
  (args.out / "ladder.md").write_text(text)
  png = inflation.plot(report, args.out / "ladder.png", paper.SSN_RECORD_INFLATION)
  print(text)
  print(f"wrote {args.out / 'ladder.md'}, {args.out / 'ladder.json'} and {png}")
  if args.export:
    calibration = {"method": "ssn", "name": "ReparamSSN's record", "record": paper.SSN_RECORD_INFLATION,
                   "source": "Protocol NanoGPT's records 20260917_vanilla_baseline and 20260918_reparamssn_baseline, "
                   "their loss logs: SSN's steps to dense's eval loss at dense's step D, over D"}
    provenance = study.provenance("ladder", text=TEXT, model="protocol-tiny (protocol-cpu recipe)")
    study.export_regime(args.export, "scratch", {**report, "stages": gpt2_wikitext.PROTOCOL_CPU["stages"],
                                                 "calibration": calibration, "provenance": provenance})
    print(f"wrote the scratch regime of {args.export}")
  return report


if __name__ == "__main__":
  try:
    main()
  except ValueError as err:
    sys.exit(f"error: {err}")
