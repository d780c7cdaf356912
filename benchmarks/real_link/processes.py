"""One method's run on the network: a process per stage x replica, each the experiment CLI with its multi-process
flags, pinned to a core; waited for (all killed when one fails or the time runs out); what they recorded."""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from benchmarks import common
from benchmarks.real_link.network import Network, address
from experiments import gpt2_wikitext
from jaxcomp import methods

COORDINATOR_PORT = 8476
WORKER_TIMEOUT_S = 1800
TINY_SIZES = dict(epochs=2, batch_size=32, train_examples=256, eval_examples=32, microbatches=1)  # with --recipe tiny


def sizes_of(args) -> dict:
  """The size flags the stage processes get: those given, and with the tiny recipe `TINY_SIZES` for the rest
  (another recipe's own sizes stand where no flag is given)."""
  given = {k: getattr(args, k) for k in TINY_SIZES if getattr(args, k) is not None}
  return {**TINY_SIZES, **given} if args.recipe == "tiny" else given




def method_flags(name: str) -> list[str]:
  """The CLI flags of a method: a frontier method's specs, else a GPT-2 preset."""
  if name in methods.METHODS:
    return methods.METHODS[name].flags()
  if name in gpt2_wikitext.PRESETS:
    return ["--preset", name]
  raise ValueError(f"--methods: unknown method {name!r}; choose from jaxcomp.methods "
                   f"({', '.join(methods.METHODS)}) or the GPT-2 presets ({', '.join(gpt2_wikitext.PRESETS)})")


class Run:
  """One method's processes on the network: their marks, the CLI's results (its configuration, as resolved from
  recipe < preset < flags, and its per-epoch history), the htb counters' totals."""

  def __init__(self, name: str, recorded: list[dict], results: dict, sent: dict, wall_s: float):
    self.name, self.sent, self.wall_s = name, sent, wall_s
    self.config, self.history = results["config"], results["history"]
    self.marks = [r["marks"] for r in recorded]  # per process
    # per round: each process's op times of its stage, and process 0's replayed steps/s per epoch
    self.rounds = [{"times": [r["rounds"][k]["times"] for r in recorded],
                    "replayed_steps_per_s": recorded[0]["rounds"][k]["replayed_steps_per_s"]}
                   for k in range(len(recorded[0].get("rounds", [])))]
    # bytes of all processes; seconds per call (the slowest process's)
    self.probe = {k: (max if k.endswith("s per call") else sum)(r["probe"][k] for r in recorded)
                  for k in recorded[0].get("probe", {})}
    self.trace = [r.get("trace", []) for r in recorded]  # per process, per traced step: its thunks


def run_method(net: Network, name: str, args, folder: pathlib.Path) -> Run:
  """Runs `name` on every process of `net` (the CLI's multi-process flags), waits for all (killing only
  them when one fails or the time runs out) and collects what they recorded."""
  folder.mkdir(parents=True)
  processes = net.processes
  cores = len(os.sched_getaffinity(0))
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": common.xla_flags_with_devices(1),
         "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[2])}
  cli = ["--recipe", args.recipe, "--executor", "sharded", "--stages", str(args.stages), "--data-parallel",
         str(args.data_parallel), *[a for k, v in sizes_of(args).items() for a in ("--" + k.replace("_", "-"), str(v))],
         "--no-progress",
         "--out", str(folder), "--run-name", "run", "--coordinator", f"{address(0)}:{COORDINATOR_PORT}",
         "--num-processes", str(processes), *(["--overlap"] if args.overlap else []), *method_flags(name)]
  before = net.sent()
  procs, logs = [], []
  start = time.perf_counter()
  try:
    for i in range(processes):
      logs.append(open(folder / f"process{i}.log", "w"))
      cmd = ["ip", "netns", "exec", net.namespace(i), "unshare", "--uts", "taskset", "-c", str(i % cores),
             sys.executable, "-m", "benchmarks.real_link", "--worker", "--hostname", address(i),
             "--marks", str(folder / f"marks{i}.json"), "--time-ops", str(args.repeats), "--rounds", str(args.rounds),
             "--turn", str(i), "--turns", str(processes), "--", *cli, "--process-id", str(i)]
      procs.append(subprocess.Popen(cmd, env=env, stdout=logs[-1], stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    while any(p.poll() is None for p in procs):
      if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
        break
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    for log in logs:
      log.close()
  wall = time.perf_counter() - start
  failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
  if failed:
    tail = (folder / f"process{failed[0][0]}.log").read_text()[-2000:]
    raise RuntimeError(f"method {name}: process(es) {failed} failed (logs in {folder}); process {failed[0][0]}:\n{tail}")
  after = net.sent()
  recorded = [json.loads((folder / f"marks{i}.json").read_text()) for i in range(processes)]
  results = json.loads((folder / "results" / "run.json").read_text())
  return Run(name, recorded, results, {k: after[k] - before.get(k, 0) for k in after}, wall)

