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

The report (`<out>/finetune.md` and its plots, `experiments.finetune_report`) puts each of the papers' fine-tuning
claims beside the runs: Rudakov et al.'s Table 5, AQ-SGD's Figure 3 and AQ-SGD's time to the same loss on its five
networks: each network is the link on which fp32's step slows as the paper's Table 2 does (`NETWORKS`), every
method's step predicted there from its stages and codecs timed on this machine (`time_to_target.StepTimes`), and
T = the predicted time of its steps to the same loss (dense warm-up steps at the dense step's time).
"""
import argparse
import math
import pathlib
import sys

from experiments import config, gpt2_wikitext, inflation, paper, runner, study, time_to_target
from experiments import finetune_report as report_lib
from jaxcomp import methods
from jaxcomp.analysis.link import Link
from jaxcomp.data import batching
from jaxcomp.runtime import train

METHODS = (*report_lib.TABLE5, *report_lib.FIGURE3[1:], *report_lib.FEEDBACK)
# AQ-SGD's networks: AQ-SGD fw3-bw6's throughput at 10 Gbps (its Table 2) taken as the throughput with free
# messages, network k slows fp32's step AQSGD_10GBPS_THROUGHPUT / AQSGD_FP32_THROUGHPUT[k] times (10 Gbps 1.05x ...
# 100 Mbps 8x; relative to the 10 Gbps step 3.8 / AQSGD_FP32_THROUGHPUT[k], as the paper's)
NETWORKS = {name: paper.AQSGD_10GBPS_THROUGHPUT / t for name, t in paper.AQSGD_FP32_THROUGHPUT.items()}
TEXT = "shakespeare"


def pretrained_folder(args, width: int) -> pathlib.Path:
  """The width's pretraining run folder: <out>/pretrain/pretrain-w<W>."""
  return args.out / "pretrain" / f"pretrain-w{width}"


def pretrain_run(args, width: int) -> config.RunConfig:
  """The width's pretraining run (recipe `pretrain-cpu`, fp32 boundaries, seed 0) in its folder."""
  folder = pretrained_folder(args, width)
  return config.resolve(gpt2_wikitext.EXPERIMENT, "pretrain-cpu", model_width=width, out=str(folder.parent),
                        steps=args.pretrain_steps, lr_steps=args.pretrain_steps, run_name=folder.name,
                        no_progress=True, resume=bool(train.saved_epochs(folder / "ckpt")))


def pretrained(args, width: int) -> pathlib.Path:
  """The width's pretrained run folder, trained first if its run has not finished or its checkpoint is gone (a
  study's shipped results hold no weights)."""
  folder = pretrained_folder(args, width)
  done = study.finished(folder.parent, folder.name, args.pretrain_steps, recipe="pretrain-cpu", model_width=width)
  if done is None or not train.saved_epochs(folder / "ckpt"):
    runner.run(gpt2_wikitext.EXPERIMENT, pretrain_run(args, width))
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


def finetune_settings(args, width: int) -> dict:
  """The settings every fine-tuning run of the width has beyond `width_args`: the text, the width, its start."""
  return dict(text=TEXT, model_width=width, pretrained=str(pretrained_folder(args, width)))


def finetuned(args, width: int, name: str, seed: int, train: bool = True) -> dict | None:
  """The results of method `name`'s fine-tuning run of `seed` at `width` (trained or resumed unless finished; with
  `train` False, None when not finished)."""
  w_args, settings = width_args(args, width), finetune_settings(args, width)
  checked = dict(recipe="finetune-cpu", eval_every=w_args.eval_every, **settings)
  if not train:
    return study.finished(w_args.out, study.run_name(name, seed), w_args.steps, **checked)
  return study.run_or_resume(name, w_args, seed, checked, "finetune", **settings)


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m experiments.finetune",
                              description=" ".join(__doc__.split("\n\n")[0].split()),
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
  p.add_argument("--export", type=pathlib.Path, metavar="FILE",
                 help="also write the runs' step inflation as the `finetune` regime of a step-inflation table (the "
                      "planner's --regime finetune), keeping FILE's other regimes; jaxcomp/data/step_inflation.json "
                      "is the shipped one")
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
    # every width's seed 0 first (the study has each width early), then each width's other seeds
    order = [(w, 0) for w in args.widths] + [(w, s) for w in args.widths for s in range(1, args.seeds)]
    for width, seed in order:
      pretrained(args, width)
      for name in args.methods:
        finetuned(args, width, name, seed)
  return report(args)



def width_runs(args, width: int) -> dict[str, list[dict]]:
  """Each method's finished fine-tuning runs at `width` (seeds 0..args.seeds-1), methods without one left out."""
  runs = {n: [finetuned(args, width, n, s, train=False) for s in range(args.seeds)] for n in args.methods}
  return {n: [r for r in rs if r is not None] for n, rs in runs.items() if any(r is not None for r in rs)}


def step_times(args, width: int, names) -> dict:
  """{network: (its link, {method: StepTime})}: each network's link (fp32's step slowed NETWORKS[network] times,
  no latency), every method's step predicted there from its stages and codecs timed on this machine."""
  w_args, settings = width_args(args, width), finetune_settings(args, width)
  cfg = {n: study.run_config(n, w_args, **settings) for n in names}
  times, timed = time_to_target.StepTimes(Link(math.inf), "gpipe", args.repeats), {}
  for net, slowdown in NETWORKS.items():
    times.link = times.link_for_slowdown(cfg[methods.DENSE], slowdown, 0.0)
    timed[net] = (times.link, {n: times(c) for n, c in cfg.items()})
  return timed


def export(args, rungs: dict):
  """Writes the rungs, their fitted models and their provenance as the `finetune` regime of args.export (its other
  regimes kept)."""
  models = inflation.fitted(rungs, sorted({n for r in rungs.values() for n in r["methods"]}))
  provenance = study.provenance("finetune", text=f"pretrained on kjv, fine-tuned on {TEXT}",
                                 model="GPT-2 tiny (finetune-cpu recipe)")
  study.export_regime(args.export, "finetune", {"cap": 1, "rungs": rungs, "models": models,
                                                "stages": gpt2_wikitext.FINETUNE_CPU["stages"], "provenance": provenance})
  print(f"wrote the finetune regime of {args.export}")


def report(args) -> str:
  """Writes <out>/finetune.md with its plots beside it, from the runs finished so far; returns the markdown."""
  parts = [f"GPT-2 tiny (4 blocks, 4 heads, byte tokens, one block per stage on 4 stages) pretrained with fp32 "
           f"boundaries on the King James Bible ({args.pretrain_steps} steps of 16 x 128 bytes), fine-tuned with each "
           f"method on tiny Shakespeare ({args.train_examples} blocks of 128 bytes, {args.epochs} epochs at batch 8, "
           f"lr 3e-4 linearly to 0), evaluated every {args.eval_every} steps on {args.eval_examples} held-out blocks "
           f"with compression on and off. Served loss: the better of the two. The same loss: where fp32's mean "
           f"served curve has made {report_lib.SHARE:.0%} of its gain from its first evaluation to its best."]
  rungs = {}
  for width in args.widths:
    runs = width_runs(args, width)
    if methods.DENSE not in runs:
      print(f"[finetune] width {width}: no finished fp32 run yet, left out of the report")
      continue
    budget = width_args(args, width).steps
    rungs[f"w{width}-h{budget}"] = report_lib.inflation_rung(runs, width, budget)
    folder = pretrained_folder(args, width)
    pre = study.finished(folder.parent, folder.name, 0, recipe="pretrain-cpu", model_width=width)
    target = report_lib.target_loss(runs[methods.DENSE])
    timed = step_times(args, width, runs)
    title = f"GPT-2 tiny width {width}, pretrained on the KJV, fine-tuned on tiny Shakespeare"
    fig3 = report_lib.figure3_plot(f"{title}: AQ-SGD (solid), direct (dashed)", runs,
                                   args.out / f"figure3-w{width}.png")
    fig4 = report_lib.figure4(f"{title}: loss against predicted time (dotted: the same loss)", runs, timed, target,
                              args.out / f"figure4-w{width}.png")
    parts += [f"## Width {width}",
              f"Pretrained: eval loss {pre['history'][-1]['eval_on']['loss']:.3f} on held-out KJV after "
              f"{pre['history'][-1]['step']} steps. The same loss: {target:.3f}.",
              "### Rudakov et al.'s Table 5: TopK with index reuse", "\n".join(report_lib.table5(runs)),
              "### AQ-SGD's Figure 3: AQ-SGD against direct quantization",
              "\n".join(report_lib.figure3(runs, target)), f"![]({fig3.name})",
              "### Error feedback", "\n".join(report_lib.feedback(runs)),
              "### AQ-SGD's time to the same loss on its networks: speed-up over fp32",
              "\n".join(report_lib.networks(runs, timed, NETWORKS, target)),
              f"AQ-SGD's paper: {paper.AQSGD_SPEEDUP}x at 100 Mbps.", f"![]({fig4.name})"]
  text = "\n\n".join(parts) + "\n"
  (args.out / "finetune.md").write_text(text)
  if args.export:
    export(args, rungs)
  print(text)
  print(f"wrote {args.out / 'finetune.md'}")
  return text


if __name__ == "__main__":
  try:
    main()
  except ValueError as err:
    sys.exit("error: " + " ".join(str(err).split()))
