"""One stage process: the experiment CLI unchanged, its driver's events marked by a `hooks.Hook`; after training, its
stage's op times (netsim's inputs), its recorded steps replayed and traced, and probes of what else it sends."""
import argparse
import json
import pathlib
import re
import shutil
import socket
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.profiler import ProfileData
from jax.sharding import PartitionSpec as P

from benchmarks.real_link.network import class_bytes
from experiments import cli, gpt2_wikitext
from jaxcomp.analysis.step_cost import Measured, codec_seconds, median_seconds
from jaxcomp.compress.boundary import Mode
from jaxcomp.parallel import padded_rows
from jaxcomp.parallel.mesh import STAGE
from jaxcomp.parallel.stage_runner import StageRunner
from jaxcomp.runtime import hooks, train

REPLAYED_STEPS = 4  # timed steps per round of the replay


class Marks(hooks.Hook):
  """Bytes this process has sent to each peer (its htb class counters), read at named points of the
  run: the first two train steps of every epoch, each evaluation and checkpoint, start and end; and what the
  replay needs (each epoch's train steps with their arguments, the trained run). The driver's hook (`hooks.Hook`):
  it reads counters and keeps references, and changes nothing the run computes."""

  def __init__(self):
    self.events, self.epoch_steps = [], 0
    self.epoch_calls = []  # per epoch: (train step, its arguments after the state) per step, to replay them
    self.trained = None  # (pipe, optimizer, executor, batch, final state) once training ends

  def mark(self, label: str):
    self.events.append({"label": label, "t": time.time(), "sent": {str(j): n for j, n in class_bytes().items()}})

  def before_step(self, run, mode, step, args: tuple):
    self.epoch_steps += 1
    if self.epoch_steps == 1:
      self.epoch_calls.append([])
    self.epoch_calls[-1].append((step, args))
    if self.epoch_steps <= 2:  # an epoch's first step, and where its steady steps start
      self.mark(f"step:{mode.value}")

  def before_evaluate(self, run, compressed: bool):
    self.epoch_steps = 0
    self.mark("eval_on" if compressed else "eval_off")

  def before_checkpoint(self, run):
    self.mark("checkpoint")

  def after_checkpoint(self, run):
    self.mark("saved")

  def after_fit(self, run):
    self.trained = (run.pipe, run.optimizer, run.executor, run.data.example_batch, run.state)


def stage_seconds(pipe, optimizer, executor, batch, state, repeats: int) -> dict:
  """Seconds per microbatch of this process's stage, on its core, with the executor's own stage programs:
  forward and backward (`StageRunner.stage_branch`, `StageRunner.stage_grads` of a fused BW: the vjp with the
  forward recomputed), the codec work of its ends of the boundaries (forward message encoded / decoded, backward
  message encoded / decoded, per boundary it touches) and its optimizer update on its rows."""


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

  state = replayed_steps_per_s(calls[:1], state, 0)[1]
  folder = tempfile.mkdtemp(prefix="real_link_trace")
  jax.profiler.start_trace(folder)
  started, begun = time.time(), []  # the profile's times count from its start
  for step, args in (calls[k % len(calls)] for k in range(1, steps + 1)):
    begun.append(time.time())
    state, metrics = step(state, *args)
    float(metrics["loss"])
    bool(train.all_finite(state.params))
  begun.append(time.time())
  jax.profiler.stop_trace()
  data = ProfileData.from_file(str(next(pathlib.Path(folder).rglob("*.xplane.pb"))))
  shutil.rmtree(folder, ignore_errors=True)
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
  out = {}
  try:
    cli.main(gpt2_wikitext.EXPERIMENT, [a for a in run_flags if a != "--"], hooks=[marks])
    marks.mark("end")
    if args.time_ops and marks.trained:
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

