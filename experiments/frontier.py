"""The compression frontier: every method on one step budget, eval loss against bytes per token.

    python -m experiments.frontier                       # default budget: 192 steps each (2 CPU cores: ~50 s a method)
    python -m experiments.frontier --seeds 3             # seeds 0, 1, 2 of every method: mean +- std
    python -m experiments.frontier --steps 64 --methods fp32,aqsgd-fw2-bw4 --out /tmp/f

Each method is a GPT-2 run (`experiments.gpt2_wikitext`, its default real-text data and tiny
recipe, 4 stages) with the same seed, data, step budget and learning-rate schedule. Bytes per
token are what all boundaries send in both directions over the whole run, warm-up epochs
included (AQ-SGD's dense epoch counts), divided by the tokens trained on; the steady-state
column leaves the warm-up out. `--seeds N` trains each method with seeds first..first+N-1
(`--seed` is the first): seed k > 0 runs as METHOD-seedK (seed 0 keeps the method's name), and
the table gives each method's mean +- sample std over its seeds; the Pareto set and the
dominance verdict compare means, the plot shows the std as error bars. A run is done when
its results file records the full budget; a rerun skips done runs and resumes an interrupted
one from its checkpoint. Writes <out>/frontier.md (table) and <out>/frontier.png (Pareto plot).

Time to target (`--target-loss L`): every run also evaluates every `--eval-every` steps (default 16) and records
the first evaluated step whose eval loss with compression on is <= L (`--stop-at-target` ends it there); each
method's step time is predicted on `--link` (e.g. 200mbit:50ms, Protocol NanoGPT's meter; or `--dense-slowdown R`:
the link on which fp32's step takes R times its unmetered step, `record` the dense record's 186.3) from its stage and codec
times measured here and `--schedule`'s table (`experiments.time_to_target`), and T = steps x step time, against
fp32's and bf16's (both always run); `--overlap` times the schedule's table with the sharded executor's overlapped
sends (every run then needs `--microbatches` >= 2 x stages). Writes <out>/time_to_target.md and
<out>/time_to_target.png (T against bytes per token). `--recipe protocol-cpu` runs the methods on Protocol NanoGPT's model at CPU scale:

    python -m experiments.frontier --target-loss 2.0 --link 200mbit:50ms --seeds 3 --recipe protocol-cpu \
        --steps 400 --batch-size 16 --train-examples 6400 --eval-examples 256 --eval-every 25 --out runs/ttt
"""
import argparse
import typing
import math
import pathlib
import sys

import numpy as np

from experiments import gpt2_wikitext, paper, plots, study
from experiments.study import finished, run_config, run_name  # noqa: F401 (this script's names for them)
from jaxcomp import methods
from jaxcomp.analysis import netsim
from jaxcomp.analysis.link import Link
from jaxcomp.data import text as shipped
from jaxcomp.parallel import schedules

METHODS, REFERENCE = methods.METHODS, methods.REFERENCE  # the registry (jaxcomp.methods)


def summarize(run: dict, method: str | None = None) -> dict:
  """Bytes per token over the run (warm-up included) and after warm-up; final eval losses."""
  config, history = run["config"], run["history"]
  tokens_per_step = config["batch_size"] * config["block_size"]
  sent = {"fwd": 0, "bwd": 0}
  steady = {"fwd": 0, "bwd": 0}
  prev = 0
  for record in history:
    steps, prev = record["step"] - prev, record["step"]
    for way in sent:  # the epoch's exact bytes (AQ-SGD first visits go dense) where recorded
      sent[way] += record.get(f"epoch_wire_bytes_{way}", record[f"wire_bytes_{way}"] * steps)
      if record["mode"] == "train":
        steady[way] = record[f"wire_bytes_{way}"]
  total_tokens = history[-1]["step"] * tokens_per_step
  last = history[-1]
  return {"method": method or run["run"], "seed": config["seed"], "fwd": config["fwd"], "bwd": config["bwd"],
          "bottleneck": config.get("bottleneck"),
          "warmup_epochs": config.get("warmup_epochs", 0), "steps": last["step"],
          "bytes_fwd": sent["fwd"] / total_tokens, "bytes_bwd": sent["bwd"] / total_tokens,
          "bytes": (sent["fwd"] + sent["bwd"]) / total_tokens,
          "bytes_steady": (steady["fwd"] + steady["bwd"]) / tokens_per_step,
          "loss_off": last["eval_off"]["loss"], "loss_on": last["eval_on"]["loss"],
          "per_example_buffers": config["fwd"].startswith("aqsgd+"), "data": config.get("data", "")}


AVERAGED = ("bytes_fwd", "bytes_bwd", "bytes", "bytes_steady", "loss_off", "loss_on")


def over_seeds(rows: list[dict]) -> list[dict]:
  """One row per method: the mean of AVERAGED over its seeds' rows, `<key>_std` the sample std
  (0 for one seed), `seeds` the seeds; other fields from its first row. Method order kept."""
  methods = {}
  for r in rows:
    methods.setdefault(r["method"], []).append(r)
  means = []
  for runs in methods.values():
    mean = {**runs[0], "seeds": [r["seed"] for r in runs]}
    for key in AVERAGED:
      values = np.array([r[key] for r in runs], np.float64)
      mean[key], mean[f"{key}_std"] = float(values.mean()), float(values.std(ddof=1)) if len(runs) > 1 else 0.0
    means.append(mean)
  return means


def pareto(rows: list[dict]) -> set[str]:
  """Methods no other method beats on both bytes and eval loss (compression off)."""
  return {r["method"] for r in rows
          if not any(o["bytes"] <= r["bytes"] and o["loss_off"] <= r["loss_off"]
                     and (o["bytes"], o["loss_off"]) != (r["bytes"], r["loss_off"]) for o in rows)}


def dominating(rows: list[dict], reference: str = REFERENCE) -> list[dict]:
  """Methods without per-example buffers that send fewer bytes at equal or lower eval loss."""
  ref = next((r for r in rows if r["method"] == reference), None)
  if ref is None:
    return []
  return [r for r in rows if not r["per_example_buffers"] and r["bytes"] < ref["bytes"]
          and r["loss_off"] <= ref["loss_off"]]


def mean_std(row: dict, key: str) -> str:
  """`mean +- std` over seeds (the mean alone for one seed)."""
  return f"{row[key]:.4f}" + (f" ± {row[key + '_std']:.4f}" if len(row.get("seeds", ())) > 1 else "")


def table(rows: list[dict]) -> str:
  """Markdown, one row per method (rows from `over_seeds`), by bytes per token."""
  front = pareto(rows)
  lines = ["| method | fwd | bwd | warm-up ep | B/token fwd | B/token bwd | B/token total | B/token after warm-up "
           "| eval loss (off) | eval loss (on) | seeds | per-example buffers | Pareto |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
  for r in sorted(rows, key=lambda r: r["bytes"]):
    fwd = f"`{r['bottleneck']}` then `{r['fwd']}`" if r.get("bottleneck") else f"`{r['fwd']}`"
    lines.append(f"| {r['method']} | {fwd} | `{r['bwd']}` | {r['warmup_epochs']} | {r['bytes_fwd']:.1f} "
                 f"| {r['bytes_bwd']:.1f} | {r['bytes']:.1f} | {r['bytes_steady']:.1f} | {mean_std(r, 'loss_off')} "
                 f"| {mean_std(r, 'loss_on')} | {len(r.get('seeds', [r.get('seed')]))} "
                 f"| {'yes' if r['per_example_buffers'] else 'no'} | {'*' if r['method'] in front else ''} |")
  return "\n".join(lines)


def plot(rows: list[dict], path: pathlib.Path, title: str) -> pathlib.Path:
  front = sorted((r for r in rows if r["method"] in pareto(rows)), key=lambda r: r["bytes"])
  plt = plots.pyplot()
  fig, ax = plt.subplots(figsize=(8, 5))
  for r in rows:
    colour = "tab:red" if r["per_example_buffers"] else "tab:blue"
    ax.errorbar(r["bytes"], r["loss_off"], yerr=r.get("loss_off_std", 0.0), color=colour, fmt="o", ms=4.5,
                capsize=2.5, elinewidth=1, zorder=3)
    ax.annotate(r["method"], (r["bytes"], r["loss_off"]), fontsize=6.5, xytext=(3, 2), textcoords="offset points")
  ax.step([r["bytes"] for r in front], [r["loss_off"] for r in front], where="post", color="grey", lw=1,
          label="Pareto frontier")
  ax.scatter([], [], color="tab:red", s=22, label="per-example buffers (AQ-SGD)")
  ax.scatter([], [], color="tab:blue", s=22, label="no per-example state")
  ax.set_xscale("log")
  ax.set_xlabel("bytes per token, all boundaries, both directions, warm-up included (log)")
  ax.set_ylabel("eval loss (compression off); bars: std over seeds")
  ax.set_title(title, fontsize=9)
  ax.grid(alpha=0.3, which="both")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def link_arg(text: str) -> Link:
  """--link's value (`Link.parse`), its error as argparse's."""
  try:
    return Link.parse(text)
  except ValueError as err:
    raise argparse.ArgumentTypeError(str(err)) from None


def slowdown_arg(text: str) -> float:
  """--dense-slowdown's value: a number > 1, or `record` (Protocol NanoGPT's dense record's)."""
  if text == "record":
    return paper.PROTOCOL_DENSE_SLOWDOWN
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not 1 < value < math.inf:
    raise argparse.ArgumentTypeError(f"{text!r}: give how many times its unmetered step fp32's step takes on the link "
                                     f"(a finite number > 1, e.g. 186.3), or `record` for the dense record's")
  return value


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m experiments.frontier", description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=192, help="training steps per method (the budget)")
  parser.add_argument("--train-examples", type=int, default=256, help="training blocks (an epoch is this / batch)")
  parser.add_argument("--eval-examples", type=int, default=128, help="evaluation blocks")
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--seed", type=int, default=0, help="the first seed")
  parser.add_argument("--seeds", type=int, default=1, help="seeds per method: --seed ... --seed + N - 1")
  parser.add_argument("--methods", help=f"comma-separated subset of: {', '.join(METHODS)}")
  parser.add_argument("--outliers", metavar="N:SCALE[:MASSIVE]",
                      help="every run's model carries outlier channels across its stage boundaries "
                           "(experiments.gpt2_wikitext --outliers), e.g. 4:64:1024")
  parser.add_argument("--microbatches", type=int, help="microbatches per batch of every run (default: the recipe's)")
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/frontier"))
  parser.add_argument("--list-methods", action="store_true", help="print every method's specs and exit")
  parser.add_argument("--text", choices=shipped.SHIPPED_TEXTS, default="wikitext2",
                      help="the shipped text every run trains on (jaxcomp/data/TEXTS_README.md)")
  parser.add_argument("--recipe", choices=list(gpt2_wikitext.RECIPES),
                      help="experiments.gpt2_wikitext's recipe the runs start from (default: tiny; its lr schedule "
                           "then spans --steps), e.g. protocol-cpu")
  timed = parser.add_argument_group("time to target (--target-loss)")
  timed.add_argument("--target-loss", type=float, metavar="L",
                     help="time to target: each method's first evaluated step with eval loss (compression on) <= L, "
                          "its step time predicted on --link, T = steps x step time")
  timed.add_argument("--eval-every", type=int, help="evaluate every N steps (default with --target-loss: 16; "
                                                    "without: at epoch ends)")
  timed.add_argument("--stop-at-target", action="store_true", help="end each run at its target")
  link = timed.add_mutually_exclusive_group()
  link.add_argument("--link", type=link_arg, default=Link.parse("200mbit:50ms"),
                    help="bandwidth and one-way latency per message of every stage boundary (default: Protocol "
                         "NanoGPT's 200mbit:50ms)")
  link.add_argument("--dense-slowdown", type=slowdown_arg, metavar="R|record",
                    help="instead of --link: the link on which fp32's step takes R times its step unmetered, its "
                         "latency Protocol NanoGPT's share of a dense message (0.0745); `record`: the dense record's "
                         f"R, its metered step over its unmetered one ({paper.PROTOCOL_DENSE_SLOWDOWN:.1f})")
  timed.add_argument("--meter", choices=typing.get_args(netsim.Meter), default="per_direction",
                     help="netsim's link model: per_direction (one link each way per boundary) or inbound (Protocol "
                          "NanoGPT's receiver meter: one inbound wire per stage)")
  timed.add_argument("--schedule", default="1f1b",
                     help="the pipeline schedule whose table netsim times (default: 1f1b, Protocol NanoGPT's)")
  timed.add_argument("--overlap", action="store_true",
                     help="netsim times the schedule with the sharded executor's overlapped sends (its --overlap: "
                          "each message crosses its link while both ends compute the next tick; --microbatches >= "
                          "2 x stages)")
  timed.add_argument("--repeats", type=int, default=10, help="timed runs per stage and codec op")
  args = parser.parse_args(argv)
  if args.list_methods:
    print(methods.listing())
    return []
  if args.target_loss is None and (args.stop_at_target or args.eval_every or args.overlap or args.dense_slowdown):
    parser.error("--stop-at-target, --eval-every, --overlap and --dense-slowdown belong to the time-to-target mode: "
                 "add --target-loss L")
  if args.target_loss is not None:
    args.eval_every = args.eval_every or 16
  names = args.methods.split(",") if args.methods else list(METHODS)
  unknown = [n for n in names if n not in METHODS]
  if unknown:
    parser.error(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
  if args.steps < 1 or args.train_examples < args.batch_size or args.seeds < 1:
    parser.error(f"need --steps >= 1, --train-examples >= --batch-size and --seeds >= 1, got {args.steps}, "
                 f"{args.train_examples}, {args.seeds}")
  if args.target_loss is not None:  # T is relative to fp32's and bf16's
    names = list(dict.fromkeys(["fp32", "bf16", *names]))
    try:  # the table netsim times, now rather than after the runs
      layout = run_config(names[0], args).executor
      schedules.parse(args.schedule, args.overlap).train_table(layout.stages, layout.microbatches)
    except ValueError as err:
      parser.error(f"--schedule {args.schedule}{' --overlap' if args.overlap else ''}: {err}")
  checked = dict(recipe=args.recipe, eval_every=args.eval_every, text=args.text,
                 **({"microbatches": args.microbatches} if args.microbatches else {}))
  runs, per_run = [], []
  for name in names:
    for seed in range(args.seed, args.seed + args.seeds):
      runs.append(study.run_or_resume(name, args, seed, checked, "frontier", text=args.text))
      per_run.append(summarize(runs[-1], name))
  if args.target_loss is not None:
    return time_to_target(args, names, runs, per_run)
  rows = over_seeds(per_run)
  text = table(rows)
  winners = dominating(rows)
  verdict = (f"Dominate {REFERENCE} (fewer bytes/token, mean eval loss <=, no per-example buffers): "
             + (", ".join(r["method"] for r in winners) if winners else "none")) if REFERENCE in names else ""
  seeds = f"seed {args.seed}" if args.seeds == 1 else f"seeds {args.seed}..{args.seed + args.seeds - 1}"
  outliers = f", outliers {args.outliers}" if args.outliers else ""
  title = (f"tiny GPT-2{outliers}, 4 stages, {args.steps} steps x {args.batch_size} x "
           f"{runs[0]['config']['block_size']} tokens, {args.train_examples} training blocks, {seeds}; "
           f"{rows[0]['data'].split(',')[0]}")
  (args.out / "frontier.md").write_text(f"{title}\n\n{text}\n\n{verdict}\n")
  png = plot(rows, args.out / "frontier.png", title)
  print(text)
  print(verdict)
  print(f"wrote {args.out / 'frontier.md'} and {png}")
  return rows


def time_to_target(args, names: list[str], runs: list[dict], per_run: list[dict]) -> list[dict]:
  """The time-to-target table and plot of the methods' finished runs (`experiments.time_to_target`)."""
  from experiments import time_to_target as ttt  # here: it imports the throughput benchmark, which imports this module
  step_times = ttt.StepTimes(args.link, args.schedule, args.repeats, args.meter, overlap=args.overlap)
  schedule = args.schedule + (" with overlapped sends" if args.overlap else "")
  if args.dense_slowdown:
    step_times.link = step_times.link_for_slowdown(run_config("fp32", args), args.dense_slowdown,
                                                   paper.PROTOCOL_LATENCY_SHARE)
    print(f"[frontier] fp32's step takes {args.dense_slowdown:g}x its unmetered step on {step_times.link}")
  link = step_times.link
  summaries = {r["method"]: r for r in over_seeds(per_run)}
  rows = []
  for name in names:
    step = step_times(run_config(name, args))
    print(f"[frontier] {name}: predicted step {step.seconds:.4g} s on {link} ({schedule})")
    rows.append(ttt.row(name, [r for r, p in zip(runs, per_run) if p["method"] == name], summaries[name], step,
                        args.target_loss))
  rows = ttt.relative(rows)
  first = runs[0]["config"]
  slowdown = f" (fp32's step {args.dense_slowdown:g}x its unmetered one)" if args.dense_slowdown else ""
  seeds = f"seed {args.seed}" if args.seeds == 1 else f"seeds {args.seed}..{args.seed + args.seeds - 1}"
  title = (f"time to eval loss {args.target_loss:g} (compression on): {first['model']} ({first['recipe']} recipe), "
           f"{first['stages']} stages x {first['microbatches']} microbatches, {args.steps} steps at most x "
           f"{args.batch_size} x {first['block_size']} tokens, evaluated every {args.eval_every}, {seeds}; step "
           f"times {step.source}, netsim {schedule} on {link}{slowdown} (meter {args.meter})")
  text = ttt.table(rows, args.target_loss, link)
  (args.out / "time_to_target.md").write_text(f"{title}\n\n{text}\n")
  png = ttt.plot(rows, args.out / "time_to_target.png", title)
  print(text)
  print(f"wrote {args.out / 'time_to_target.md'} and {png}")
  return rows


if __name__ == "__main__":
  try:
    main()
  except ValueError as err:
    sys.exit(f"error: {err}")
