"""Markdown table of finished runs beside the papers' numbers, and learning-curve plots.

    python -m experiments.report runs/resnet_cifar10/results --paper resnet
    python -m experiments.report runs/gpt2_wikitext/results --paper gpt2

For each run (one JSON per run): the last epoch's evaluation with compression off and on,
bytes on the wire per compressed step and the run's average per step (dense warm-up and
AQ-SGD first-visit steps included), steps/s, and the paper's (off, on) for the same preset. Plots:
the evaluation metric per epoch, compression off (solid) and on (dashed), one line per run.
"""
import argparse
import pathlib

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from experiments import paper  # noqa: E402
from jaxcomp import results  # noqa: E402

PAPERS = {  # reported numbers, metric, its label, scale, names of the two reported columns
    "resnet": (paper.RESNET, "accuracy", "test acc %", 100.0, ("paper off", "paper on")),
    "gpt2": (paper.GPT2, "loss", "eval loss", 1.0, ("paper loss", "paper ppl")),
}


def table(runs: list[dict], which: str) -> str:
  reported, metric, label, scale, (ref_a, ref_b) = PAPERS[which]
  lines = [f"| run | data | epochs | {label} off | {label} on | {ref_a} | {ref_b} | fwd bytes/step "
           "| bwd bytes/step | run avg fwd bytes/step | run avg bwd bytes/step | steps/s |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  average = lambda last, k: f"{last[k]:,.0f}" if k in last else ""  # results written before it existed: blank
  for run in runs:
    last = run["history"][-1]
    ref = reported.get(run["run"], ("", ""))
    speed = f"{last['steps_per_s']:.2f}" if last.get("steps_per_s") else ""
    lines.append(f"| {run['run']} | {run['config'].get('data', '')} | {last['epoch']} "
                 f"| {last['eval_off'][metric] * scale:.2f} | {last['eval_on'][metric] * scale:.2f} "
                 f"| {ref[0]} | {ref[1]} | {last['wire_bytes_fwd']:,} | {last['wire_bytes_bwd']:,} "
                 f"| {average(last, 'avg_wire_bytes_per_step_fwd')} | {average(last, 'avg_wire_bytes_per_step_bwd')} "
                 f"| {speed} |")
  return "\n".join(lines)


def plot(runs: list[dict], which: str, path: pathlib.Path) -> pathlib.Path:
  _, metric, label, scale, _ = PAPERS[which]
  fig, ax = plt.subplots(figsize=(7, 4.5))
  colours = plt.get_cmap("tab10" if len(runs) <= 10 else "tab20")  # one distinct colour per run
  for i, run in enumerate(runs):
    epochs = [r["epoch"] for r in run["history"]]
    ax.plot(epochs, [r["eval_off"][metric] * scale for r in run["history"]], color=colours(i % colours.N),
            label=f"{run['run']} off")
    ax.plot(epochs, [r["eval_on"][metric] * scale for r in run["history"]], "--", color=colours(i % colours.N),
            label=f"{run['run']} on")
  ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
  ax.set_xlabel("epoch")
  ax.set_ylabel(label)
  ax.set_title(f"{label}: compression off (solid) / on (dashed) at evaluation")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("results_dir")
  parser.add_argument("--paper", choices=sorted(PAPERS), required=True)
  args = parser.parse_args(argv)
  runs = [r for r in results.load(args.results_dir) if r["history"]]
  if not runs:
    raise SystemExit(f"no finished runs under {args.results_dir}")
  text = table(runs, args.paper)
  out = pathlib.Path(args.results_dir)
  (out / "report.md").write_text(text + "\n")
  png = plot(runs, args.paper, out / "curves.png")
  print(text)
  print(f"\nwrote {out / 'report.md'} and {png}")


if __name__ == "__main__":
  main()
