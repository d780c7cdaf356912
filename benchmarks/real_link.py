"""Pipeline stages as processes talking through a shaped network: steps/s and every byte on the links.

`python -m benchmarks.real_link [--link 100mbit:20ms|unshaped] [--stages 2] [--data-parallel 1]
    [--methods fp32,direct-fw2-bw4,...] [--recipe tiny|protocol-cpu|...] [--epochs 2] [--json PATH]`   (as root)
`python -m benchmarks.real_link --merge A.json B.json ...`   (runs of one method each, as one table)

The network. Each process gets its own network namespace, joined by a veth pair to a bridge in a
hub namespace the benchmark creates (addresses 10.77.0.i+1/24, nothing routed out of them). Each
process's egress is an htb qdisc with one class per peer (u32 filter on the destination address)
at `--rate`: every direction of every process pair is shaped on its own (full duplex), and its
class counter says how many bytes crossed it (Ethernet, IP and TCP headers and ACKs included,
each TCP segment's own, as on a wire of MTU 1500). `unshaped` keeps the classes (for their
counters) at 100gbit. Namespaces and interfaces are removed when the benchmark ends, fails or is
interrupted (SIGINT, SIGTERM, SIGHUP).

The run. For each method (a name of `jaxcomp.methods`, or a GPT-2 preset), one process
per stage x data-parallel replica runs the experiment CLI (`experiments.gpt2_wikitext`, `--recipe`:
tiny by default, at this benchmark's sizes `TINY_SIZES`; another recipe at its own sizes, the size flags
given overriding either) with its own multi-process flags (`--coordinator --num-processes --process-id`,
`--executor sharded --stages S`; the recipe's schedule, with `--overlap` its overlapped sends), JAX_PLATFORMS=cpu
and one CPU device per process, process i pinned to core i mod cores (`taskset`; with more processes than cores,
processes share cores).
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
  stage programs; the processes take turns, each timing alone while the others wait, as a step of one
  microbatch computes one stage at a time), against steps/s measured beside them
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
import math
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

from benchmarks import common
from jaxcomp import methods
from jaxcomp.analysis.link import Link, parse_rate

SUBNET = "10.77.0"
ROUTER_ADDRESS = f"{SUBNET}.254"  # the router's end of every stage's veth pair
INTERFACE = "veth0"
DELAY_DEVICE = "delay0"  # the router's TUN device, behind which the delay line holds packets
DELAY_TABLE = "77"  # the router's routing table that sends what arrives from a stage into the delay line
COORDINATOR_PORT = 8476
UNSHAPED_RATE = "100gbit"
CLASS_SENT = re.compile(r"class htb 1:(\d+) .*?\n\s*Sent (\d+) bytes")
WORKER_TIMEOUT_S = 1800
REPLAYED_STEPS = 4  # timed steps per round of the replay
# Each stage namespace is tuned as a WAN cluster's hosts are (ESnet's host tuning for long fat links): socket
# buffers well above the bandwidth-delay product (100 Mbit/s x 100 ms RTT = 1.25 MB), gloo's own SO_SNDBUF
# (up to 32 MB) not capped below it, no return to slow start after an idle connection (a pipeline's links idle
# between messages), and a loss-based congestion control, reno (the kernel's default, cubic, is not among those a
# namespace may pick here; bbr, the other, paced a 262 KB message 30-35 ms longer than its bytes at 100 ms RTT).
TCP_SETTINGS = {"net.core.rmem_max": "67108864", "net.core.wmem_max": "67108864",
                "net.ipv4.tcp_rmem": "4096 131072 67108864", "net.ipv4.tcp_wmem": "4096 65536 67108864",
                "net.ipv4.tcp_slow_start_after_idle": "0", "net.ipv4.tcp_congestion_control": "reno"}
DELAY_LINE_SOURCE = pathlib.Path(__file__).with_name("delay_line.c")


def address(i: int) -> str:
  return f"{SUBNET}.{i + 1}"


# ---------------------------------------------------------------------------------------------- the network
def missing_prerequisites(latency: bool = False) -> str | None:
  """What this machine lacks to build the network, with a delay line when `latency` (None: nothing)."""
  if os.geteuid() != 0:
    return "root (network namespaces and tc need it): run as root"
  tools = [t for t in ("ip", "tc", "unshare", "taskset", "sysctl", *(("gcc",) if latency else ()))
           if shutil.which(t) is None]
  if tools:
    return f"the command(s) {', '.join(tools)} (iproute2, util-linux, procps{', gcc' if latency else ''})"
  if latency and not os.path.exists("/dev/net/tun"):
    return "/dev/net/tun (the TUN driver) for the delay line"
  return None


def _run(*cmd):
  done = subprocess.run(cmd, capture_output=True, text=True)
  if done.returncode:
    raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.stdout.strip()}")
  return done.stdout


class Network(contextlib.AbstractContextManager):
  """`processes` network namespaces behind a router namespace, each process's egress shaped per peer at the
  link's rate, and, with a latency, a delay line in the router holding every packet for it.

  Stage i has address 10.77.0.i+1/32 on its end of a veth pair and reaches the others through the router
  (10.77.0.254 on every router port). With a latency the router sends every packet that arrives from a stage
  into a TUN device (policy routing: table DELAY_TABLE for each port), where the delay line (`delay_line.c`,
  compiled with gcc into a temporary folder) writes it back `latency_s` later, and the router forwards it to
  its stage: each packet crosses the delay line once, so each direction of each pair has the one-way latency
  on top of its htb rate. The stage namespaces take `TCP_SETTINGS`. A context manager: on exit (also after an
  error or a signal) the delay line is stopped (its report kept in `delay_report`) and every namespace it made
  is deleted, which removes its interfaces and qdiscs with it."""

  def __init__(self, processes: int, link: Link):
    self.processes, self.link = processes, link
    self.prefix = f"jaxcomp-rl{os.getpid()}"
    self.router = f"{self.prefix}-router"
    self.made: list[str] = []
    self.delay_line: subprocess.Popen | None = None
    self.delay_report = ""
    self.folder = None

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

  def _add_namespace(self, name, settings: dict):
    _run("ip", "netns", "add", name)
    self.made.append(name)
    _run("ip", "-n", name, "link", "set", "lo", "up")
    for key, value in settings.items():
      _run("ip", "netns", "exec", name, "sysctl", "-q", "-w", f"{key}={value}")

  def _build(self):
    self._add_namespace(self.router, {"net.ipv4.ip_forward": "1", "net.ipv4.conf.all.rp_filter": "0",
                                      "net.ipv4.conf.default.rp_filter": "0"})
    rate = UNSHAPED_RATE if math.isinf(self.link.bandwidth_bps) else self.link.rate
    burst = max(16 * 1024, int(min(parse_rate(rate), 1e10) / 8 / 1000))  # >= 1 ms at the rate
    router = ("ip", "-n", self.router)
    for i in range(self.processes):
      ns, port = self.namespace(i), f"p{i}"
      self._add_namespace(ns, TCP_SETTINGS)
      _run("ip", "link", "add", INTERFACE, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.router)
      _run(*router, "addr", "add", f"{ROUTER_ADDRESS}/32", "dev", port)
      _run(*router, "link", "set", port, "up")
      _run(*router, "route", "add", f"{address(i)}/32", "dev", port)
      _run("ip", "-n", ns, "addr", "add", f"{address(i)}/32", "dev", INTERFACE)
      _run("ip", "-n", ns, "link", "set", INTERFACE, "up")
      _run("ip", "-n", ns, "route", "add", f"{ROUTER_ADDRESS}/32", "dev", INTERFACE)
      _run("ip", "-n", ns, "route", "add", f"{SUBNET}.0/24", "via", ROUTER_ADDRESS, "dev", INTERFACE)
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
    if self.link.latency_s:
      self._start_delay_line()
      _run(*router, "link", "set", DELAY_DEVICE, "up", "txqueuelen", "10000")
      _run(*router, "route", "add", "default", "dev", DELAY_DEVICE, "table", DELAY_TABLE)
      for i in range(self.processes):
        _run(*router, "rule", "add", "iif", f"p{i}", "lookup", DELAY_TABLE, "pref", "100")

  def _start_delay_line(self):
    self.folder = pathlib.Path(tempfile.mkdtemp(prefix=f"real_link_delay{os.getpid()}_"))
    program = self.folder / "delay_line"
    _run("gcc", "-O2", "-o", str(program), str(DELAY_LINE_SOURCE))
    self.report_file = open(self.folder / "report.txt", "w")
    self.delay_line = subprocess.Popen(
        ["ip", "netns", "exec", self.router, str(program), DELAY_DEVICE, str(round(self.link.latency_s * 1e6))],
        stdout=subprocess.PIPE, stderr=self.report_file, text=True, start_new_session=True)
    if self.delay_line.stdout.readline().strip() != "ready":
      self.delay_line.wait(timeout=10)
      raise RuntimeError(f"the delay line did not start: {(self.folder / 'report.txt').read_text().strip()}")

  def sent(self) -> dict[tuple[int, int], int]:
    """{(i, j): bytes process i has sent to process j} from the htb class counters."""
    out = {}
    for i in range(self.processes):
      for j, sent in class_bytes(("tc", "-n", self.namespace(i))).items():
        out[i, j] = sent
    return out

  def close(self):
    if self.delay_line is not None:
      if self.delay_line.poll() is None:
        self.delay_line.terminate()
        try:
          self.delay_line.wait(timeout=10)
        except subprocess.TimeoutExpired:
          self.delay_line.kill()
          self.delay_line.wait()
      self.report_file.close()
      self.delay_report = (self.folder / "report.txt").read_text().strip()
      self.delay_line = None
    if self.folder is not None:
      shutil.rmtree(self.folder, ignore_errors=True)
      self.folder = None
    for name in reversed(self.made):
      subprocess.run(["ip", "netns", "del", name], capture_output=True)
    self.made = []


def class_bytes(tc=("tc",)) -> dict[int, int]:
  """{peer j: bytes sent to it} of this namespace's htb classes (class 1:j+1), from `tc -s class show`."""
  text = _run(*tc, "-s", "class", "show", "dev", INTERFACE)
  return {int(c) - 1: int(n) for c, n in CLASS_SENT.findall(text) if c != "999"}


# ---------------------------------------------------------------------------------------------- checking a link
def render_check(link: Link, checked: dict, delay_report: str) -> str:
  """`check_link`'s figures as lines: round trips (median, min, max ms) and goodput each way (Mbit/s, and its share of
  the most TCP can carry at the rate: 1448 payload bytes per 1514-byte frame)."""
  rtt_of = lambda trips: " / ".join(f"{1e3 * v:.2f}" for v in (sorted(trips)[len(trips) // 2], min(trips), max(trips)))
  rtt = lambda key: rtt_of(checked[key])
  most = link.bandwidth_bps * 1448 / 1514
  goodput = ", ".join(f"{way} {bps / 1e6:.1f} Mbit/s ({bps / most:.1%})" for way, bps in checked["goodput_bps"].items())
  goodput += "" if math.isfinite(most) else " (unshaped)"
  expected = 8 * checked["message_bytes"] * 1514 / 1448 / link.bandwidth_bps + 2 * link.latency_s
  lines = [f"link {link}: ping round trip, ms (median / min / max): idle {rtt('rtt_idle_s')}, every core loaded "
           f"{rtt('rtt_loaded_s')} (2 x {link.latency_s * 1e3:g} ms expected)",
           f"a {checked['message_bytes']:,}-byte message and a 1-byte answer, each after 0.5 s idle, ms (median / min "
           f"/ max of the last {len(checked['message_trips_s']) - 2}): {rtt_of(checked['message_trips_s'][2:])} "
           f"({1e3 * expected:.1f} expected: the bytes at the rate, with headers, and 2 latencies)",
           f"TCP goodput, both ways at once, every core loaded: {goodput} of the most TCP carries at the rate"]
  return "\n".join(lines + ([delay_report] if delay_report else []))


def check_link(net: Network, seconds: float = 5.0, pings: int = 20, message_bytes: int = 262_144,
               count: int = 12) -> dict:
  """What the link between stages 0 and 1 does: round trips (ICMP echo, idle, then while two busy processes load
  every core), `count` messages of `message_bytes` (a tiny GPT-2 activation at batch 8), each after 0.5 s idle and
  answered with a byte, and the TCP goodput of each direction with both directions sending at once under load."""
  in_ns = lambda i, *args: ["ip", "netns", "exec", net.namespace(i), sys.executable, "-m", "benchmarks.link_probe",
                            *args]
  env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[1])}
  result = lambda cmd: json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, env=env,
                                                 timeout=120).stdout)
  out = {"rtt_idle_s": result(in_ns(0, "ping", address(1), str(pings)))}
  server = subprocess.Popen(in_ns(1, "server", address(1), "5202", str(message_bytes), str(count)), env=env,
                            stdout=subprocess.DEVNULL)
  out["message_bytes"], out["message_trips_s"] = message_bytes, result(
      in_ns(0, "client", address(1), "5202", str(message_bytes), str(count)))
  server.wait(timeout=60)
  cores = sorted(os.sched_getaffinity(0))
  load = [subprocess.Popen(["taskset", "-c", str(c), sys.executable, "-c", "while True: pass"]) for c in cores]
  try:
    out["rtt_loaded_s"] = result(in_ns(0, "ping", address(1), str(pings)))
    sinks = [subprocess.Popen(in_ns(j, "sink", address(j), "5201", "0"), stdout=subprocess.PIPE, text=True, env=env)
             for j in (1, 0)]
    sources = [subprocess.Popen(in_ns(i, "source", address(j), "5201", str(seconds)), env=env,
                                stdout=subprocess.DEVNULL) for i, j in ((0, 1), (1, 0))]
    for p in sources:
      p.wait(timeout=seconds + 60)
    received = [json.loads(p.communicate(timeout=60)[0]) for p in sinks]
    out["goodput_bps"] = {"0->1": 8 * received[0]["bytes"] / received[0]["seconds"],
                          "1->0": 8 * received[1]["bytes"] / received[1]["seconds"]}
  finally:
    for p in load:
      p.kill()
      p.wait()
  return out


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
  """Marks around the driver's train steps, evaluations and checkpoints (`train.fit`, `evaluation.evaluate`,
  `Checkpointer.save`); what they run is unchanged."""
  from jaxcomp.runtime import checkpoint, evaluation, train
  fit, evaluate, save = train.fit, evaluation.evaluate, checkpoint.Checkpointer.save

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

  train.fit, evaluation.evaluate, checkpoint.Checkpointer.save = marked_fit, marked_evaluate, marked_save


def stage_seconds(pipe, optimizer, executor, batch, state, repeats: int) -> dict:
  """Seconds per microbatch of this process's stage, on its core, with the executor's own stage programs:
  forward and backward (`StageRunner.stage_branch`, `StageRunner.stage_grads` of a fused BW: the vjp with the
  forward recomputed), the codec work of its ends of the boundaries (forward message encoded / decoded, backward
  message encoded / decoded, per boundary it touches) and its optimizer update on its rows."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxcomp.analysis.step_cost import median_seconds
  from jaxcomp.analysis.step_cost import Measured, codec_seconds
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


def traced_steps(calls: list, state, steps: int = 2) -> list[dict]:
  """The XLA:CPU thunks of `steps` replayed steps (as `replayed_steps_per_s` runs them, after one untimed), from the
  profiler: per step, each collective and each conditional (a stage's op) with its start and end in seconds
  (`time.time()`'s clock, so the processes' traces line up): where the step waits on the link."""
  from jax._src.lib import _profiler
  from jax.profiler import ProfileData

  from jaxcomp.runtime import train
  state = replayed_steps_per_s(calls[:1], state, 0)[1]
  session, started, begun = _profiler.ProfilerSession(), time.time(), []  # the profile's times count from here
  for step, args in (calls[k % len(calls)] for k in range(1, steps + 1)):
    begun.append(time.time())
    state, metrics = step(state, *args)
    float(metrics["loss"])
    bool(train.all_finite(state.params))
  begun.append(time.time())
  data = ProfileData.from_serialized_xspace(session.stop())
  wanted = re.compile(r"(ppermute|psum|all-reduce|collective-permute|conditional)[.\w-]*$")
  events = sorted((started + e.start_ns / 1e9, started + (e.start_ns + e.duration_ns) / 1e9, e.name)
                  for plane in data.planes
                  for line in plane.lines if line.name.startswith("tf_XLA") for e in line.events
                  if wanted.match(e.name))
  return [{"begin": begun[k], "end": begun[k + 1],
           "thunks": [(name, start, end) for start, end, name in events if begun[k] <= start < begun[k + 1]]}
          for k in range(len(begun) - 1)]


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
    before, start = sum(class_bytes().values()), time.perf_counter()
    for _ in range(calls):
      call()
    out[f"{name}, s per call"] = (time.perf_counter() - start) / calls
    out[name] = (sum(class_bytes().values()) - before) / calls
  before = sum(class_bytes().values())
  time.sleep(idle_s)
  out["idle, per s"] = (sum(class_bytes().values()) - before) / idle_s
  return out


def worker(argv):
  """A stage process: the experiment CLI with marks (`--hostname` first: gloo binds to that address);
  with `--time-ops`, its stage's op times once training is over (the processes take turns)."""
  parser = argparse.ArgumentParser(prog="python -m benchmarks.real_link --worker")
  parser.add_argument("--hostname", required=True)
  parser.add_argument("--marks", required=True)
  parser.add_argument("--time-ops", type=int, default=0, metavar="REPEATS")
  parser.add_argument("--rounds", type=int, default=3, help="rounds of replayed steps and op timing")
  parser.add_argument("--turn", type=int, default=0, help="when to time: this process's turn")
  parser.add_argument("--turns", type=int, default=1, help="turns: the processes, one after another")
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
      out["trace"] = traced_steps(calls[-1], state)
      marks.mark("timed")
  finally:
    pathlib.Path(args.marks).write_text(json.dumps({"marks": marks.events, **out}))


# ---------------------------------------------------------------------------------------------- one method
def method_flags(name: str) -> list[str]:
  """The CLI flags of a method: a frontier method's specs, else a GPT-2 preset."""
  from experiments import gpt2_wikitext
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
         "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[1])}
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


def step_collectives(table, data: int, clips: bool) -> list:
  """The collectives over the devices that a train step of the sharded executor runs besides its boundary messages
  and the tied exchange, as its compiled programs order them (2 and 4 stages, 1 microbatch: docs/benchmarks.md):
  the loss and metrics all-reduce over the stages at the tick of the last chunk's last backward, before that
  tick's messages (then the mean over the replicas), the clipping norm's all-reduce over the stages before the
  update (when the run clips: the GPT-2 recipes do, the protocol ones do not), and after the update the driver's
  `train.all_finite` over every device: gloo's ring all-reduces of a scalar."""
  from jaxcomp.analysis import netsim
  last = max(t for t in range(table.ticks) for row in table.ops for op in row[t]
             if op.chunk == table.num_chunks - 1 and op.kind != "F")
  losses = [netsim.Collective(last)] + ([netsim.Collective(last, ranks=data)] if data > 1 else [])
  clipping = [netsim.Collective("before_update")] if clips else []
  return [*losses, *clipping, netsim.Collective("after_update", ranks=table.num_devices * data)]


def netsim_steps_per_s(times: list[dict], record: dict, link_bytes: float, config: dict, link: Link) -> float:
  """netsim's steps/s for one epoch of a run of `config` (its stages, replicas, microbatches, schedule and clipping,
  as the run resolved them), on the executor's ticks (with its overlapped sends where the run had them): each stage's
  forward and backward with the codec work of its ends (none in a dense warm-up epoch) and its update, as the
  processes measured them (`times`: one round's, per process; replicas averaged); each message's counted bytes,
  and the tied-parameter exchange's, scaled by the epoch's link bytes / counted bytes (headers, ACKs); each link
  direction at `link`'s rate and latency, with the step's collectives (`step_collectives`), under gloo's
  rendezvous protocol (`jaxcomp.analysis.wires`), and the step's exchanges (`step_exchanges`)."""
  from jaxcomp.analysis import netsim
  from jaxcomp.parallel import schedules
  stages, m, d = config["stages"], config["microbatches"], config["data_parallel"]
  dense = record["mode"] == "warmup"
  per_stage = [[t for t in times if t["stage"] == s] for s in range(stages)]
  mean = lambda s, pick: sum(pick(t) for t in per_stage[s]) / len(per_stage[s])
  codec = lambda s, side, way: 0.0 if dense else mean(s, lambda t: t.get(side, {}).get(way, 0.0))
  fwd_s = [mean(s, lambda t: t["fwd"]) + codec(s, "sender", "fwd") + codec(s, "receiver", "fwd") for s in range(stages)]
  bwd_s = [mean(s, lambda t: t["bwd"]) + codec(s, "sender", "bwd") + codec(s, "receiver", "bwd") for s in range(stages)]
  scale = link_bytes / counted_bytes(record)
  message = lambda key: scale * record[f"wire_bytes_{key}"] / (m * d * (stages - 1))
  exchange, tied = step_exchanges(record, scale, stages, d)
  table = schedules.parse(config["schedule"], config.get("overlap", False)).train_table(stages, m)
  timeline = netsim.simulate_step(fwd_s, bwd_s, [message("fwd")] * (stages - 1), [message("bwd")] * (stages - 1), m,
                                  link, exchange=exchange, tied=tied, schedule=table, ticks=True,
                                  update_s=[mean(s, lambda t: t["update"]) for s in range(stages)],
                                  collectives=step_collectives(table, d, config["grad_clip"] is not None),
                                  protocol="rendezvous")
  return 1 / timeline.makespan


def step_exchanges(record: dict, scale: float, stages: int, d: int):
  """netsim's data-parallel exchange and tied-parameter swap of one train step of a run with `stages` stages and
  `d` replicas, from its epoch's record: its counted `wire_bytes_data` (a ring of 2 (d - 1) messages, each stage
  device sending its share) and `wire_bytes_tied` (each replica's first and last stage send each other half),
  times `scale` (link bytes / counted bytes). The swap starts when both ends are ready, after the exchange (the
  executor ties after the mean), and pays two latencies: the first stage reaches it last, its own send leaves
  at once, but its receive's notice must cross before the last stage's bytes leave. (None, None): neither."""
  from jaxcomp.analysis import netsim
  data = scale * record.get("wire_bytes_data", 0) / (stages * d)  # per stage device
  tied = scale * record.get("wire_bytes_tied", 0) / (2 * d)  # each way, per replica
  exchange = netsim.Exchange([data] * stages, 2 * (d - 1)) if data else None
  return exchange, (netsim.Tied([(0, stages - 1)], [tied], messages=2) if tied else None)


def counted_bytes(record: dict) -> int:
  """Wire bytes one train step sends by the driver's count (every `wire_bytes_*` of the epoch's record)."""
  return sum(v for k, v in record.items() if k.startswith("wire_bytes_"))


# ---------------------------------------------------------------------------------------------- the command
METHODS = ("fp32", "aqsgd-fw2-bw4", "direct-fw2-bw4", "top10-q8-reuse", "tile64-fw3-bw4", "proj16-fw3-bw4")
TINY_SIZES = dict(epochs=2, batch_size=32, train_examples=256, eval_examples=32, microbatches=1)  # with --recipe tiny


def sizes_of(args) -> dict:
  """The size flags the stage processes get: those given, and with the tiny recipe `TINY_SIZES` for the rest
  (another recipe's own sizes stand where no flag is given)."""
  given = {k: getattr(args, k) for k in TINY_SIZES if getattr(args, k) is not None}
  return {**TINY_SIZES, **given} if args.recipe == "tiny" else given


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
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] == ["--worker"]:
    return worker(argv[1:])
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    from experiments import gpt2_wikitext
    if args.recipe not in gpt2_wikitext.RECIPES:
      raise ValueError(f"--recipe: unknown recipe {args.recipe!r}; choose from {', '.join(gpt2_wikitext.RECIPES)}")
    if args.stages < 2 or args.data_parallel < 1 or sizes_of(args).get("epochs", 1) < 1:
      raise ValueError(f"--stages must be >= 2, --data-parallel and --epochs >= 1 (got {args.stages}, "
                       f"{args.data_parallel}, {args.epochs})")
    if args.overlap:  # the table needs M >= 2S: refused here rather than in every stage process
      from experiments import config
      from jaxcomp.parallel import schedules
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


if __name__ == "__main__":
  main()
