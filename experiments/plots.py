"""Figures of finished runs: one run's own plot, and the report's learning curves and quality vs bytes.

Rows are groups of runs that differ only by seed (`report.by_seed`); a row's line or point is the
mean over its seeds, with ± sample std as a band or error bar. Files are replaced atomically.
"""
import functools
import os
import pathlib

import numpy as np


@functools.cache
def pyplot():
  """matplotlib.pyplot on the Agg backend, imported on first use (experiments and dry runs import this module
  where matplotlib is not installed: only drawing needs it)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot
  return matplotlib.pyplot


def save(fig, path: pathlib.Path) -> pathlib.Path:
  """Writes `fig` as a PNG to a temporary name, then renames it to `path` (no half-written plot)."""
  path = pathlib.Path(path)
  tmp = path.with_name(path.name + ".tmp.png")
  fig.savefig(tmp, dpi=110)
  pyplot().close(fig)
  os.replace(tmp, path)
  return path


def bytes_per_step(record: dict) -> float:
  """Forward + backward bytes per train step: the run's average (warm-up and first visits included),
  or the compressed step's where results predate the average."""
  if "avg_wire_bytes_per_step_fwd" in record:
    return record["avg_wire_bytes_per_step_fwd"] + record["avg_wire_bytes_per_step_bwd"]
  return record["wire_bytes_fwd"] + record["wire_bytes_bwd"]


def run_figure(path, run: str, history: list[dict]) -> pathlib.Path:
  """One run at a glance: losses per epoch (train, eval with compression off and on) and the bytes per
  step each way per epoch."""
  epochs = [r["epoch"] for r in history]
  fig, (loss_ax, bytes_ax) = pyplot().subplots(1, 2, figsize=(8, 3))
  loss_ax.plot(epochs, [r["train_loss"] for r in history], "o-", label="train")
  loss_ax.plot(epochs, [r["eval_off"]["loss"] for r in history], "s-", label="eval, compression off")
  loss_ax.plot(epochs, [r["eval_on"]["loss"] for r in history], "^--", label="eval, compression on")
  loss_ax.set(xlabel="epoch", ylabel="loss", title=run)
  loss_ax.legend(fontsize=7)
  for way, marker in (("fwd", "o-"), ("bwd", "s-")):
    per_step = [r[f"epoch_wire_bytes_{way}"] / max(r.get("epoch_batches", 1), 1) if f"epoch_wire_bytes_{way}" in r
                else r[f"wire_bytes_{way}"] for r in history]
    bytes_ax.plot(epochs, per_step, marker, label=way)
  bytes_ax.set(xlabel="epoch", ylabel="bytes per step (all boundaries)", title="on the wire")
  bytes_ax.set_ylim(bottom=0)
  bytes_ax.legend(fontsize=7)
  for ax in (loss_ax, bytes_ax):
    ax.xaxis.set_major_locator(pyplot().MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
  fig.tight_layout()
  return save(fig, path)


def learning_curves(ax, groups: list[list[dict]], names: list[str], metric: str, scale: float, label: str):
  """The evaluation metric per epoch, compression off (solid) and on (dashed), one colour per row."""
  colours = pyplot().get_cmap("tab10" if len(groups) <= 10 else "tab20")
  for i, (group, name) in enumerate(zip(groups, names)):
    n = min(len(r["history"]) for r in group)  # the epochs every seed has finished
    epochs = [r["epoch"] for r in group[0]["history"][:n]]
    for way, style in (("eval_off", "-"), ("eval_on", "--")):
      curves = np.array([[h[way][metric] * scale for h in r["history"][:n]] for r in group])
      mean = curves.mean(0)
      ax.plot(epochs, mean, style, color=colours(i % colours.N), label=f"{name} {way[5:]}")
      if len(group) > 1:
        spread = curves.std(0, ddof=1)
        ax.fill_between(epochs, mean - spread, mean + spread, color=colours(i % colours.N), alpha=0.15, lw=0)
  ax.xaxis.set_major_locator(pyplot().MaxNLocator(integer=True))
  ax.set(xlabel="epoch", ylabel=label, title=f"{label}: compression off (solid) / on (dashed)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=6, ncol=2)


def quality_vs_bytes(ax, groups: list[list[dict]], names: list[str], metric: str, scale: float, label: str):
  """Each row's last evaluation against its bytes per train step: compression on (filled) and off
  (hollow), ± std over seeds."""
  colours = pyplot().get_cmap("tab10" if len(groups) <= 10 else "tab20")
  for i, (group, name) in enumerate(zip(groups, names)):
    lasts = [r["history"][-1] for r in group]
    sent = np.mean([bytes_per_step(last) for last in lasts])
    for way, face in (("eval_on", colours(i % colours.N)), ("eval_off", "none")):
      values = [last[way][metric] * scale for last in lasts]
      spread = np.std(values, ddof=1) if len(values) > 1 else 0.0
      ax.errorbar(sent, np.mean(values), yerr=spread, fmt="o", mfc=face, color=colours(i % colours.N),
                  label=name if way == "eval_on" else None)
  ax.set_xscale("log")
  ax.set(xlabel="bytes per train step, both ways (run average)", ylabel=label,
         title=f"{label} vs bytes: compression on (filled) / off (hollow)")
  ax.grid(alpha=0.3, which="both")
  ax.legend(fontsize=6)


def report_figure(path, groups: list[list[dict]], names: list[str], metric: str, scale: float, label: str):
  """The report's figure: learning curves beside quality vs bytes per step."""
  fig, (curves, frontier) = pyplot().subplots(1, 2, figsize=(13, 4.8))
  learning_curves(curves, groups, names, metric, scale, label)
  quality_vs_bytes(frontier, groups, names, metric, scale, label)
  fig.tight_layout()
  return save(fig, path)
