"""Time to a target loss over a link: T = steps to the target x the step time predicted on the link.

Protocol NanoGPT's score (PluralisResearch/ProtocolNanoGPT): T = the steps a run takes to reach the target eval loss
x its steady-state step time over the metered links. Here the steps come from the frontier's runs (the first
evaluated step whose eval loss with compression on is <= the target, `evaluation.target_summary`, per seed) and the step
time from `netsim`: each stage's forward and backward and each boundary's codec timed on this machine by the
step-cost library's clock (`jaxcomp.analysis.step_cost.stage_costs`, `op_seconds`), the bytes of each
message from the boundary, the schedule's table run as the sharded executor runs it (`ticks=True`; with
`overlap`, its `--overlap` table: each message crosses its link while both ends compute the next tick) over
`link`. Steps in a dense warm-up epoch (AQ-SGD) take the dense (fp32) step's time. A method
whose seeds do not all reach the target within the budget has no T; its best loss is reported.
"""
import argparse
import dataclasses
import math
import pathlib
import textwrap

import numpy as np

from experiments import config, gpt2_wikitext, plots
from jaxcomp import pipeline
from jaxcomp.analysis import netsim, step_cost
from jaxcomp.analysis.link import Link
from jaxcomp.compress.spec import parse_boundary
from jaxcomp.parallel import schedules
from jaxcomp.runtime import evaluation


@dataclasses.dataclass(frozen=True)
class StepTime:
  """One method's predicted step on the link: `seconds` (compressed steps), `dense_seconds` (its dense warm-up
  steps), the critical path's seconds by term (`netsim.Timeline.critical_seconds`), where the times come from, and
  `first_visit_seconds` (AQ-SGD's first visits after its warm-up: activations dense, gradients compressed; None:
  charged as dense)."""
  seconds: float
  dense_seconds: float
  critical: dict
  source: str
  first_visit_seconds: float | None = None


def dense_steps(history: list[dict], until: int) -> int:
  """How many of a run's first `until` steps sent dense activations (warm-up epochs; AQ-SGD first visits, at most
  the epoch's: an epoch's dense steps are taken as its first)."""
  dense, start = 0, 0
  for record in history:
    if start >= until:
      break
    dense += min(record["dense_steps"], min(record["step"], until) - start)
    start = record["step"]
  return dense


def seconds_at(history: list[dict], step: int, timed: StepTime) -> float:
  """The predicted time of a run's first `step` steps: compressed steps at `timed.seconds`, a warm-up epoch's
  at `timed.dense_seconds`, first visits in a compressed epoch at `timed.first_visit_seconds` (dense when None)."""
  total, start = 0.0, 0
  for record in history:
    if start >= step:
      break
    steps = min(record["step"], step) - start
    dense = min(record["dense_steps"], steps)
    warmup = record.get("mode", "warmup") == "warmup"  # a record without its mode: charged as dense
    first = timed.dense_seconds if warmup or timed.first_visit_seconds is None else timed.first_visit_seconds
    total += dense * first + (steps - dense) * timed.seconds
    start = record["step"]
  return total


def steps_to_target(run: dict, target: float) -> dict:
  """`evaluation.target_summary` of one run's results, with `dense_steps`: how many of the steps up to the target (or
  the run's end) sent dense activations (`dense_steps`)."""
  history = run["history"]
  summary = evaluation.target_summary(history, target)
  return {**summary, "dense_steps": dense_steps(history, summary["step"] or history[-1]["step"])}


class StepTimes:
  """Predicted step times of runs (`config.RunConfig`s) on `link`, on `schedule`'s table: each run's pipeline built
  without data (`gpt2_wikitext.abstract`), its stages timed once per stage set (the methods of a frontier share
  theirs unless a bottleneck changes them) and its codecs per method, by a clock of `jaxcomp.analysis.step_cost`
  (`clock`; default its `Measured` clock, `repeats` timed runs per op; its `Estimated` clock takes the times of
  programs compiled for a target), netsim's timeline as the sharded executor runs the table with `meter` (netsim's
  link model: per_direction, or inbound, Protocol NanoGPT's receiver meter); `overlap`: the executor's overlapped
  sends (`schedules.parse(schedule, overlap=True)`, M >= 2S microbatches)."""

  def __init__(self, link: Link, schedule: str, repeats: int = 10, meter: str = "per_direction", clock=None,
               overlap: bool = False):
    self.link = link
    self.schedule = schedules.parse(schedule, overlap)
    self.clock = clock or step_cost.Measured(repeats)
    self.meter = meter
    self.stage_costs = {}  # stage set -> the benchmark's CostSource
    self.op_times = {}  # (stage set, boundary) -> its stages' forward and backward op seconds, codecs in

  def sent(self, cfg: config.RunConfig, boundary=None) -> list[tuple[int, int]]:
    """Each stage boundary's (forward, backward) bytes per message of `cfg`'s run with `boundary` (default: the
    run's): its `wire_bytes` at the activation shapes."""
    pipe, _, batch, _ = gpt2_wikitext.abstract(cfg)
    return [(boundary or pipe.boundary).wire_bytes(s.shape, s.dtype) for s in pipeline.activation_shapes(pipe, batch)]

  def timeline(self, cfg: config.RunConfig, boundary=None, sent=None, link: Link | None = None) -> netsim.Timeline:
    """netsim's step of `cfg`'s run with `boundary` (default: the run's; its codecs timed by the clock), sending
    `sent` (each boundary's (forward, backward) bytes per message; default: `self.sent`) over `link` (default:
    `self.link`)."""
    pipe, _, batch, _ = gpt2_wikitext.abstract(cfg)
    stage_set = (cfg.compression.bottleneck, cfg.training.batch_size, pipe.microbatches)
    if stage_set not in self.stage_costs:
      self.stage_costs[stage_set] = step_cost.stage_costs(pipeline.uncompressed(pipe), batch, self.clock)
    boundary = boundary or pipe.boundary
    sent = sent or self.sent(cfg, boundary)
    if (stage_set, boundary) not in self.op_times:
      self.op_times[stage_set, boundary] = step_cost.op_seconds(self.stage_costs[stage_set](boundary))
    fwd_s, bwd_s = self.op_times[stage_set, boundary]
    table = self.schedule.train_table(pipe.num_stages, pipe.microbatches)
    return netsim.simulate_step(fwd_s, bwd_s, [f for f, _ in sent], [b for _, b in sent], pipe.microbatches,
                                link or self.link, schedule=table, ticks=True, meter=self.meter)

  def link_for_slowdown(self, dense: config.RunConfig, slowdown: float, latency_share: float) -> Link:
    """The link on which `dense`'s step takes `slowdown` times its unmetered step (its messages free: `Link(inf)`):
    bandwidth B by bisection, latency `latency_share` x one dense message's transfer at B (8 x the first boundary's
    forward bytes / B). Protocol NanoGPT's dense record: slowdown 186.3, latency share 0.0745 (`experiments.paper`)."""
    if not 1 < slowdown < math.inf:  # also rejects NaN
      raise ValueError(f"a dense slowdown is the step on the link over the step unmetered, so it must be finite and "
                       f"> 1, got {slowdown!r}")
    sent = self.sent(dense)  # once: every step below sends the same messages
    step = lambda link: self.timeline(dense, sent=sent, link=link).makespan
    unmetered = step(Link(math.inf))
    link_at = lambda bps: Link(bps, latency_share * 8 * sent[0][0] / bps)
    lo, hi = 1.0, 1e15  # bits/s: the slowdown falls as the bandwidth grows
    for _ in range(60):
      mid = math.sqrt(lo * hi)
      lo, hi = (lo, mid) if step(link_at(mid)) < slowdown * unmetered else (mid, hi)
    return link_at(hi)

  def __call__(self, cfg: config.RunConfig) -> StepTime:
    compressed, dense = self.timeline(cfg), self.timeline(cfg, parse_boundary("none", "none"))
    first = None
    if cfg.compression.fwd.startswith("aqsgd+"):  # a first visit: activations dense, gradients as compressed
      first = self.timeline(cfg, parse_boundary("none", cfg.compression.bwd)).makespan
    return StepTime(compressed.makespan, dense.makespan, compressed.critical_seconds(), self.clock.source, first)


def row(method: str, runs: list[dict], summary: dict, step: StepTime, target_loss: float) -> dict:
  """One method over its seeds' results (`runs`): steps to the target and T (mean, sample std; T only when every
  seed reached it), the best eval loss (compression on), its predicted step; bytes from the frontier's `summary`."""
  target = [steps_to_target(run, target_loss) for run in runs]
  reached = [t for t in target if t["step"] is not None]
  seconds = [seconds_at(run["history"], t["step"], step) for run, t in zip(runs, target) if t["step"] is not None]
  stats = lambda v: (float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else 0.0) if v else (None, None)
  out = {"method": method, **{k: summary[k] for k in ("fwd", "bwd", "bottleneck", "bytes_steady", "bytes")},
         "seeds": len(runs), "reached": len(reached), "cap": max(r["history"][-1]["step"] for r in runs),
         "step_s": step.seconds, "dense_step_s": step.dense_seconds, "critical": step.critical}
  out["steps"], out["steps_std"] = stats([t["step"] for t in reached])
  out["best_loss"], out["best_loss_std"] = stats([t["best_loss"] for t in target])
  out["T"], out["T_std"] = stats(seconds) if len(reached) == len(runs) else (None, None)
  return out


def relative(rows: list[dict], baselines=("fp32", "bf16")) -> list[dict]:
  """Each row with `T_over_<baseline>`: its mean T / the baseline's (None where either has none)."""
  base = {r["method"]: r["T"] for r in rows}
  return [{**r, **{f"T_over_{b}": r["T"] / base[b] if r["T"] is not None and base.get(b) else None
                   for b in baselines}} for r in rows]


def table(rows: list[dict], target: float, link: Link) -> str:
  """Markdown: one row per method, by T (methods without one last)."""
  pm = lambda r, k, fmt: "-" if r[k] is None else format(r[k], fmt) + (
      f" ± {format(r[k + '_std'], fmt)}" if r["seeds"] > 1 else "")
  ratio = lambda v: "-" if v is None else f"{v:.3f}"
  lines = [f"| method | fwd | bwd | B/token (steady) | steps to {target:g} | seeds reached | best eval loss (on) | "
           f"step s on {link} | critical % compute / link | T s | T / fp32 | T / bf16 |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in sorted(rows, key=lambda r: (r["T"] is None, r["T"] or 0.0, r["bytes_steady"])):
    fwd = f"`{r['bottleneck']}` then `{r['fwd']}`" if r.get("bottleneck") else f"`{r['fwd']}`"
    crit = r["critical"]
    shares = f"{100 * crit['compute'] / sum(crit.values()):.0f} / {100 * crit['link'] / sum(crit.values()):.0f}"
    steps = pm(r, "steps", ".0f") if r["reached"] else f"not in {r['cap']}"
    lines.append(f"| {r['method']} | {fwd} | `{r['bwd']}` | {r['bytes_steady']:.1f} | {steps} | "
                 f"{r['reached']}/{r['seeds']} | {pm(r, 'best_loss', '.4f')} | {r['step_s']:.4g} | {shares} | "
                 f"{pm(r, 'T', '.4g')} | {ratio(r['T_over_fp32'])} | {ratio(r['T_over_bf16'])} |")
  return "\n".join(lines)


def plot(rows: list[dict], path: pathlib.Path, title: str) -> pathlib.Path:
  """T (std over seeds as error bars) against steady-state bytes per token, log-log; methods without a T listed."""
  plt = plots.pyplot()
  fig, ax = plt.subplots(figsize=(8, 5))
  timed = [r for r in rows if r["T"] is not None]
  for r in timed:
    ax.errorbar(r["bytes_steady"], r["T"], yerr=r["T_std"], fmt="o", ms=4.5, capsize=2.5, color="tab:blue", zorder=3)
    ax.annotate(r["method"], (r["bytes_steady"], r["T"]), fontsize=6.5, xytext=(3, 2), textcoords="offset points")
  missed = [r["method"] for r in rows if r["T"] is None]
  ax.set(xscale="log", yscale="log", xlabel="bytes per token, all boundaries, both directions (steady state, log)",
         ylabel="T = steps to target x predicted step time, s (log)")
  missed = [f"no T (target not reached by every seed): {', '.join(missed)}"] if missed else []
  ax.set_title("\n".join(textwrap.wrap(title, 130) + missed), fontsize=7)
  ax.grid(alpha=0.3, which="both")
  fig.tight_layout()
  return plots.save(fig, path)


def main(argv=None):
  """This module is the frontier's time-to-target library, not a command: say which commands use it."""
  parser = argparse.ArgumentParser(
      prog="python -m experiments.time_to_target", description=__doc__.splitlines()[0],
      epilog="This module is a library. Time to a target is computed by `python -m experiments.frontier "
      "--target-loss L --link BW:LAT` (CPU-scale runs timed here) and by `python -m jaxcomp.plan` (any model, "
      "stages and link, from the shipped step-inflation table).")
  parser.parse_args(argv)
  parser.print_help()


if __name__ == "__main__":
  main()
