"""Pipeline stages as processes talking through a shaped network: steps/s and every byte on the links.

`python -m benchmarks.real_link [--rate 100mbit|unshaped] [--stages 2] [--data-parallel 1]
    [--methods fp32,direct-fw2-bw4,...] [--epochs 2] [--json PATH]`   (as root)
`python -m benchmarks.real_link --merge A.json B.json ...`   (runs of one method each, as one table)

The network. Each process gets its own network namespace, joined by a veth pair to a bridge in a
hub namespace the benchmark creates (addresses 10.77.0.i+1/24, nothing routed out of them). Each
process's egress is an htb qdisc with one class per peer (u32 filter on the destination address)
at `--rate`: every direction of every process pair is shaped on its own (full duplex), and its
class counter says how many bytes crossed it (Ethernet, IP and TCP headers and ACKs included,
each TCP segment's own, as on a wire of MTU 1500). `unshaped` keeps the classes (for their
counters) at 100gbit. Namespaces and interfaces are removed when the benchmark ends, fails or is
interrupted (SIGINT, SIGTERM, SIGHUP).

The run. For each method (a name of `experiments.frontier.METHODS`, or a GPT-2 preset), one process
per stage x data-parallel replica runs the experiment CLI (`experiments.gpt2_wikitext`, tiny
recipe) with its own multi-process flags (`--coordinator --num-processes --process-id`,
`--executor gpipe --stages S`), JAX_PLATFORMS=cpu and one CPU device per process, process i
pinned to core i mod cores (`taskset`; with more processes than cores, processes share cores).
Each process runs in its own UTS namespace with its address as host name, so that gloo (JAX's CPU
collectives) binds to the process's link. A process runs the CLI's `main` unchanged, with marks
around the driver's calls: before the first two train steps of every epoch, each evaluation and
each checkpoint it reads its htb class counters. From the marks of all processes:
- link bytes per train step: steps 2..n of the epoch (everything a step puts on the links: the
  payloads, the tied-parameter exchange, the collectives of loss, clipping and the driver's
  finiteness check, headers, ACKs), against the bytes the driver counts (`wire_bytes_*`);
- other link bytes per epoch: everything else (start-up, evaluation with compression on and off,
  checkpoint, exit) over the run, per epoch, itemised in the markdown output;
- steady-state steps/s: the CLI's own figure for the epoch (its first, compiling step excluded);
- netsim's steps/s for the same setting (`netsim_steps_per_s`), from the stage, codec and update
  times each process measures of its own stage after training (same core, the executor's own
  stage programs; processes that share a core take turns), against steps/s measured beside them
  (`replayed_steps_per_s`): after training the processes run the epoch's recorded train steps again
  (as the driver's loop does: the step, its loss read back, the finiteness check), alternating with
  the op timing for `--rounds` rounds; both are medians over the rounds. This shared machine's speed
  drifts by up to a third from one minute to the next (one stage's backward measured 0.25 s and 0.41 s
  in one run), so netsim is checked against steps timed in the same minutes as its inputs, not the
  epoch's figure from a minute before.
The rows are the last epoch's, and for a method with a dense warm-up epoch (AQ-SGD) that
epoch's too (`METHOD (warm-up)`). After the op timing each process also measures, alone, the
bytes of one `train.all_finite`, one scalar all-reduce and one second of idling.
"""
import argparse
import contextlib
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

SUBNET = "10.77.0"
INTERFACE = "veth0"
COORDINATOR_PORT = 8476
UNSHAPED_RATE = "100gbit"
RATE = re.compile(r"(?P<value>\d+(?:\.\d+)?)(?P<unit>bit|kbit|mbit|gbit)", re.IGNORECASE)
CLASS_SENT = re.compile(r"class htb 1:(\d+) .*?\n\s*Sent (\d+) bytes")
UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
WORKER_TIMEOUT_S = 1800
REPLAYED_STEPS = 4  # timed steps per round of the replay


def rate_bps(rate: str) -> float:
  """'100mbit' -> 1e8 bits/s; 'unshaped' -> inf. ValueError naming the bad value otherwise."""
  if rate == "unshaped":
    return float("inf")
  m = RATE.fullmatch(rate)
  if not m:
    raise ValueError(f"--rate {rate!r}: give bits per second as tc writes them (e.g. 10mbit, 100mbit, 1gbit) "
                     "or 'unshaped'")
  return float(m["value"]) * UNITS[m["unit"].lower()]


def address(i: int) -> str:
  return f"{SUBNET}.{i + 1}"


# ---------------------------------------------------------------------------------------------- the network
def missing_prerequisites() -> str | None:
  """What this machine lacks to build the network (None: nothing)."""
  if os.geteuid() != 0:
    return "root (network namespaces and tc need it): run as root"
  tools = [t for t in ("ip", "tc", "unshare", "taskset") if shutil.which(t) is None]
  if tools:
    return f"the command(s) {', '.join(tools)} (iproute2, util-linux)"
  return None


def _run(*cmd):
  done = subprocess.run(cmd, capture_output=True, text=True)
  if done.returncode:
    raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.stdout.strip()}")
  return done.stdout


class Network(contextlib.AbstractContextManager):
  """`processes` network namespaces on a bridge, each process's egress shaped per peer at `rate`.

  A context manager: on exit (also after an error or a signal) every namespace it made is deleted,
  which removes its interfaces and qdiscs with it."""

  def __init__(self, processes: int, rate: str):
    self.processes, self.rate = processes, rate
    self.prefix = f"jaxcomp-rl{os.getpid()}"
    self.hub = f"{self.prefix}-hub"
    self.made: list[str] = []

  def namespace(self, i: int) -> str:
    return f"{self.prefix}-{i}"

  def __enter__(self):
    try:
      self._build()
    except BaseException:
      self.close()
      raise
    return self

  def __exit__(self, *exc):
    self.close()

  def _add_namespace(self, name):
    _run("ip", "netns", "add", name)
    self.made.append(name)
    _run("ip", "-n", name, "link", "set", "lo", "up")

  def _build(self):
    self._add_namespace(self.hub)
    _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
    _run("ip", "-n", self.hub, "link", "set", "br0", "up")
    rate = UNSHAPED_RATE if self.rate == "unshaped" else self.rate
    burst = max(16 * 1024, int(min(rate_bps(rate), 1e10) / 8 / 1000))  # >= 1 ms at the rate
    for i in range(self.processes):
      ns, port = self.namespace(i), f"p{i}"
      self._add_namespace(ns)
      _run("ip", "link", "add", INTERFACE, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.hub)
      _run("ip", "-n", self.hub, "link", "set", port, "master", "br0")
      _run("ip", "-n", self.hub, "link", "set", port, "up")
      _run("ip", "-n", ns, "addr", "add", f"{address(i)}/24", "dev", INTERFACE)
      _run("ip", "-n", ns, "link", "set", INTERFACE, "up")
      tc = ("tc", "-n", ns)
      _run(*tc, "qdisc", "add", "dev", INTERFACE, "root", "handle", "1:", "htb", "default", "999")
      _run(*tc, "class", "add", "dev", INTERFACE, "parent", "1:", "classid", "1:999", "htb", "rate", UNSHAPED_RATE,
           "quantum", "1514")
      for j in range(self.processes):
        if j != i:
          _run(*tc, "class", "add", "dev", INTERFACE, "parent", "1:", "classid", f"1:{j + 1}", "htb", "rate", rate,
               "ceil", rate, "burst", str(burst), "cburst", str(burst), "quantum", "1514")
          _run(*tc, "filter", "add", "dev", INTERFACE, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match",
               "ip", "dst", f"{address(j)}/32", "flowid", f"1:{j + 1}")

  def sent(self) -> dict[tuple[int, int], int]:
    """{(i, j): bytes process i has sent to process j} from the htb class counters."""
    out = {}
    for i in range(self.processes):
      for j, sent in class_bytes(("tc", "-n", self.namespace(i))).items():
        out[i, j] = sent
    return out

  def close(self):
    for name in reversed(self.made):
      subprocess.run(["ip", "netns", "del", name], capture_output=True)
    self.made = []


def class_bytes(tc=("tc",)) -> dict[int, int]:
  """{peer j: bytes sent to it} of this namespace's htb classes (class 1:j+1), from `tc -s class show`."""
  text = _run(*tc, "-s", "class", "show", "dev", INTERFACE)
  return {int(c) - 1: int(n) for c, n in CLASS_SENT.findall(text) if c != "999"}


# ---------------------------------------------------------------------------------------------- one stage process
class Marks:
  """Bytes this process has sent to each peer (its htb class counters), read at named points of the
  run: the first two train steps of every epoch, each evaluation and checkpoint, start and end."""

  def __init__(self):
    self.events, self.epoch_steps = [], 0
    self.epoch_calls = []  # per epoch: (train step, its arguments after the state) per step, to replay them
    self.trained = None  # (pipe, optimizer, executor, batch, final state) once training ends

  def mark(self, label: str):
    self.events.append({"label": label, "t": time.time(), "sent": {str(j): n for j, n in class_bytes().items()}})

  def step(self, mode: str, step, args: tuple):
    self.epoch_steps += 1
    if self.epoch_steps == 1:
      self.epoch_calls.append([])
    self.epoch_calls[-1].append((step, args))
    if self.epoch_steps <= 2:  # an epoch's first step, and where its steady steps start
      self.mark(f"step:{mode}")

  def evaluation(self, compressed: bool):
    self.epoch_steps = 0
    self.mark("eval_on" if compressed else "eval_off")


class MarkedSteps:
  """An executor whose train steps mark before they run and whose eval steps say whether they
  compress (everything else is the executor's)."""

  def __init__(self, executor, marks: Marks):
    self.executor, self.marks = executor, marks

  def __getattr__(self, name):
    return getattr(self.executor, name)

  def make_train_step(self, pipe, optimizer, mode):
    step = self.executor.make_train_step(pipe, optimizer, mode)

    def marked(*args):
      self.marks.step(mode.value, step, args[1:])
      return step(*args)
    marked.__dict__.update(step.__dict__)  # e.g. takes_next_ids
    return marked

  def make_eval_step(self, pipe, compressed: bool):
    step = self.executor.make_eval_step(pipe, compressed)

    def tagged(*args):
      return step(*args)
    tagged.compressed = compressed
    return tagged


def instrument(marks: Marks):
  """Marks around the driver's train steps, evaluations and checkpoints (`train.fit`, `train.evaluate`,
  `Checkpointer.save`); what they run is unchanged."""
  from jaxcomp.runtime import checkpoint, train
  fit, evaluate, save = train.fit, train.evaluate, checkpoint.Checkpointer.save

  def marked_fit(pipe, optimizer, executor, data, *args, **kwargs):
    state, history = fit(pipe, optimizer, MarkedSteps(executor, marks), data, *args, **kwargs)
    marks.trained = (pipe, optimizer, executor, data.example_batch, state)
    return state, history

  def marked_evaluate(eval_step, *args, **kwargs):
    marks.evaluation(eval_step.compressed)
    return evaluate(eval_step, *args, **kwargs)

  def marked_save(self, *args, **kwargs):
    marks.mark("checkpoint")
    out = save(self, *args, **kwargs)
    marks.mark("saved")
    return out

  train.fit, train.evaluate, checkpoint.Checkpointer.save = marked_fit, marked_evaluate, marked_save


def stage_seconds(pipe, optimizer, executor, batch, state, repeats: int) -> dict:
  """Seconds per microbatch of this process's stage, on its core, with the executor's own stage programs:
  forward and backward (`StageRunner.stage_branch`, `StageRunner.stage_grads` of a fused BW: the vjp with the
  forward recomputed), the codec work of its ends of the boundaries (forward message encoded / decoded, backward
  message encoded / decoded, per boundary it touches) and its optimizer update on its rows."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from benchmarks.common import median_seconds
  from benchmarks.throughput_vs_bandwidth import Measured, codec_seconds
  from jaxcomp.compress.boundary import Mode
  from jaxcomp.parallel import padded_rows
  from jaxcomp.parallel.stage_runner import StageRunner

  (d, s), = np.argwhere(executor.mesh.devices == jax.local_devices()[0])
  lay = executor.state_layout(pipe, optimizer, batch)
  runner = StageRunner(pipe, lay.template, lay.local_batch, Mode.TRAIN, True)
  mine = lambda a: a.addressable_shards[0].data[0]  # this device's row
  params_row, ms_row, opt_row = mine(state.params), mine(state.model_state), jax.tree.map(mine, state.opt_state)
  mb = jax.tree.map(lambda a: jnp.asarray(a[: lay.microbatch[pipe.input_key].shape[0]]), batch)
  noise = lambda shape: jax.random.normal(jax.random.key(s), shape, jnp.float32)
  x_buf = padded_rows.pad(noise(runner.shapes[s - 1].shape), runner.width, runner.act_dtype) if s else jnp.zeros(
      (mb[pipe.input_key].shape[0], runner.width), runner.act_dtype)
  g_buf, rng = noise(x_buf.shape).astype(runner.act_dtype), jax.random.key(0)
  scale = jnp.asarray(1 / (pipe.microbatches * executor.data), jnp.float32)
  forward = jax.jit(runner.stage_branch(s))
  backward = jax.jit(runner.stage_grads(s, "BW"))
  update = jax.jit(lambda g, o, p: lay.optimizer.update(g, o, p, s))
  out = {"stage": int(s), "data": int(d),
         "fwd": median_seconds(forward, params_row, ms_row, x_buf, mb, rng, repeats=repeats),
         "bwd": median_seconds(backward, params_row, ms_row, x_buf, mb, rng, g_buf, scale, jnp.zeros_like(params_row),
                               repeats=repeats),
         "update": median_seconds(update, params_row, opt_row, params_row, repeats=repeats)}
  clock = Measured(repeats)
  for b, side in ((s, "sender"), (s - 1, "receiver")):  # forward sender of boundary s, receiver of s-1
    if 0 <= b < len(runner.shapes):
      (enc_f, enc_b), (dec_f, dec_b) = codec_seconds(pipe.boundary, runner.shapes[b], clock)
      out[side] = {"fwd": enc_f if side == "sender" else dec_f, "bwd": dec_b if side == "sender" else enc_b}
  return out


def replayed_steps_per_s(calls: list, state, steps: int):
  """Steps/s of `steps` recorded train steps (`Marks.epoch_calls`) run again from `state` as the driver's loop
  runs them (the step, its loss read back, `train.all_finite` on the new parameters), after one untimed
  step that every process enters together: (steps/s, the new state)."""
  from jaxcomp.runtime import train
  begin = None
  for step, args in calls[: steps + 1]:
    state, metrics = step(state, *args)
    float(metrics["loss"])
    bool(train.all_finite(state.params))
    begin = begin or time.perf_counter()
  timed = len(calls[: steps + 1]) - 1
  return (timed / (time.perf_counter() - begin) if timed else None), state


def probe_bytes(executor, state, calls: int = 50, idle_s: float = 3.0) -> dict:
  """Bytes this process sends per call of what a step does besides its messages, each alone: the driver's
  `train.all_finite` on the sharded parameters, a scalar all-reduce over the stages (a step has two: its loss
  and metrics, the clipping norm), and per second of idling (the jax.distributed service's heartbeats)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  from jaxcomp.parallel.mesh import STAGE
  from jaxcomp.runtime import train
  scalar = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, STAGE), mesh=executor.mesh, in_specs=P(STAGE),
                                 out_specs=P(), check_vma=False))
  ones = jax.device_put(jnp.ones((executor.mesh.devices.size,)), jax.sharding.NamedSharding(executor.mesh, P(STAGE)))
  out = {}
  for name, call in (("all_finite", lambda: bool(train.all_finite(state.params))),
                     ("scalar all-reduce", lambda: float(scalar(ones)[0]))):
    call()  # compiled, connected
    before = sum(class_bytes().values())
    for _ in range(calls):
      call()
    out[name] = (sum(class_bytes().values()) - before) / calls
  before = sum(class_bytes().values())
  time.sleep(idle_s)
  out["idle, per s"] = (sum(class_bytes().values()) - before) / idle_s
  return out


def worker(argv):
  """A stage process: the experiment CLI with marks (`--hostname` first: gloo binds to that address);
  with `--time-ops`, its stage's op times once training is over (processes that share a core take turns)."""
  parser = argparse.ArgumentParser(prog="python -m benchmarks.real_link --worker")
  parser.add_argument("--hostname", required=True)
  parser.add_argument("--marks", required=True)
  parser.add_argument("--time-ops", type=int, default=0, metavar="REPEATS")
  parser.add_argument("--rounds", type=int, default=3, help="rounds of replayed steps and op timing")
  parser.add_argument("--turn", type=int, default=0, help="when to time, among the processes of one core")
  parser.add_argument("--turns", type=int, default=1, help="processes per core")
  args, run_flags = parser.parse_known_args(argv)
  socket.sethostname(args.hostname)
  marks = Marks()
  marks.mark("start")
  instrument(marks)
  from experiments import cli, gpt2_wikitext
  out = {}
  try:
    cli.main(gpt2_wikitext.EXPERIMENT, [a for a in run_flags if a != "--"])
    marks.mark("end")
    if args.time_ops and marks.trained:
      from jax.experimental import multihost_utils
      pipe, optimizer, executor, batch, state = marks.trained
      calls = marks.epoch_calls
      # the last epoch's steps, and the first epoch's where its step differs (a dense warm-up)
      epochs = sorted({0, len(calls) - 1}) if calls[0][0][0] is not calls[-1][0][0] else [len(calls) - 1]
      out["rounds"] = []
      for r in range(args.rounds):
        replayed = {}
        for e in epochs:
          replayed[str(e)], state = replayed_steps_per_s(calls[e], state, REPLAYED_STEPS)
        for turn in range(args.turns):
          if turn == args.turn:
            times = stage_seconds(pipe, optimizer, executor, batch, state, repeats=args.time_ops)
          multihost_utils.sync_global_devices(f"timed {r} {turn}")
        out["rounds"].append({"replayed_steps_per_s": replayed, "times": times})
      out["probe"] = probe_bytes(executor, state)
      marks.mark("timed")
  finally:
    pathlib.Path(args.marks).write_text(json.dumps({"marks": marks.events, **out}))


# ---------------------------------------------------------------------------------------------- one method
def method_flags(name: str) -> list[str]:
  """The CLI flags of a method: a frontier method's specs, else a GPT-2 preset."""
  from experiments import frontier, gpt2_wikitext
  if name in frontier.METHODS:
    fwd, bwd, warmup, *learned = frontier.METHODS[name]
    return ["--fwd", fwd, "--bwd", bwd, "--warmup-epochs", str(warmup),
            *(["--bottleneck", learned[0]] if learned else [])]
  if name in gpt2_wikitext.PRESETS:
    return ["--preset", name]
  raise ValueError(f"--methods: unknown method {name!r}; choose from experiments.frontier.METHODS "
                   f"({', '.join(frontier.METHODS)}) or the GPT-2 presets ({', '.join(gpt2_wikitext.PRESETS)})")


class Run:
  """One method's processes on the network: their marks, the CLI's results, the htb counters' totals."""

  def __init__(self, name: str, recorded: list[dict], history: list[dict], sent: dict, wall_s: float):
    self.name, self.history, self.sent, self.wall_s = name, history, sent, wall_s
    self.marks = [r["marks"] for r in recorded]  # per process
    # per round: each process's op times of its stage, and process 0's replayed steps/s per epoch
    self.rounds = [{"times": [r["rounds"][k]["times"] for r in recorded],
                    "replayed_steps_per_s": recorded[0]["rounds"][k]["replayed_steps_per_s"]}
                   for k in range(len(recorded[0].get("rounds", [])))]
    self.probe = {k: sum(r["probe"][k] for r in recorded) for k in recorded[0].get("probe", {})}  # all processes


def run_method(net: Network, name: str, args, folder: pathlib.Path) -> Run:
  """Runs `name` on every process of `net` (the CLI's multi-process flags), waits for all (killing only
  them when one fails or the time runs out) and collects what they recorded."""
  folder.mkdir(parents=True)
  processes = net.processes
  cores = len(os.sched_getaffinity(0))
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
         "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[1])}
  cli = ["--executor", "gpipe", "--stages", str(args.stages), "--data-parallel", str(args.data_parallel),
         "--batch-size", str(args.batch_size), "--train-examples", str(args.train_examples),
         "--eval-examples", str(args.eval_examples), "--epochs", str(args.epochs), "--microbatches",
         str(args.microbatches), "--no-progress",
         "--out", str(folder), "--run-name", "run", "--coordinator", f"{address(0)}:{COORDINATOR_PORT}",
         "--num-processes", str(processes), *method_flags(name)]
  before = net.sent()
  procs, logs = [], []
  start = time.perf_counter()
  try:
    for i in range(processes):
      logs.append(open(folder / f"process{i}.log", "w"))
      cmd = ["ip", "netns", "exec", net.namespace(i), "unshare", "--uts", "taskset", "-c", str(i % cores),
             sys.executable, "-m", "benchmarks.real_link", "--worker", "--hostname", address(i),
             "--marks", str(folder / f"marks{i}.json"), "--time-ops", str(args.repeats), "--rounds", str(args.rounds),
             "--turn", str(i // cores),
             "--turns", str(-(-processes // cores)), "--", *cli, "--process-id", str(i)]
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
  history = json.loads((folder / "results" / "run.json").read_text())["history"]
  return Run(name, recorded, history, {k: after[k] - before.get(k, 0) for k in after}, wall)


# ---------------------------------------------------------------------------------------------- what the marks say
def split_epochs(events: list[dict]) -> list[dict]:
  """One process's marks -> per epoch {"steps": [step marks], "eval_on", "eval_off", "checkpoint", "saved"}."""
  epochs = []
  for e in events:
    kind = e["label"].split(":")[0]
    if kind == "step":
      if not epochs or "eval_on" in epochs[-1]:
        epochs.append({"steps": []})
      epochs[-1]["steps"].append(e)
    elif kind in ("eval_on", "eval_off", "checkpoint", "saved"):
      epochs[-1][kind] = e
  return epochs


class Accounting:
  """Every byte the processes of one run sent (htb class counters), by what sent it."""

  def __init__(self, run: Run):
    per_process = [split_epochs(m) for m in run.marks]
    processes = range(len(per_process))
    sent = lambda pick: sum(sum(pick(i)["sent"].values()) for i in processes)
    start, last = (lambda i: run.marks[i][0]), (lambda i: run.marks[i][-1])
    end = lambda i: next(m for m in run.marks[i] if m["label"] == "end")
    self.epochs = []
    for e in range(len(per_process[0])):
      ep = lambda i, key, e=e: per_process[i][e][key]
      n = run.history[e]["epoch_batches"]
      following = (lambda i, e=e: per_process[i][e + 1]["steps"][0]) if e + 1 < len(per_process[0]) else end
      steady = lambda i: ep(i, "steps")[1] if n > 1 else ep(i, "eval_on")
      links = {(i, int(j)): (ep(i, "eval_on")["sent"][j] - steady(i)["sent"][j]) / max(n - 1, 1)
               for i in processes for j in ep(i, "eval_on")["sent"]}
      self.epochs.append({
          "steps": n, "links": links, "step": sum(links.values()) if n > 1 else float("nan"),
          "first_step": sent(steady) - sent(lambda i: ep(i, "steps")[0]),
          "eval_on": sent(lambda i: ep(i, "eval_off")) - sent(lambda i: ep(i, "eval_on")),
          "eval_off": sent(lambda i: ep(i, "checkpoint")) - sent(lambda i: ep(i, "eval_off")),
          "checkpoint": sent(lambda i: ep(i, "saved")) - sent(lambda i: ep(i, "checkpoint")),
          "results": sent(following) - sent(lambda i: ep(i, "saved")),
      })
    self.startup = sent(lambda i: per_process[i][0]["steps"][0]) - sent(start)
    self.timing = sent(last) - sent(end)  # the op timing after the run (its barriers): not the run's
    self.exit = sum(run.sent.values()) - (sent(last) - sent(start))
    self.total = sum(run.sent.values()) - self.timing
    self.step_bytes = sum(ep["steps"] * ep["step"] for ep in self.epochs)

  @property
  def other_per_epoch(self) -> float:
    """Bytes that are not train-step bytes (each epoch's steady step bytes x its steps), per epoch."""
    return (self.total - self.step_bytes) / len(self.epochs)


def netsim_steps_per_s(times: list[dict], record: dict, link_bytes: float, args) -> float:
  """netsim's steps/s for one epoch of the run: each stage's forward and backward with the codec work of its
  ends (none in a dense warm-up epoch) and its update, as the processes measured them (`times`: one round's,
  per process; replicas averaged);
  each message's counted bytes, and the tied-parameter exchange's, scaled by the epoch's link bytes / counted
  bytes (headers, ACKs, the scalar collectives); each link direction at `--rate`, no latency."""
  from jaxcomp.analysis import netsim
  stages, m, d = args.stages, args.microbatches, args.data_parallel
  dense = record["mode"] == "warmup"
  per_stage = [[t for t in times if t["stage"] == s] for s in range(stages)]
  mean = lambda s, pick: sum(pick(t) for t in per_stage[s]) / len(per_stage[s])
  codec = lambda s, side, way: 0.0 if dense else mean(s, lambda t: t.get(side, {}).get(way, 0.0))
  fwd_s = [mean(s, lambda t: t["fwd"]) + codec(s, "sender", "fwd") + codec(s, "receiver", "fwd") for s in range(stages)]
  bwd_s = [mean(s, lambda t: t["bwd"]) + codec(s, "sender", "bwd") + codec(s, "receiver", "bwd") for s in range(stages)]
  scale = link_bytes / counted_bytes(record)
  message = lambda key: scale * record[f"wire_bytes_{key}"] / (m * d * (stages - 1))
  tied = scale * record.get("wire_bytes_tied", 0) / (2 * d)  # each way, per replica
  data = scale * record.get("wire_bytes_data", 0) / (stages * d)  # per stage device
  exchange = netsim.Exchange([data + (tied if s in (0, stages - 1) else 0.0) for s in range(stages)],
                             (1 if tied else 0) + (2 * (d - 1) if data else 0))
  timeline = netsim.simulate_step(fwd_s, bwd_s, [message("fwd")] * (stages - 1), [message("bwd")] * (stages - 1), m,
                                  rate_bps(args.rate), 0.0, exchange, update_s=[mean(s, lambda t: t["update"])
                                                                               for s in range(stages)])
  return 1 / timeline.makespan


def counted_bytes(record: dict) -> int:
  """Wire bytes one train step sends by the driver's count (every `wire_bytes_*` of the epoch's record)."""
  return sum(v for k, v in record.items() if k.startswith("wire_bytes_"))


# ---------------------------------------------------------------------------------------------- the command
METHODS = ("fp32", "aqsgd-fw2-bw4", "direct-fw2-bw4", "top10-q8-reuse", "tile64-fw3-bw4", "proj16-fw3-bw4")


def rows_of(run: Run, acc: Accounting, args) -> list[dict]:
  """The JSON rows of one method: its last epoch, and its warm-up epoch when it has one."""
  rows = []
  epochs = [0, len(run.history) - 1] if run.history[0]["mode"] == "warmup" and len(run.history) > 1 else [-1]
  median = lambda values: sorted(values)[len(values) // 2]
  for e in epochs:
    record, e = run.history[e], e % len(run.history)
    netsim = [netsim_steps_per_s(r["times"], record, acc.epochs[e]["step"], args) for r in run.rounds]
    replayed = [r["replayed_steps_per_s"].get(str(e)) for r in run.rounds]
    rows.append({"method": run.name + (" (warm-up)" if record["mode"] == "warmup" else ""), "rate": args.rate,
                 "stages": args.stages, "steps_per_s": record["steps_per_s"], "x_fp32": None,
                 "link_bytes_per_step": acc.epochs[e]["step"], "counted_bytes_per_step": counted_bytes(record),
                 "other_link_bytes_per_epoch": acc.other_per_epoch,
                 "netsim_steps_per_s": median(netsim) if netsim else None,
                 "replayed_steps_per_s": median(replayed) if replayed and None not in replayed else None})
  return rows


def with_x_fp32(rows: list[dict]) -> list[dict]:
  """The rows with x_fp32: steps/s over the fp32 row's of the same rate and stages (None without one)."""
  base = {(r["rate"], r["stages"]): r["steps_per_s"] for r in rows if r["method"] == "fp32"}
  return [{**r, "x_fp32": r["steps_per_s"] / base[r["rate"], r["stages"]] if (r["rate"], r["stages"]) in base
           else None} for r in rows]


def render(rows: list[dict], details: dict[str, Accounting]) -> str:
  """The rows as a markdown table; with `details` ({method: (Run, Accounting)}) also what the links carried
  besides train steps and the probes' bytes."""
  lines = ["| link | stages | method | steps/s | x fp32 | replayed steps/s | netsim steps/s | netsim / replayed "
           "| link B/step | counted B/step | link / counted | other link B/epoch |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  number = lambda v, spec: "" if v is None else format(v, spec)
  for r in rows:
    netsim, replayed = r["netsim_steps_per_s"], r.get("replayed_steps_per_s")
    lines.append(f"| {r['rate']} | {r['stages']} | {r['method']} | {r['steps_per_s']:.3f} "
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
    lines += [f"| {name} | " + " | ".join(f"{v:,.0f}" for v in probe.values()) + " |" for name, probe in probed.items()]
  return "\n".join(lines)


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] == ["--worker"]:
    return worker(argv[1:])
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rate", default="100mbit", help="each link direction's rate as tc writes it (10mbit, 1gbit), "
                      "or unshaped")
  parser.add_argument("--stages", type=int, default=2)
  parser.add_argument("--data-parallel", type=int, default=1)
  parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated method names, fp32 first "
                      "(experiments.frontier.METHODS or GPT-2 presets)")
  parser.add_argument("--epochs", type=int, default=2, help="the fixed budget: epochs of every method")
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument("--train-examples", type=int, default=256)
  parser.add_argument("--eval-examples", type=int, default=32)
  parser.add_argument("--microbatches", type=int, default=1)
  parser.add_argument("--repeats", type=int, default=5, help="timed runs per op (netsim's stage and codec times); "
                      "0: no op timing (no netsim column), no replay and no probe")
  parser.add_argument("--rounds", type=int, default=3, help="rounds of replayed train steps and op timing "
                      "(netsim's inputs and the steps/s beside them, medians over the rounds)")
  parser.add_argument("--json", help="write the rows here")
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
    rate_bps(args.rate)
    if "fp32" in methods[1:]:
      raise ValueError(f"--methods: fp32, the baseline of x fp32, goes first, got {args.methods!r}")
    for m in methods:
      method_flags(m)
    if args.stages < 2 or args.data_parallel < 1 or args.epochs < 1:
      raise ValueError(f"--stages must be >= 2, --data-parallel and --epochs >= 1 (got {args.stages}, "
                       f"{args.data_parallel}, {args.epochs})")
  except ValueError as err:
    sys.exit(f"error: {err}")
  missing = missing_prerequisites()
  if missing:
    sys.exit(f"error: the real-link benchmark needs {missing}")

  def stop(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")
  for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGINT too: a background job inherits it ignored
    signal.signal(sig, stop)
  folder = pathlib.Path(args.keep) if args.keep else pathlib.Path(tempfile.mkdtemp(prefix="real_link"))
  rows, details = [], {}
  try:
    with Network(args.stages * args.data_parallel, args.rate) as net:
      for name in methods:
        run = run_method(net, name, args, folder / name)
        acc = Accounting(run)
        rows += rows_of(run, acc, args)
        details[name] = (run, acc)
        print(f"{name}: {run.wall_s:.0f} s", file=sys.stderr)
  except RuntimeError as err:
    sys.exit("error: " + str(err))
  finally:
    if not args.keep:
      shutil.rmtree(folder, ignore_errors=True)
  rows = with_x_fp32(rows)
  print(render(rows, details))
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
  main()
