"""The real-link benchmark's command: the network built, each method run on it, one table of steps/s and bytes
(measured, counted, netsim's), or the link checked, or earlier runs' rows merged (`benchmarks.real_link`)."""
import argparse
import json
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile

from benchmarks.real_link import __doc__ as package_doc
from benchmarks.real_link.accounting import Accounting, counted_bytes, netsim_steps_per_s
from benchmarks.real_link.network import Network, check_link, missing_prerequisites, render_check
from benchmarks.real_link.processes import TINY_SIZES, Run, method_flags, run_method, sizes_of
from experiments import config, gpt2_wikitext
from jaxcomp.analysis.link import Link
from jaxcomp.parallel import schedules

METHODS = ("fp32", "aqsgd-fw2-bw4", "direct-fw2-bw4", "top10-q8-reuse", "tile64-fw3-bw4", "proj16-fw3-bw4")


def rows_of(run: Run, acc: Accounting, args) -> list[dict]:
  """The JSON rows of one method: its last epoch, and its warm-up epoch when it has one."""
  rows = []
  epochs = [0, len(run.history) - 1] if run.history[0]["mode"] == "warmup" and len(run.history) > 1 else [-1]
  median = lambda values: sorted(values)[len(values) // 2]
  for e in epochs:
    record, e = run.history[e], e % len(run.history)
    netsim = [netsim_steps_per_s(r["times"], record, acc.epochs[e]["step"], run.config, Link.parse(args.link))
              for r in run.rounds]
    replayed = [r["replayed_steps_per_s"].get(str(e)) for r in run.rounds]
    rows.append({"method": run.name + (" (warm-up)" if record["mode"] == "warmup" else ""), "link": args.link,
                 "stages": args.stages, "recipe": run.config["recipe"], "steps_per_s": record["steps_per_s"],
                 "x_fp32": None,
                 "link_bytes_per_step": acc.epochs[e]["step"], "counted_bytes_per_step": counted_bytes(record),
                 "other_link_bytes_per_epoch": acc.other_per_epoch,
                 "netsim_steps_per_s": median(netsim) if netsim else None,
                 "replayed_steps_per_s": median(replayed) if replayed and None not in replayed else None})
  return rows


def link_of(row: dict) -> str:
  """A row's link (rows written before links had a latency name their rate)."""
  return row.get("link") or row["rate"]


def setting_of(row: dict) -> tuple:
  """What a row's fp32 baseline shares with it: its link, stages and recipe (rows written before `--recipe` ran the
  tiny one)."""
  return link_of(row), row["stages"], row.get("recipe", "tiny")


def with_x_fp32(rows: list[dict]) -> list[dict]:
  """The rows with x_fp32: steps/s over the fp32 row's of the same link, stages and recipe (None without one)."""
  base = {setting_of(r): r["steps_per_s"] for r in rows if r["method"] == "fp32"}
  return [{**r, "x_fp32": r["steps_per_s"] / base[setting_of(r)] if setting_of(r) in base else None} for r in rows]


def render(rows: list[dict], details: dict[str, Accounting]) -> str:
  """The rows as a markdown table; with `details` ({method: (Run, Accounting)}) also what the links carried
  besides train steps and the probes' bytes."""
  lines = ["| link | stages | recipe | method | steps/s | x fp32 | replayed steps/s | netsim steps/s "
           "| netsim / replayed | link B/step | counted B/step | link / counted | other link B/epoch |",
           "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  number = lambda v, spec: "" if v is None else format(v, spec)
  for r in rows:
    netsim, replayed = r["netsim_steps_per_s"], r.get("replayed_steps_per_s")
    lines.append(f"| {link_of(r)} | {r['stages']} | {setting_of(r)[2]} | {r['method']} | {r['steps_per_s']:.3f} "
                 f"| {number(r['x_fp32'], '.2f')} | {number(replayed, '.3f')} | {number(netsim, '.3f')} "
                 f"| {'' if None in (netsim, replayed) else format(netsim / replayed, '.2f')} "
                 f"| {r['link_bytes_per_step']:,.0f} | {r['counted_bytes_per_step']:,} "
                 f"| {r['link_bytes_per_step'] / r['counted_bytes_per_step']:.3f} | {r['other_link_bytes_per_epoch']:,.0f} |")
  if not details:
    return "\n".join(lines)
  lines += ["", "Bytes on the links that are not train steps (all processes; per epoch: epoch 1, epoch 2, ...):", "",
            "| method | start-up | first step - steady step | eval, compression on | eval, compression off "
            "| checkpoint | results, next epoch's start | exit |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
  for name, (_, acc) in details.items():
    per = lambda value: ", ".join(f"{value(ep):,.0f}" for ep in acc.epochs)
    item = lambda key: per(lambda ep: ep[key])
    lines.append(f"| {name} | {acc.startup:,.0f} | {per(lambda ep: ep['first_step'] - ep['step'])} | {item('eval_on')} "
                 f"| {item('eval_off')} | {item('checkpoint')} | {item('results')} | {acc.exit:,.0f} |")
  probed = {name: run.probe for name, (run, _) in details.items() if run.probe}
  if probed:
    lines += ["", "Link bytes per call of what a step does besides its messages, each measured alone after the run "
              "(all processes):", "", "| method | " + " | ".join(next(iter(probed.values()))) + " |",
              "|---|" + "---:|" * len(next(iter(probed.values())))]
    lines += [f"| {name} | " + " | ".join(f"{v * 1e3:.2f} ms" if k.endswith("s per call") else f"{v:,.0f}"
                                          for k, v in probe.items()) + " |" for name, probe in probed.items()]
  traced = {name: run.trace for name, (run, _) in details.items() if all(run.trace)}
  if traced:
    lines += ["", "The collectives of the last traced step, per process (XLA:CPU's profiler: each from its start to "
              "its end, ms from the step's start; the waits in them are the link's):", ""]
    for name, trace in traced.items():
      begin = min(steps[-1]["begin"] for steps in trace)
      for i, steps in enumerate(trace):
        spans = [f"{op} {1e3 * (start - begin):.0f}-{1e3 * (end - begin):.0f}" for op, start, end in steps[-1]["thunks"]
                 if not op.startswith("conditional")]
        lines.append(f"- {name}, process {i} (step {1e3 * (steps[-1]['end'] - steps[-1]['begin']):.0f} ms): "
                     + ", ".join(spans))
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m benchmarks.real_link", description=package_doc.splitlines()[0])
  parser.add_argument("--link", "--rate", dest="link", default="100mbit",
                      help="each link direction's rate as tc writes it (10mbit, 1gbit, or unshaped) and its one-way "
                      "latency (100mbit:20ms; none: 0); --rate is the older name")
  parser.add_argument("--check-link", action="store_true", help="run no training: build the network of --stages "
                      "processes and measure the link between stages 0 and 1 (ping round trips, idle and with every "
                      "core loaded; TCP goodput each way, both at once, loaded)")
  parser.add_argument("--stages", type=int, default=2)
  parser.add_argument("--data-parallel", type=int, default=1)
  parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated method names, fp32 first "
                      "(jaxcomp.methods or GPT-2 presets)")
  parser.add_argument("--recipe", default="tiny", help="the recipe of experiments.gpt2_wikitext the stage "
                      "processes run (model, optimizer, schedule, sizes), e.g. protocol-cpu (default: tiny, at the "
                      "sizes below)")
  for key, default in TINY_SIZES.items():
    parser.add_argument("--" + key.replace("_", "-"), type=int, help=("the fixed budget: epochs of every method "
                        if key == "epochs" else "") + f"(default: {default} with the tiny recipe, else the recipe's)")
  parser.add_argument("--overlap", action="store_true", help="the stage processes run the executor's overlapped "
                      "sends (each message crosses its link while both ends compute the next tick; --microbatches "
                      ">= 2 x --stages)")
  parser.add_argument("--repeats", type=int, default=5, help="timed runs per op (netsim's stage and codec times); "
                      "0: no op timing (no netsim column), no replay and no probe")
  parser.add_argument("--rounds", type=int, default=3, help="rounds of replayed train steps and op timing "
                      "(netsim's inputs and the steps/s beside them, medians over the rounds)")
  parser.add_argument("--json", help="write the rows here (after each method: an interrupted run keeps its finished "
                      "methods' rows)")
  parser.add_argument("--merge", nargs="+", metavar="JSON", help="run nothing: the rows of these --json files (e.g. "
                      "one method per run) as one table, x fp32 from the fp32 row of each rate and stage count")
  parser.add_argument("--keep", help="keep each method's logs, marks and results in this folder")
  args = parser.parse_args(argv)
  if args.merge:
    rows = with_x_fp32([r for f in args.merge for r in json.loads(pathlib.Path(f).read_text())["rows"]])
    print(render(rows, {}))
    if args.json:
      pathlib.Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))
    return
  methods = [m.strip() for m in args.methods.split(",") if m.strip()]
  try:
    link = Link.parse(args.link)
    if "fp32" in methods[1:]:
      raise ValueError(f"--methods: fp32, the baseline of x fp32, goes first, got {args.methods!r}")
    for m in methods:
      method_flags(m)
    if args.recipe not in gpt2_wikitext.RECIPES:
      raise ValueError(f"--recipe: unknown recipe {args.recipe!r}; choose from {', '.join(gpt2_wikitext.RECIPES)}")
    if args.stages < 2 or args.data_parallel < 1 or sizes_of(args).get("epochs", 1) < 1:
      raise ValueError(f"--stages must be >= 2, --data-parallel and --epochs >= 1 (got {args.stages}, "
                       f"{args.data_parallel}, {args.epochs})")
    if args.overlap:  # the table needs M >= 2S: refused here rather than in every stage process
      layout = config.resolve(gpt2_wikitext.EXPERIMENT, args.recipe, **sizes_of(args)).executor
      schedules.parse(layout.schedule, overlap=True).train_table(args.stages, layout.microbatches)
  except ValueError as err:
    sys.exit(f"error: {err}")
  missing = missing_prerequisites(latency=link.latency_s > 0)
  if missing:
    sys.exit(f"error: the real-link benchmark needs {missing}")

  def stop(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")
  for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGINT too: a background job inherits it ignored
    signal.signal(sig, stop)
  if args.check_link:
    try:
      with Network(args.stages * args.data_parallel, link) as net:
        checked = check_link(net)
    except (RuntimeError, subprocess.SubprocessError) as err:
      sys.exit("error: " + str(err))
    print(render_check(link, checked, net.delay_report))
    if args.json:
      pathlib.Path(args.json).write_text(json.dumps({"link": str(link), **checked, "delay_line": net.delay_report}))
    return
  args.link = str(link)
  folder = pathlib.Path(args.keep) if args.keep else pathlib.Path(tempfile.mkdtemp(prefix="real_link"))
  rows, details = [], {}

  def save(delay_report=""):
    """--json: the rows so far (after each method, so that an interrupted run keeps its finished methods' rows)."""
    if args.json:
      pathlib.Path(args.json).write_text(json.dumps({"rows": with_x_fp32(rows), "delay_line": delay_report},
                                                    indent=1))
  try:
    with Network(args.stages * args.data_parallel, link) as net:
      for name in methods:
        run = run_method(net, name, args, folder / name)
        acc = Accounting(run)
        rows += rows_of(run, acc, args)
        details[name] = (run, acc)
        save()
        print(f"{name}: {run.wall_s:.0f} s", file=sys.stderr)
  except RuntimeError as err:
    sys.exit("error: " + str(err))
  finally:
    if not args.keep:
      shutil.rmtree(folder, ignore_errors=True)
  print(render(with_x_fp32(rows), details))
  if net.delay_report:
    print("\n" + net.delay_report)
  save(net.delay_report)

