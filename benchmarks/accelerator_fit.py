"""Which paper run fits which accelerator: every cell compiled for its target (`--compile-for`), nothing run.

    python -m benchmarks.accelerator_fit                         # the whole table (hours on 2 CPU cores)
    python -m benchmarks.accelerator_fit --models small --methods baseline --columns v5e-1

Rows: ResNet18 (CIFAR-10, batch 100) and GPT-2 small / medium / large / xl (the paper recipe: batch 8 x 1024
tokens, 4 stages) x baseline, top10-reuse (`topk:0.1` + `reuse`) and aqsgd-fw2-bw4 (its per-example tables
at the training set's size: CIFAR-10's 50,000 images; WikiText-2's, assumed ~2,343 blocks of 1,024 tokens).
Columns: one chip running simulate (v5e-1, v6e-1: Colab), a v5e-8 slice as GPipe 4 stages x 2 data and
8 stages x 1 (Kaggle), and GPU targets where the CUDA plugin is installed. Each cell compiles the train step
(`dryrun.compile_for`) and reports: compiled?, peak GiB per device / HBM, the estimated step time (from the
chip's published peaks: an estimate), and whether the target's compiled collectives send exactly the bytes the
boundaries count. Results are kept in --cache as they finish (a rerun skips done cells; cells compile one at a
time, minutes each for GPT-2 on 2 CPU cores); the markdown table goes to stdout and --out (`--table-only`: from the
cache alone, `-` for cells not compiled). Each cell compiles in a child process whose resident memory is
watched: one past --host-limit-gb (GPT-2 compiles take 2-18 GB of host RAM) is stopped and its cell marked,
and the table goes on.
"""
import argparse
import json
import pathlib
import subprocess
import sys
import time

from experiments import config, gpt2_wikitext, resnet_cifar10
from jaxcomp.analysis import dryrun, targets

MODELS = {  # name -> (experiment, its settings: the paper recipe)
    "resnet18": (resnet_cifar10.EXPERIMENT, {}),
    **{size: (gpt2_wikitext.EXPERIMENT, dict(model=size)) for size in ("small", "medium", "large", "xl")},
}
METHODS = {"baseline": dict(fwd="none", bwd="none"), "top10-reuse": dict(fwd="topk:0.1", bwd="reuse"),
           "aqsgd-fw2-bw4": dict(fwd="aqsgd+maxabs:2:stoch", bwd="maxabs:4:stoch", warmup_epochs=1)}
COLUMNS = {  # name -> (target, executor settings)
    "v5e-1": ("v5e-1", {}), "v6e-1": ("v6e-1", {}),
    "v5e-8 gpipe 4x2": ("v5e-8", dict(executor="sharded", stages=4, data_parallel=2)),
    "v5e-8 gpipe 8x1": ("v5e-8", dict(executor="sharded", stages=8)),
    "h100": ("h100", {}), "a100": ("a100", {}),
    "h100-8 gpipe 4x2": ("h100-8", dict(executor="sharded", stages=4, data_parallel=2)),
}


def cell(model: str, method: str, column: str) -> dict:
  """One compile: what the table shows, or why there is nothing to show."""
  exp, settings = MODELS[model]
  target, placement = COLUMNS[column]
  run = config.resolve(exp, "paper", **settings, **METHODS[method], **placement, compile_for=target, run_name="fit")
  pipe, optimizer, batch, _ = exp.abstract(run)
  chips = targets.target(target)
  start = time.perf_counter()
  try:
    targets.prepare_host(chips)
    executor = config.executor_for(run.executor, targets.compile_only_devices(chips), run.training.batch_size)
    report = dryrun.compile_for(chips, executor, pipe, optimizer, batch, steps=("train",))
  except RuntimeError as err:  # a compiler plugin that is not installed
    return {"status": "not compiled", "why": str(err).split(" (")[0]}
  except ValueError as err:  # a layout the model does not have (e.g. more stages than it has cuts)
    return {"status": "n/a", "why": str(err)}
  seconds = time.perf_counter() - start
  chip = report.target.chip
  out = {"status": "fits" if report.fits else "does not fit", "peak_gib": report.peak_bytes / 2**30,
         "hbm_gib": chip.hbm_bytes / 2**30, "compile_s": seconds, "error": report.error}
  if report.steps:
    step = report.steps[0]
    out["est_ms"] = 1e3 * step.estimated_s(chip)
    out["bound"] = "compute" if step.compute_s(chip) >= step.memory_s(chip) else "memory"
    if report.compared:
      out["hlo_equal"] = all(step.collectives[k] == report.counted[k] for k in ("fwd", "bwd"))
  return out


def resident_bytes(pid: int) -> int:
  """VmRSS of a live process (Linux /proc); 0 once it has gone."""
  try:
    status = pathlib.Path(f"/proc/{pid}/status").read_text()
  except OSError:
    return 0
  kib = [line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")]
  return int(kib[0]) * 1024 if kib else 0


def cell_in_child(key: str, host_limit_bytes: int) -> dict:
  """`cell` in a child process, stopped (and said so) when its resident memory passes the limit."""
  child = subprocess.Popen([sys.executable, "-m", "benchmarks.accelerator_fit", "--cell", key],
                           stdout=subprocess.PIPE, text=True)
  peak = 0
  while child.poll() is None:
    peak = max(peak, resident_bytes(child.pid))
    if peak > host_limit_bytes:
      child.kill()
      child.wait()
      return {"status": "host memory", "why": f"the compile passed {host_limit_bytes / 1e9:g} GB of host RAM"}
    time.sleep(0.5)
  lines = child.stdout.read().splitlines()
  if child.returncode != 0 or not lines:
    return {"status": "failed", "why": f"the compile's process exited {child.returncode}"}
  return {**json.loads(lines[-1]), "host_gb": peak / 1e9}


NOT_COMPILED = {  # status of a cell with no compiler figures -> its text in the table
    "not compiled": lambda r: "not compiled (plugin missing)", "n/a": lambda r: "n/a",
    "host memory": lambda r: f"not compiled ({r['why'].removeprefix('the ')})", "failed": lambda r: "compile failed"}


def render(results: dict, models, methods, columns) -> str:
  lines = ["| model | method | " + " | ".join(columns) + " |", "|---|---|" + "---|" * len(columns)]
  for model in models:
    for method in methods:
      cells = []
      for column in columns:
        r = results.get(f"{model}|{method}|{column}")
        if r is None:
          cells.append("-")  # not compiled (yet): the table is rendered from what --cache holds
        elif r["status"] in NOT_COMPILED:
          cells.append(NOT_COMPILED[r["status"]](r))
        else:
          text = f"{'fits' if r['status'] == 'fits' else '**no**'} {r['peak_gib']:.1f}/{r['hbm_gib']:.0f} GiB"
          if "est_ms" in r:
            text += f", ~{r['est_ms']:.0f} ms ({r['bound'][0]})"
          if "hlo_equal" in r:
            text += ", HLO bytes " + ("=" if r["hlo_equal"] else "!=")
          cells.append(text)
      lines.append(f"| {model} | {method} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default=",".join(MODELS))
  parser.add_argument("--methods", default=",".join(METHODS))
  parser.add_argument("--columns", default=",".join(COLUMNS))
  parser.add_argument("--cache", type=pathlib.Path, default=pathlib.Path("runs/accelerator_fit.json"))
  parser.add_argument("--out", type=pathlib.Path, help="also write the markdown table here")
  parser.add_argument("--table-only", action="store_true",
                      help="compile nothing: the table of the cells --cache holds (- for the others)")
  parser.add_argument("--host-limit-gb", type=float, default=16.0,
                      help="stop a cell's compile past this much resident host memory (default 16)")
  parser.add_argument("--cell", help=argparse.SUPPRESS)  # model|method|column: the child's one compile
  args = parser.parse_args(argv)
  if args.cell:
    print(json.dumps(cell(*args.cell.split("|"))))
    return
  models, methods, columns = (a.split(",") for a in (args.models, args.methods, args.columns))
  for names, table in ((models, MODELS), (methods, METHODS), (columns, COLUMNS)):
    unknown = [n for n in names if n not in table]
    if unknown:
      raise SystemExit(f"error: unknown {unknown}; choose from {', '.join(table)}")
  results = json.loads(args.cache.read_text()) if args.cache.is_file() else {}
  for model in models:
    for method in methods:
      for column in columns:
        key = f"{model}|{method}|{column}"
        if args.table_only or (key in results and results[key]["status"] not in ("not compiled", "failed")):
          continue
        results[key] = cell_in_child(key, int(args.host_limit_gb * 1e9))
        print(key, json.dumps(results[key]), flush=True)
        args.cache.parent.mkdir(parents=True, exist_ok=True)
        args.cache.write_text(json.dumps(results, indent=1))
  table = render(results, models, methods, columns)
  print(table)
  if args.out:
    args.out.write_text(table + "\n")


if __name__ == "__main__":
  main()
