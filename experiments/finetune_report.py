"""The fine-tuning study's report (`experiments.finetune`): each of the papers' fine-tuning claims beside the runs.

Every figure reads finished results files only: Rudakov et al.'s Table 5 (TopK 50..10% with index reuse, 10%
separate: final eval loss with compression on and off), AQ-SGD's Figure 3 (AQ-SGD against direct quantization at the
same bits, loss against steps), the error-feedback rows, and AQ-SGD's time to the same loss on its five networks
(T = the predicted time of a run's steps up to the same loss, its dense warm-up steps at the dense step's time; the
speed-up is fp32's mean T over the method's). Losses are as the model would be served (`served`).
"""
import numpy as np

from experiments import paper, plots, time_to_target
from jaxcomp import methods
from jaxcomp.runtime import evaluation

# Rudakov et al.'s Table 5 (GPT-2 small fine-tuned on WikiText-2, eval loss; its baseline is fp32) and AQ-SGD's
# Figure 3 rows
TABLE5 = {methods.DENSE if name == "baseline" else name: loss for name, (loss, _) in paper.GPT2.items()}
FIGURE3 = ("fp32", "aqsgd-fw2-bw4", "direct-fw2-bw4", "aqsgd-fw3-bw6", "direct-fw3-bw6", "aqsgd-fw4-bw8",
           "direct-fw4-bw8", "aqsgd-fw3-bw6-warm0")
FEEDBACK = ("ef-top10-reuse", "ef21-top10-reuse", "aqsgd-top10-bw4")  # the papers' error-feedback rows (ResNet's)
SHARE = 0.9  # the same loss: where fp32 has made this share of its improvement (`target_loss`)
SHARES = (0.5, 0.75, 0.9)  # the speed-up on the slowest network is also given at these


def mean_std(values) -> tuple[float, float]:
  return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def served(evaluated: dict) -> float:
  """An evaluation's loss as the model would be served: the better of compression on and off (TopK-trained models
  need their compression at inference, Rudakov et al.; AQ-SGD's held-out examples have no buffer, so its
  compression-on evaluation is direct quantization, and AQ-SGD's claim is the model's quality)."""
  return min(evaluated["eval_on"]["loss"], evaluated["eval_off"]["loss"])


def loss_at(run: dict, way=served) -> dict[int, float]:
  """{evaluated step: loss} of a run, `way` an evaluation's loss: `served`, or "eval_on" / "eval_off"."""
  read = way if callable(way) else (lambda e: e[way]["loss"])
  return {e["step"]: read(e) for e in evaluation.evaluations(run["history"])}


def curve(runs: list[dict], way=served) -> tuple[np.ndarray, np.ndarray]:
  """(steps, mean loss over the runs) at every evaluated step the runs share (`loss_at`)."""
  points = [loss_at(run, way) for run in runs]
  steps = sorted(set.intersection(*(set(p) for p in points)))
  return np.array(steps), np.array([np.mean([p[s] for p in points]) for s in steps])


def target_loss(fp32_runs: list[dict], share: float = SHARE) -> float:
  """The same loss: the served loss at which fp32 (its mean curve over seeds) has made `share` of its improvement
  from its first evaluation to its best, L_first - share x (L_first - L_best)."""
  _, losses = curve(fp32_runs)
  return float(losses[0] - share * (losses[0] - losses.min()))


def steps_to(run: dict, target: float) -> int | None:
  """The first evaluated step whose served loss is <= `target` (None: none)."""
  return next((step for step, loss in sorted(loss_at(run).items()) if loss <= target), None)


def final(runs: list[dict], way) -> tuple[float, float]:
  """Mean and std over the runs of their last evaluation's loss (`loss_at`'s `way`)."""
  last = lambda points: points[max(points)]
  return mean_std([last(loss_at(run, way)) for run in runs])


def pm(value: tuple[float, float], n: int, fmt: str = ".3f") -> str:
  return format(value[0], fmt) + (f" ± {format(value[1], fmt)}" if n > 1 else "")


def table5(runs: dict[str, list[dict]]) -> list[str]:
  """Rudakov's Table 5 beside the runs: final eval loss on and off, the gap to fp32, the paper's."""
  base = final(runs["fp32"], "eval_on")[0]
  lines = ["| method | eval loss (on) | eval loss (off) | on - fp32 | seeds | Rudakov: eval loss | Rudakov: - fp32 |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  for name, reported in TABLE5.items():
    if name in runs:
      on, off, n = final(runs[name], "eval_on"), final(runs[name], "eval_off"), len(runs[name])
      lines.append(f"| {name} | {pm(on, n)} | {pm(off, n)} | {on[0] - base:+.3f} | {n} | {reported:.2f} | "
                   f"{reported - TABLE5['fp32']:+.2f} |")
  ladder = [n for n in ("top50-reuse", "top30-reuse", "top20-reuse", "top10-reuse") if n in runs]
  losses = [final(runs[n], "eval_on")[0] for n in ladder]
  rises = all(a < b for a, b in zip(losses, losses[1:]))
  claims = [f"Loss (on) rises as TopK keeps fewer values ({' < '.join(ladder)}): {'yes' if rises else 'no'} "
            f"({', '.join(f'{v:.3f}' for v in losses)})."]
  if {"top10-reuse", "top10-separate"} <= set(runs):
    sep, reuse = final(runs["top10-separate"], "eval_on")[0], final(runs["top10-reuse"], "eval_on")[0]
    claims.append(f"TopK 10% with the gradient's own selection (separate) is worse than with index reuse: "
                  f"{'yes' if sep > reuse else 'no'} ({sep:.3f} against {reuse:.3f}).")
  return lines + [""] + claims


def figure3(runs: dict[str, list[dict]], target: float) -> list[str]:
  """AQ-SGD against direct quantization at the same bits: final eval losses, steps to the same loss."""
  base = final(runs["fp32"], served)[0]
  lines = [f"| method | eval loss (off) | eval loss (on) | served - fp32 | steps to {target:.3f} (served) | seeds |",
           "|---|---:|---:|---:|---:|---:|"]
  for name in FIGURE3:
    if name in runs:
      n, steps = len(runs[name]), [steps_to(r, target) for r in runs[name]]
      reached = f"{np.mean(steps):.0f}" if None not in steps else f"not in {n - steps.count(None)}/{n} seeds"
      lines.append(f"| {name} | {pm(final(runs[name], 'eval_off'), n)} | {pm(final(runs[name], 'eval_on'), n)} | "
                   f"{final(runs[name], served)[0] - base:+.3f} | {reached} | {n} |")
  claims = []
  for bits in ("fw2-bw4", "fw3-bw6", "fw4-bw8"):
    aq, direct = f"aqsgd-{bits}", f"direct-{bits}"
    if aq in runs and direct in runs:
      a, d = final(runs[aq], served)[0], final(runs[direct], served)[0]
      claims.append(f"{bits}: AQ-SGD {a:.3f} ({a - base:+.3f} from fp32), direct {d:.3f} ({d - base:+.3f}): "
                    f"{'AQ-SGD closer to fp32' if a < d else 'direct closer to fp32'}.")
  return lines + [""] + claims


def feedback(runs: dict[str, list[dict]]) -> list[str]:
  """The error-feedback rows (the papers give them for ResNet18 only): final eval loss on and off."""
  lines = ["| method | fwd | bwd | eval loss (on) | eval loss (off) | seeds |", "|---|---|---|---:|---:|---:|"]
  for name in ("fp32", "top10-reuse", *FEEDBACK):
    if name in runs:
      m, n = methods.get(name), len(runs[name])
      lines.append(f"| {name} | `{m.fwd}` | `{m.bwd}` | {pm(final(runs[name], 'eval_on'), n)} | "
                   f"{pm(final(runs[name], 'eval_off'), n)} | {n} |")
  return lines


def mean_time(runs: list[dict], target: float, timed) -> float | None:
  """Mean over the runs of the predicted time to `target` (`time_to_target.seconds_at`); None unless all reach it."""
  steps = [steps_to(r, target) for r in runs]
  if None in steps:
    return None
  return float(np.mean([time_to_target.seconds_at(r["history"], s, timed) for r, s in zip(runs, steps)]))


def speedups(runs: dict[str, list[dict]], steps: dict, target: float) -> dict[str, float | None]:
  """{method: fp32's mean time to `target` / the method's} on one network (`steps`: method -> StepTime)."""
  base = mean_time(runs["fp32"], target, steps["fp32"])
  return {n: (None if (t := mean_time(rs, target, steps[n])) is None else base / t) for n, rs in runs.items()}


def networks(runs: dict[str, list[dict]], timed: dict, slowdowns: dict, target: float) -> list[str]:
  """Speed-up over fp32 in time to the same loss, one column per network (`timed`: network -> (link, {method:
  StepTime})), then the slowest network's at other targets (SHARES)."""
  slowest = max(slowdowns, key=slowdowns.get)
  shown = lambda v: "-" if v is None else f"{v:.2f}x"
  ups = {net: speedups(runs, steps, target) for net, (_, steps) in timed.items()}
  by_share = {q: speedups(runs, timed[slowest][1], target_loss(runs["fp32"], q)) for q in SHARES}
  lines = ["| method | steps to the loss | " + " | ".join(f"{n} (fp32 {s:.2f}x slower)" for n, s in slowdowns.items())
           + " | " + " | ".join(f"{slowest}, {q:.0%} of fp32's gain" for q in SHARES) + " |",
           "|---|---:|" + "---:|" * (len(slowdowns) + len(SHARES))]
  for name, rs in runs.items():
    steps = [steps_to(r, target) for r in rs]
    reached = f"{np.mean(steps):.0f}" if None not in steps else f"not in {len(rs) - steps.count(None)}/{len(rs)}"
    lines.append(f"| {name} | {reached} | " + " | ".join(shown(ups[n][name]) for n in timed) + " | "
                 + " | ".join(shown(by_share[q][name]) for q in SHARES) + " |")
  links = "; ".join(f"{n}: {link} (fp32 step {steps['fp32'].seconds * 1e3:.0f} ms, its dense step; "
                    f"aqsgd-fw3-bw6 {steps['aqsgd-fw3-bw6'].seconds * 1e3:.0f} ms)" if "aqsgd-fw3-bw6" in steps else
                    f"{n}: {link} (fp32 step {steps['fp32'].seconds * 1e3:.0f} ms)" for n, (link, steps) in timed.items())
  return lines + ["", f"The networks' links: {links}."]


def figure3_plot(title: str, runs: dict[str, list[dict]], path):
  """AQ-SGD's Figure 3 at this scale: served eval loss (mean over seeds) against steps, AQ-SGD solid, direct
  dashed."""
  plt = plots.pyplot()
  fig, ax = plt.subplots(figsize=(6, 4))
  colours = {"fw2-bw4": "tab:red", "fw3-bw6": "tab:blue", "fw4-bw8": "tab:green", "fw3-bw6-warm0": "tab:purple"}
  for name in FIGURE3:
    if name in runs:
      at, loss = curve(runs[name])
      ax.plot(at, loss, lw=1.2, color=colours.get(name.partition("-")[2], "black"),
              ls="--" if name.startswith("direct") else "-", label=name)
  ax.set(xlabel="step", ylabel="eval loss (served: the better of on and off)", title=title)
  ax.title.set_fontsize(8)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  return plots.save(fig, path)


def figure4(title: str, runs: dict[str, list[dict]], timed: dict, target: float, path):
  """AQ-SGD's Figure 4 at this scale: served eval loss (mean over seeds) against predicted time, a panel per
  network, the same loss dotted."""
  plt = plots.pyplot()
  fig, axes = plt.subplots(1, len(timed), figsize=(3.2 * len(timed), 3.4), sharey=True)
  for ax, (net, (link, steps)) in zip(np.atleast_1d(axes), timed.items()):
    for name in ("fp32", "aqsgd-fw2-bw4", "aqsgd-fw3-bw6", "aqsgd-fw3-bw6-warm0", "direct-fw3-bw6", "top10-reuse"):
      if name in runs:
        at, loss = curve(runs[name])
        seconds = [time_to_target.seconds_at(runs[name][0]["history"], int(s), steps[name]) for s in at]
        ax.plot(seconds, loss, lw=1.2, ls="--" if name.startswith("direct") else "-", label=name)
    ax.axhline(target, color="grey", lw=0.8, ls=":")
    ax.set(xlabel="predicted time, s", title=f"{net}: {link}")
    ax.title.set_fontsize(7)
    ax.grid(alpha=0.3, which="both")
  np.atleast_1d(axes)[0].set_ylabel("eval loss (served)")
  np.atleast_1d(axes)[-1].legend(fontsize=6)
  fig.suptitle(title, fontsize=8)
  fig.tight_layout()
  return plots.save(fig, path)


def inflation_rung(runs: dict[str, list[dict]], width: int, budget: int, share: float = SHARE) -> dict:
  """The width's fine-tuning runs as one rung of a step-inflation table (`jaxcomp.analysis.step_table`'s format):
  per method, per seed, its steps to the same loss over fp32's of the same seed (censored at the budget: inflation
  above budget / fp32's steps). Its horizon is the budget."""
  target = target_loss(runs["fp32"], share)
  dense = {r["config"]["seed"]: steps_to(r, target) for r in runs["fp32"]}
  out = {}
  for name, rs in runs.items():
    out[name] = []
    for r in rs:
      s0, s = dense.get(r["config"]["seed"]), steps_to(r, target)
      if s0:
        out[name].append({"seed": f"-seed{r['config']['seed']}", "target": target, "fp32_steps": s0, "steps": s,
                          "inflation": (s if s is not None else budget) / s0, "censored": s is None})
  return {"width": width, "horizon": budget, "methods": out}
