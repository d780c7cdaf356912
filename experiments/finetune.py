"""Fine-tuning, as the papers do: a model pretrained here with fp32 boundaries on one text, fine-tuned with each
method on another for several epochs, so AQ-SGD's per-example buffers have something to reuse.

    python -m experiments.finetune                        # widths 64 and 128, seeds 0..2 (resumable)
    python -m experiments.finetune --widths 64 --seeds 1 --methods fp32,aqsgd-fw2-bw4 --out /tmp/ft
    python -m experiments.finetune --report               # the tables and plots of the runs finished so far

Per width W (GPT-2 tiny: 4 blocks, 4 heads, byte tokens, one block per stage on 4 stages): one run of recipe
`pretrain-cpu` (the King James Bible, fp32 boundaries, seed 0) is trained once, then every method fine-tunes its
weights with recipe `finetune-cpu` (tiny Shakespeare, 8 epochs over 256 blocks of 128 bytes, evaluated every 16
steps with compression on and off) for each seed (the data order, dropout and stochastic rounding change with the
seed; the pretrained model does not). A finished run is skipped, an interrupted one resumes from its last epoch.

The report (`<out>/finetune.md` and its plots) puts each of the papers' fine-tuning claims beside the runs: Rudakov
et al.'s Table 5 (TopK 50..10% with index reuse, 10% separate), AQ-SGD's Figure 3 (AQ-SGD against direct
quantization at the same bits, eval loss against steps) and AQ-SGD's time to the same loss on its five networks:
each network is the link on which fp32's step slows as the paper's Table 2 does (`NETWORKS`), every method's step
predicted there from its stages and codecs timed on this machine (`time_to_target.StepTimes`), and T = the steps to
fp32's loss x that step (dense warm-up steps at the dense step's time).
"""
import argparse
import math
import pathlib
import sys

import numpy as np

from experiments import config, frontier, gpt2_wikitext, plots, runner, study, time_to_target
from jaxcomp import methods
from jaxcomp.analysis.link import Link
from jaxcomp.data import batching
from jaxcomp.runtime import evaluation, train

# Rudakov et al.'s Table 5 (GPT-2 small fine-tuned on WikiText-2, eval loss) and AQ-SGD's Figure 3 rows
TABLE5 = {"fp32": 3.05, "top50-reuse": 3.11, "top30-reuse": 3.27, "top20-reuse": 3.51, "top10-reuse": 4.31,
          "top10-separate": 8.0}
FIGURE3 = ("fp32", "aqsgd-fw2-bw4", "direct-fw2-bw4", "aqsgd-fw3-bw6", "direct-fw3-bw6", "aqsgd-fw4-bw8",
           "direct-fw4-bw8")
FEEDBACK = ("ef-top10-reuse", "ef21-top10-reuse", "aqsgd-top10-bw4")  # the papers' error-feedback rows (ResNet's)
METHODS = (*TABLE5, *FIGURE3[1:], *FEEDBACK)
# AQ-SGD's Table 2: fp32's training throughput at 10 Gbps, 1 Gbps, 500, 300 and 100 Mbps, and AQ-SGD fw3-bw6's at
# 10 Gbps, taken as the throughput with free messages: network k slows fp32's step UNMETERED / FP32_THROUGHPUT[k]
# times (10 Gbps 1.05x ... 100 Mbps 8x; relative to the 10 Gbps step 3.8 / FP32_THROUGHPUT[k], as the paper's)
FP32_THROUGHPUT = {"10gbps": 3.8, "1gbps": 3.2, "500mbps": 2.7, "300mbps": 1.8, "100mbps": 0.5}
UNMETERED = 4.0
NETWORKS = {name: UNMETERED / t for name, t in FP32_THROUGHPUT.items()}
PAPER_SPEEDUP = 4.3  # AQ-SGD's end-to-end speed-up over fp32 at 100 Mbps, in time to the same loss
TARGET_AT = 0.75  # the same loss: the eval loss fp32 reaches (mean over seeds) at this share of its steps
TEXT = "shakespeare"


def pretrain_run(args, width: int) -> config.RunConfig:
  """The width's pretraining run (recipe `pretrain-cpu`, fp32 boundaries, seed 0) in <out>/pretrain."""
  return config.resolve(gpt2_wikitext.EXPERIMENT, "pretrain-cpu", model_width=width, out=str(args.out / "pretrain"),
                        steps=args.pretrain_steps, lr_steps=args.pretrain_steps,
                        run_name=f"pretrain-w{width}", no_progress=True,
                        resume=bool(train.saved_epochs(args.out / "pretrain" / f"pretrain-w{width}" / "ckpt")))


def pretrained(args, width: int) -> pathlib.Path:
  """The width's pretrained run folder, trained first if its run has not finished."""
  cfg = pretrain_run(args, width)
  folder = pathlib.Path(cfg.output.out) / cfg.output.run_name
  if study.finished(folder.parent, folder.name, cfg.training.steps, recipe="pretrain-cpu", model_width=width) is None:
    runner.run(gpt2_wikitext.EXPERIMENT, cfg)
  else:
    print(f"[finetune] {folder.name}: done, skipped")
  return folder


def width_args(args, width: int) -> argparse.Namespace:
  """The study settings `study.run_config` reads, for the width's fine-tuning runs (in <out>/w<W>)."""
  recipe = gpt2_wikitext.RECIPES["finetune-cpu"]
  steps = args.epochs * batching.num_batches(args.train_examples, recipe["batch_size"])
  return argparse.Namespace(recipe="finetune-cpu", steps=steps, train_examples=args.train_examples,
                            batch_size=recipe["batch_size"], eval_examples=args.eval_examples,
                            eval_every=args.eval_every, out=args.out / f"w{width}", outliers=None,
                            microbatches=None, target_loss=None, stop_at_target=False)


def finetuned(args, width: int, folder: pathlib.Path, name: str, seed: int, train: bool = True) -> dict | None:
  """The results of method `name`'s fine-tuning run of `seed` at `width` (trained or resumed unless finished; with
  `train` False, None when not finished)."""
  w_args = width_args(args, width)
  settings = dict(text=TEXT, model_width=width, pretrained=str(folder))
  checked = dict(recipe="finetune-cpu", eval_every=w_args.eval_every, **settings)
  if not train:
    return study.finished(w_args.out, study.run_name(name, seed), w_args.steps, **checked)
  return study.run_or_resume(name, w_args, seed, checked, "finetune", **settings)


def mean_std(values) -> tuple[float, float]:
  return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def curve(runs: list[dict], key: str = "eval_on") -> tuple[np.ndarray, np.ndarray]:
  """(steps, mean eval loss over the runs) at every evaluated step the runs share."""
  points = [{e["step"]: e[key]["loss"] for e in evaluation.evaluations(run["history"])} for run in runs]
  steps = sorted(set.intersection(*(set(p) for p in points)))
  return np.array(steps), np.array([np.mean([p[s] for p in points]) for s in steps])


def target_loss(fp32_runs: list[dict]) -> float:
  """The same loss: fp32's mean eval loss at the evaluated step nearest TARGET_AT of its steps."""
  steps, losses = curve(fp32_runs)
  return float(losses[np.argmin(np.abs(steps - TARGET_AT * steps[-1]))])


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m experiments.finetune", description=__doc__.splitlines()[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--widths", default="64,128", help="GPT-2 tiny widths (multiples of its 4 heads)")
  p.add_argument("--seeds", type=int, default=3, help="fine-tuning seeds 0..N-1 of every method")
  p.add_argument("--methods", default=",".join(METHODS), help="jaxcomp.methods names (fp32 always runs)")
  p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/finetune"))
  recipe, pre = gpt2_wikitext.RECIPES["finetune-cpu"], gpt2_wikitext.RECIPES["pretrain-cpu"]
  p.add_argument("--pretrain-steps", type=int, default=pre["steps"], help="steps of each width's pretraining")
  p.add_argument("--epochs", type=int, default=recipe["epochs"], help="fine-tuning epochs")
  p.add_argument("--train-examples", type=int, default=recipe["train_examples"],
                 help="fine-tuning blocks (the first of tiny Shakespeare's training text)")
  p.add_argument("--eval-examples", type=int, default=recipe["eval_examples"], help="held-out blocks evaluated")
  p.add_argument("--eval-every", type=int, default=recipe["eval_every"], help="evaluate every this many steps")
  p.add_argument("--repeats", type=int, default=10, help="timed runs per stage and codec for the step times")
  p.add_argument("--report", action="store_true", help="write the report of the runs finished so far; train nothing")
  return p


def parse(argv=None) -> argparse.Namespace:
  p = parser()
  args = p.parse_args(argv)
  try:
    args.widths = [int(w) for w in args.widths.split(",")]
  except ValueError:
    p.error(f"--widths {args.widths!r}: give widths as integers, e.g. 64,128")
  names = args.methods.split(",")
  unknown = [n for n in names if n not in methods.METHODS]
  if unknown:
    p.error(f"--methods: unknown {unknown}; choose from {', '.join(methods.METHODS)}")
  args.methods = [methods.DENSE, *(n for n in names if n != methods.DENSE)]
  for flag in ("seeds", "pretrain_steps", "epochs", "train_examples", "eval_examples", "eval_every"):
    if getattr(args, flag) < 1:
      p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: give at least 1")
  return args


def main(argv=None):
  args = parse(argv)
  if not args.report:
    for seed in range(args.seeds):  # every width's seed 0 first: the study has both widths early
      for width in args.widths:
        folder = pretrained(args, width)
        for name in args.methods:
          finetuned(args, width, folder, name, seed)
  return report(args)


if __name__ == "__main__":
  try:
    main()
  except ValueError as err:
    sys.exit("error: " + " ".join(str(err).split()))


def width_runs(args, width: int) -> dict[str, list[dict]]:
  """Each method's finished fine-tuning runs at `width` (seeds 0..args.seeds-1), methods without one left out."""
  folder = args.out / "pretrain" / f"pretrain-w{width}"
  runs = {n: [finetuned(args, width, folder, n, s, train=False) for s in range(args.seeds)] for n in args.methods}
  return {n: [r for r in rs if r is not None] for n, rs in runs.items() if any(r is not None for r in rs)}


def final(runs: list[dict], key: str) -> tuple[float, float]:
  return mean_std([run["history"][-1][key]["loss"] for run in runs])


def pm(value: tuple[float, float], n: int, fmt: str = ".3f") -> str:
  return format(value[0], fmt) + (f" ± {format(value[1], fmt)}" if n > 1 else "")


def table5(runs: dict[str, list[dict]]) -> list[str]:
  """Rudakov's Table 5 beside the runs: final eval loss on and off, the gap to fp32, the paper's."""
  base = final(runs["fp32"], "eval_on")[0]
  lines = ["| method | eval loss (on) | eval loss (off) | on - fp32 | seeds | Rudakov: eval loss | Rudakov: - fp32 |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  for name, paper in TABLE5.items():
    if name in runs:
      on, off = final(runs[name], "eval_on"), final(runs[name], "eval_off")
      lines.append(f"| {name} | {pm(on, len(runs[name]))} | {pm(off, len(runs[name]))} | {on[0] - base:+.3f} | "
                   f"{len(runs[name])} | {paper:.2f} | {paper - TABLE5['fp32']:+.2f} |")
  ladder = [n for n in ("top50-reuse", "top30-reuse", "top20-reuse", "top10-reuse") if n in runs]
  losses = [final(runs[n], "eval_on")[0] for n in ladder]
  claims = [f"Loss rises as TopK keeps fewer values ({' < '.join(ladder)}): "
            f"{'yes' if all(a < b for a, b in zip(losses, losses[1:])) else 'no'} ({', '.join(f'{v:.3f}' for v in losses)})."]
  if {"top10-reuse", "top10-separate"} <= set(runs):
    sep, reuse = final(runs["top10-separate"], "eval_on")[0], final(runs["top10-reuse"], "eval_on")[0]
    claims.append(f"10% with the gradient's own TopK (separate) is worse than with index reuse: "
                  f"{'yes' if sep > reuse else 'no'} ({sep:.3f} against {reuse:.3f}).")
  return lines + [""] + claims


def figure3(runs: dict[str, list[dict]], target: float) -> list[str]:
  """AQ-SGD against direct quantization at the same bits: final and best eval loss, steps to the same loss."""
  base = final(runs["fp32"], "eval_on")[0]
  lines = [f"| method | eval loss (on) | on - fp32 | best (on) | steps to {target:.3f} | seeds |",
           "|---|---:|---:|---:|---:|---:|"]
  for name in FIGURE3:
    if name in runs:
      on = final(runs[name], "eval_on")
      best = mean_std([time_to_target.steps_to_target(r, target)["best_loss"] for r in runs[name]])
      steps = [time_to_target.steps_to_target(r, target)["step"] for r in runs[name]]
      reached = f"{np.mean(steps):.0f}" if all(s is not None for s in steps) else \
          f"{sum(s is not None for s in steps)}/{len(steps)} seeds"
      lines.append(f"| {name} | {pm(on, len(runs[name]))} | {on[0] - base:+.3f} | {pm(best, len(runs[name]))} | "
                   f"{reached} | {len(runs[name])} |")
  claims = []
  for bits in ("fw2-bw4", "fw3-bw6", "fw4-bw8"):
    aq, direct = f"aqsgd-{bits}", f"direct-{bits}"
    if aq in runs and direct in runs:
      a, d = final(runs[aq], "eval_on")[0], final(runs[direct], "eval_on")[0]
      claims.append(f"{bits}: AQ-SGD {a:.3f} against direct {d:.3f} ({'AQ-SGD lower' if a < d else 'direct lower'}; "
                    f"fp32 {base:.3f}).")
  return lines + [""] + claims


def feedback(runs: dict[str, list[dict]]) -> list[str]:
  """The error-feedback rows (the papers give them for ResNet18 only): final eval loss on and off."""
  lines = ["| method | fwd | bwd | eval loss (on) | eval loss (off) | seeds |", "|---|---|---|---:|---:|---:|"]
  for name in ("fp32", *FEEDBACK):
    if name in runs:
      m = methods.get(name)
      lines.append(f"| {name} | `{m.fwd}` | `{m.bwd}` | {pm(final(runs[name], 'eval_on'), len(runs[name]))} | "
                   f"{pm(final(runs[name], 'eval_off'), len(runs[name]))} | {len(runs[name])} |")
  return lines


def networks(args, width: int, runs: dict[str, list[dict]], target: float) -> tuple[list[str], dict]:
  """Time to the same loss on each of AQ-SGD's networks: every method's speed-up over fp32 (fp32's T / its T),
  and what each network's link is. Returns (markdown lines, {network: (link, {method: StepTime})})."""
  w_args = width_args(args, width)
  settings = dict(text=TEXT, model_width=width, pretrained=str(args.out / "pretrain" / f"pretrain-w{width}"))
  cfg = {n: study.run_config(n, w_args, **settings) for n in runs}
  times = time_to_target.StepTimes(Link(math.inf), "gpipe", args.repeats)
  timed, rows = {}, {}
  for net, slowdown in NETWORKS.items():
    times.link = times.link_for_slowdown(cfg["fp32"], slowdown, 0.0)
    timed[net] = (times.link, {n: times(c) for n, c in cfg.items()})
    summaries = {r["method"]: r for r in frontier.over_seeds([frontier.summarize(r, n) for n in runs for r in runs[n]])}
    rows[net] = {r["method"]: r for r in time_to_target.relative(
        [time_to_target.row(n, runs[n], summaries[n], timed[net][1][n], target) for n in runs], baselines=("fp32",))}
  speedup = lambda r: "-" if r["T"] is None else f"{1 / r['T_over_fp32']:.2f}x"
  lines = ["| method | steps to the loss | " + " | ".join(f"{n} ({s:.2f}x)" for n, s in NETWORKS.items()) + " |",
           "|---|---:|" + "---:|" * len(NETWORKS)]
  for name in runs:
    first = rows["100mbps"][name]
    steps = f"{first['steps']:.0f}" if first["reached"] == first["seeds"] else f"{first['reached']}/{first['seeds']} seeds"
    lines.append(f"| {name} | {steps} | " + " | ".join(speedup(rows[n][name]) for n in NETWORKS) + " |")
  links = ", ".join(f"{n}: {link} (fp32 step {steps['fp32'].seconds * 1e3:.1f} ms)" for n, (link, steps) in timed.items())
  return lines + ["", f"Links (fp32's step slowed as in AQ-SGD's Table 2): {links}."], (timed, rows)


def figure4(width: int, runs: dict[str, list[dict]], timed: dict, target: float, path: pathlib.Path) -> pathlib.Path:
  """AQ-SGD's Figure 4 at this scale: eval loss (on, mean over seeds) against predicted time, a panel per network."""
  plt = plots.pyplot()
  fig, axes = plt.subplots(1, len(timed), figsize=(3.2 * len(timed), 3.4), sharey=True)
  for ax, (net, (link, steps)) in zip(axes, timed.items()):
    for name in ("fp32", "aqsgd-fw2-bw4", "aqsgd-fw3-bw6", "aqsgd-fw4-bw8", "direct-fw2-bw4", "direct-fw3-bw6",
                 "top10-reuse"):
      if name in runs:
        at, loss = curve(runs[name])
        seconds = [time_to_target.seconds_at(runs[name][0]["history"], int(s), steps[name]) for s in at]
        ax.plot(seconds, loss, lw=1.2, ls="--" if name.startswith("direct") else "-", label=name)
    ax.axhline(target, color="grey", lw=0.8, ls=":")
    ax.set(xscale="log", title=f"{net}: {link}", xlabel="predicted time, s (log)")
    ax.title.set_fontsize(7)
    ax.grid(alpha=0.3, which="both")
  axes[0].set_ylabel("eval loss (compression on)")
  axes[-1].legend(fontsize=6)
  fig.suptitle(f"GPT-2 tiny width {width} fine-tuned on tiny Shakespeare: loss against time (dotted: the same loss)",
               fontsize=8)
  fig.tight_layout()
  return plots.save(fig, path)


def figure3_plot(width: int, runs: dict[str, list[dict]], path: pathlib.Path) -> pathlib.Path:
  """AQ-SGD's Figure 3 at this scale: eval loss (on, mean over seeds) against steps, AQ-SGD solid, direct dashed."""
  plt = plots.pyplot()
  fig, ax = plt.subplots(figsize=(6, 4))
  colours = {"fw2-bw4": "tab:red", "fw3-bw6": "tab:blue", "fw4-bw8": "tab:green"}
  for name in FIGURE3:
    if name in runs:
      at, loss = curve(runs[name])
      bits = name.partition("-")[2]  # fp32: none (black)
      ax.plot(at, loss, lw=1.2, color=colours.get(bits, "black"), ls="--" if name.startswith("direct") else "-",
              label=name)
  ax.set(xlabel="step", ylabel="eval loss (compression on)",
         title=f"GPT-2 tiny width {width} fine-tuned on tiny Shakespeare: AQ-SGD (solid) and direct (dashed)")
  ax.title.set_fontsize(8)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  return plots.save(fig, path)


def report(args) -> str:
  """Writes <out>/finetune.md with the plots beside it, from the runs finished so far; returns the markdown."""
  parts = [f"Fine-tuning at CPU scale: GPT-2 tiny (4 blocks, 4 heads, byte tokens, 4 stages) pretrained with fp32 "
           f"boundaries on the King James Bible (recipe pretrain-cpu), fine-tuned on tiny Shakespeare (recipe "
           f"finetune-cpu: 256 blocks of 128 bytes, 8 epochs of 32 steps at batch 8, evaluated every 16 steps on 128 "
           f"held-out blocks). The same loss: fp32's mean eval loss at {TARGET_AT:.0%} of its steps."]
  for width in args.widths:
    runs = width_runs(args, width)
    if "fp32" not in runs:
      print(f"[finetune] width {width}: no finished fp32 run yet, left out of the report")
      continue
    pre = study.finished(args.out / "pretrain", f"pretrain-w{width}", 0, recipe="pretrain-cpu", model_width=width)
    target = target_loss(runs["fp32"])
    net_lines, (timed, _) = networks(args, width, runs, target)
    fig3 = figure3_plot(width, runs, args.out / f"figure3-w{width}.png")
    fig4 = figure4(width, runs, timed, target, args.out / f"figure4-w{width}.png")
    parts += [f"## Width {width}", f"Pretrained: eval loss {pre['history'][-1]['eval_on']['loss']:.3f} on its own "
              f"text after {pre['history'][-1]['step']} steps. The same loss: {target:.3f}.",
              "### Rudakov et al.'s Table 5 (TopK with index reuse)", *table5(runs),
              "### AQ-SGD's Figure 3 (AQ-SGD against direct quantization)", *figure3(runs, target),
              f"![]({fig3.name})", "### Error feedback", *feedback(runs),
              "### AQ-SGD's time to the same loss on its networks (speed-up over fp32)", *net_lines,
              f"AQ-SGD's paper: {PAPER_SPEEDUP}x at 100 Mbps.", f"![]({fig4.name})"]
  text = "\n\n".join(parts) + "\n"
  (args.out / "finetune.md").write_text(text)
  print(text)
  print(f"wrote {args.out / 'finetune.md'}")
  return text
