"""Step inflation from a ladder's runs, and a fitted model of it against horizon and width.

Inflation of a method at a rung (width W, horizon H) and seed = its steps to the rung's target / fp32's steps on the
same cap (`experiments.ladder`). A method that does not reach the target within the cap is censored: its
inflation is > cap steps / fp32's (reported as such, and left out of the fit). Per method, the points of every
seed are fitted by `jaxcomp.analysis.inflation` (log inflation linear in log horizon and log width).
"""
import json
import math
import pathlib

import numpy as np

from jaxcomp import methods
from jaxcomp.analysis.inflation import bends, fit
from jaxcomp.runtime import evaluation


def steps_to(run: dict, target: float) -> int | None:
  """The run's first evaluated step at or below `target` (compression on), None if it never got there."""
  return evaluation.target_summary(run["history"], target)["step"]


def _results(folder: pathlib.Path) -> dict[str, dict]:
  return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def rung_points(rung: pathlib.Path, names, cap: int, horizon: int) -> dict:
  """Per method, per finished seed: {"steps", "fp32_steps", "inflation", "censored"} of one rung's folder."""
  budgets, caps = _results(rung / "budget" / "results"), _results(rung / "cap" / "results")
  out = {name: [] for name in names}
  for budget_name, budget in budgets.items():
    seed_suffix = budget_name[len(methods.DENSE):]
    target = budget["history"][-1]["eval_on"]["loss"] if budget["history"] else None
    dense = caps.get(methods.DENSE + seed_suffix)
    if target is None or dense is None or steps_to(dense, target) is None:
      continue
    s0 = steps_to(dense, target)
    for name in names:
      run = caps.get(name + seed_suffix)
      if run is None or not run["history"]:
        continue
      s = steps_to(run, target)
      if s is None and run["history"][-1]["step"] < cap * horizon:
        continue  # interrupted before its target or its cap: not a point yet
      out[name].append({"seed": seed_suffix or "-seed0", "target": target, "fp32_steps": s0, "steps": s,
                        "inflation": (s if s is not None else cap * horizon) / s0, "censored": s is None})
  return out


def ladder_report(out: pathlib.Path, widths, horizons, names, cap: int) -> dict:
  """Every finished rung's points, per method the fitted model (None where it cannot be fitted) and whether its
  trend bends."""
  rungs = {}
  for w in widths:
    for h in horizons:
      folder = out / f"w{w}-h{h}"
      if folder.is_dir():
        rungs[f"w{w}-h{h}"] = {"width": w, "horizon": h, "methods": rung_points(folder, names, cap, h)}
  return {"cap": cap, "rungs": rungs, "models": fitted(rungs, names)}


def fitted(rungs: dict, names) -> dict:
  """Per method, the model fitted to its uncensored points over the rungs (None where it cannot be fitted), whether
  its trend bends, and the horizons where a seed was censored."""
  models = {}
  for name in names:
    pts = [(r["horizon"], r["width"], p["inflation"]) for r in rungs.values() for p in r["methods"].get(name, [])
           if not p["censored"]]
    missed = sorted({r["horizon"] for r in rungs.values() for p in r["methods"].get(name, []) if p["censored"]})
    models[name] = {"fit": fit(pts), "bends": bends(pts), "censored_at": missed}
  return models


def _cell(points: list[dict]) -> str:
  if not points:
    return "-"
  reached = [p["inflation"] for p in points if not p["censored"]]
  censored = [p for p in points if p["censored"]]
  text = f"{np.mean(reached):.2f}" if reached else ""
  if len(reached) > 1:
    text += f" ± {np.std(reached, ddof=1):.2f}"
  if censored:
    text += (" " if text else "") + f"({len(censored)} > {min(p['inflation'] for p in censored):.2f})"
  return f"{text} (n={len(points)})"


def render(report: dict, record_curve: dict) -> str:
  """Markdown: inflation per method and rung (mean ± sample std over seeds; `(k > X)`: k seeds that did not reach
  the target within the cap, X their bound), fp32's steps and the targets, the fitted models, and the record's
  ReparamSSN curve."""
  rungs = list(report["rungs"].values())
  if not rungs:
    return "no finished rung yet\n"
  head = "| method | " + " | ".join(f"W {r['width']}, H {r['horizon']}" for r in rungs) + " |"
  lines = [head, "|---|" + "---:|" * len(rungs)]
  names = list(rungs[0]["methods"])
  for name in names:
    lines.append(f"| {name} | " + " | ".join(_cell(r["methods"][name]) for r in rungs) + " |")
  dense = [r["methods"][methods.DENSE] for r in rungs]
  lines.append("| fp32 steps to target on the cap | " + " | ".join(
      ", ".join(str(p["fp32_steps"]) for p in d) or "-" for d in dense) + " |")
  lines.append("| target (fp32's eval loss at H) | " + " | ".join(
      ", ".join(f"{p['target']:.4f}" for p in d) or "-" for d in dense) + " |")
  lines += ["", "Fitted: log inflation = a + b log(H/100) [+ c log(W/128)], one standard error in brackets:", "",
            "| method | a | b (horizon) | c (width) | points | residual sd | trend |", "|---|---:|---:|---:|---:|---:|---|"]
  for name, model in report["models"].items():
    f = model["fit"]
    missed = (f"; missed the target within the cap at H {', '.join(map(str, model['censored_at']))}: a lower bound "
              "there" if model.get("censored_at") else "")
    if f is None:
      lines.append(f"| {name} | - | - | - | - | - | too few points{missed} |")
      continue
    se = {n: math.sqrt(f["cov"][i][i]) for i, n in enumerate(f["names"])}
    cell = lambda n: f"{f['coef'][n]:.3f} ({se[n]:.3f})" if n in f["coef"] else "-"
    lines.append(f"| {name} | {cell('a')} | {cell('b')} | {cell('c')} | {f['points']} | {f['residual_sd']:.3f} | "
                 f"{'bends: no projection' if model['bends'] else 'straight'}{missed} |")
  lines += ["", "Protocol NanoGPT's ReparamSSN record against its dense record (their loss logs, validation every "
            "125 steps, linear interpolation): steps to dense's loss at dense's step D, over D:", "",
            "| D | " + " | ".join(str(d) for d in record_curve) + " |", "|---|" + "---:|" * len(record_curve),
            "| inflation | " + " | ".join(f"{v:.2f}" for v in record_curve.values()) + " |"]
  return "\n".join(lines) + "\n"


def plot(report: dict, path: pathlib.Path, record_curve: dict) -> pathlib.Path:
  """Inflation against horizon (log axes), one line per method and width (mean over seeds, std as error bars),
  the ReparamSSN record's curve dashed."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7.5, 4.8))
  rungs = list(report["rungs"].values())
  names = list(rungs[0]["methods"]) if rungs else []
  for name in names:
    if name == methods.DENSE:
      continue
    for w in sorted({r["width"] for r in rungs}):
      xs, ys, es = [], [], []
      for r in sorted((r for r in rungs if r["width"] == w), key=lambda r: r["horizon"]):
        vals = [p["inflation"] for p in r["methods"][name] if not p["censored"]]
        if vals:
          xs.append(r["horizon"])
          ys.append(np.mean(vals))
          es.append(np.std(vals, ddof=1) if len(vals) > 1 else 0.0)
      if xs:
        ax.errorbar(xs, ys, yerr=es, marker="o", capsize=2.5, label=f"{name} (W {w})")
  ax.plot(list(record_curve), list(record_curve.values()), "k--", marker="s", label="ReparamSSN record (W 1024)")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("fp32's steps to the target (horizon)")
  ax.set_ylabel("steps to target / fp32's")
  ax.axhline(1.0, color="grey", lw=0.8)
  ax.legend(fontsize=7, ncol=2)
  ax.grid(True, which="both", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
