"""Each schedule's ticks, bubble and stashed inputs, read from its table (docs/guide/executors.md).

    python -m jaxcomp.analysis.schedule_table [--sizes 4x8,4x16,8x16] [--chunks 2,4]

The bubble is `timetable.bubble_fraction`: the idle fraction of device time when every F takes 1,
every BW 2 (a B or a W 1) and messages none. Its formula: GPipe's and 1F1B's (S-1)/(M+S-1), interleaved
1F1B's with V chunks per device (S-1)/(VM+S-1) (`--chunks`: the V of its rows), ZB-H1's (S-1)/(3M+S-1);
each row also gives the table's bubble over 1F1B's at the same S and M.

Rows `NAME --overlap` are the tables with overlapped sends (`Schedule.with_overlapped_sends()`, a forwarding
delay of 2 ticks, where M >= 2S: every schedule's). The bubble above lets messages take no time, so the delay
changes nothing in it; the last two columns are the idle fraction of device time when the table runs as the
sharded executor runs it
(`netsim.simulate_step(..., ticks=True)`: plain ticks compute, then send, then wait; overlapped ticks send while
they compute), with messages that take no time and with messages that take as long as a stage's forward.
"""
import argparse
from typing import NamedTuple

from jaxcomp.analysis import netsim
from jaxcomp.parallel import schedules, timetable
from jaxcomp.parallel.plan import Plan

DEFAULT_SIZES = ((4, 8), (4, 16), (8, 16))
DEFAULT_CHUNKS = (2,)


class Row(NamedTuple):
  """One schedule at S stages and M microbatches, read from its table."""
  schedule: str
  stages: int
  microbatches: int
  ticks: int
  bubble: float
  formula: float  # FORMULAS[schedule]
  over_1f1b: float  # bubble / 1F1B's bubble at the same S and M
  peak_stashed: tuple[int, ...]  # per stage, the most microbatch inputs held at once
  executor_idle: tuple[float, float]  # idle fraction under the executor's ticks, messages of 0 and of one forward


def formula(schedule: schedules.Schedule, stages: int, microbatches: int) -> float:
  """The bubble's closed form: (S-1)/(kM+S-1), k = 3 where the backwards are split (ZB-H1: F, B, W of 1 unit),
  else the V chunks per device."""
  k = 3 if schedule.splits_backward else schedule.chunks_per_device
  return (stages - 1) / (k * microbatches + stages - 1)


def executor_idle(plan: Plan, message: float) -> float:
  """Idle fraction of device time when the plan's table runs tick by tick as the sharded executor runs it
  (netsim's ticks), a stage's F taking 1 and its BW 2 (a chunk's 1/V of that) and a message `message`."""
  table = plan.table
  chunks, per_device = table.num_chunks, table.chunks_per_device
  step = netsim.simulate_step([1.0 / per_device] * chunks, [2.0 / per_device] * chunks, [message] * (chunks - 1),
                              [message] * (chunks - 1), table.microbatches, 8.0, schedule=plan,
                              ticks=True)  # 8 bps: n bytes take n seconds
  return 1.0 - 3.0 * table.microbatches / step.makespan


def row(schedule: schedules.Schedule, stages: int, microbatches: int) -> Row:
  plan = Plan(schedule.train_table(stages, microbatches))
  table = plan.table
  bubble = timetable.bubble_fraction(table)
  baseline = timetable.bubble_fraction(schedules.OneFOneB().train_table(stages, microbatches))
  overlapped = " --overlap" if schedule.overlapped_sends else ""
  return Row(schedule.name + overlapped, stages, microbatches, table.ticks, bubble,
             formula(schedule, stages, microbatches), bubble / baseline if baseline else 1.0,
             timetable.peak_inputs_held(table), (executor_idle(plan, 0.0), executor_idle(plan, 1.0)))


def markdown(rows: list[Row]) -> str:
  """The rows as a markdown table."""
  lines = ["| schedule | S | M | ticks | bubble (table) | formula | bubble / 1F1B's | peak stashed inputs per device "
           "| executor's ticks idle: messages 0 | messages of one F |",
           "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
  for r in rows:
    lines.append(f"| `{r.schedule}` | {r.stages} | {r.microbatches} | {r.ticks} | {r.bubble:.4f} | {r.formula:.4f} "
                 f"| {r.over_1f1b:.3f} | {', '.join(map(str, r.peak_stashed))} | {r.executor_idle[0]:.4f} "
                 f"| {r.executor_idle[1]:.4f} |")
  return "\n".join(lines)


def parse_sizes(text: str) -> tuple[tuple[int, int], ...]:
  """'4x8,8x16' -> ((4, 8), (8, 16))."""
  try:
    sizes = tuple(tuple(int(n) for n in item.split("x")) for item in text.split(","))
  except ValueError:
    sizes = ()
  if not sizes or any(len(size) != 2 or min(size) < 1 for size in sizes):
    raise argparse.ArgumentTypeError(f"--sizes takes SxM pairs of positive integers, e.g. 4x8,8x16; got {text!r}")
  return sizes


def parse_chunks(text: str) -> tuple[int, ...]:
  """'2,4' -> (2, 4); '' -> () (no interleaved rows)."""
  items = [item for item in text.split(",") if item]
  if not all(item.isdigit() and int(item) >= 1 for item in items):
    raise argparse.ArgumentTypeError(f"--chunks takes positive integers V, e.g. 2,4 (or nothing); got {text!r}")
  return tuple(int(item) for item in items)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", type=parse_sizes, default=DEFAULT_SIZES, help="SxM pairs, e.g. 4x8,4x16,8x16")
  parser.add_argument("--chunks", type=parse_chunks, default=DEFAULT_CHUNKS,
                      help="the V of interleaved:V rows, e.g. 2,4 ('' for none)")
  args = parser.parse_args(argv)
  every = [*(schedules.parse(name) for name in schedules.SCHEDULES), *(schedules.Interleaved(v) for v in args.chunks)]
  overlapped = [(schedule.with_overlapped_sends(), S, M) for schedule in every for S, M in args.sizes if M >= 2 * S]
  try:
    print(markdown([row(schedule, S, M) for schedule in every for S, M in args.sizes]
                   + [row(schedule, S, M) for schedule, S, M in overlapped]))
  except ValueError as e:
    parser.error(str(e))


if __name__ == "__main__":
  main()
