"""2 OS processes x 4 CPU devices (jax.distributed on 127.0.0.1, gloo collectives) train a
4-stage x 2-data GPipe exactly as 1 process x 8 devices: 2 steps, a checkpoint, a resume in
a new `fit`, a 3rd step; losses and checkpoints bitwise equal. Process 1 is made late to the
checkpoint-folder check that process 0's checkpointer races with. A checkpoint of such a
state moves no state between the processes (each writes its own shards).

The tests run this file as their two workers (`python tests/test_multiprocess.py MODE ...`) with
a time limit; on failure or timeout they kill those two processes only.
"""
import json
import os
import pathlib
import socket
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from benchmarks.common import xla_flags_with_devices as subprocess_xla_flags

PROCESSES, LOCAL_DEVICES, STAGES, DATA = 2, 4, 4, 2
N = B = 16  # one step per epoch: each epoch's train loss is one step's loss
TIMEOUT_S = 240
STAGGER_S = 3


def problem():
  """(pipeline, data): a 4-stage MLP with AQ-SGD forward and EF backward, 16 examples."""
  import jaxcomp
  from jaxcomp.data import batching
  from jaxcomp.models.mlp import mlp_stages
  from jaxcomp.runtime import train

  x = np.random.default_rng(0).normal(size=(N, 6)).astype(np.float32)
  arrays = {"x": x, "label": (x[:, 0] > 0).astype(np.int32)}
  data = train.Data(lambda epoch: batching.iterate(arrays, B, 3, epoch, shards=DATA), N // B,
                    lambda: batching.iterate(arrays, B, 0, 0, shuffle=False),
                    next(batching.iterate(arrays, B, 3, 0, shards=DATA)), "toy")
  pipe = jaxcomp.Pipeline(mlp_stages(8, 2, STAGES), jaxcomp.parse_boundary("aqsgd+quant:2", "ef+quant:4", num_examples=N),
                          jaxcomp.losses.classification, "x", microbatches=2)
  return pipe, data


def run_training(checkpoint_dir) -> list[dict]:
  """Epochs 1-2 (warm-up, then AQ-SGD), checkpointed; then a resumed `fit` runs epoch 3.

  Returns the history of both parts (epoch, mode, losses, eval metrics)."""
  import jax
  import optax

  from jaxcomp.parallel import sharded
  from jaxcomp.runtime import train

  pipe, data = problem()
  history = []
  for epochs, resume in ((2, False), (3, True)):
    executor = sharded.ShardedExecutor(sharded.make_mesh(STAGES, DATA))
    cfg = train.RunConfig(epochs=epochs, warmup_epochs=1, checkpoint_dir=str(checkpoint_dir), resume=resume,
                          progress=False)
    _, part = train.fit(pipe, optax.adam(1e-2), executor, data, cfg, jax.random.key(0))
    history += part[len(history):]
  return [{k: r[k] for k in ("epoch", "mode", "train_loss", "eval_on", "eval_off")} for r in history]


def stagger_checkpoint_check(seconds=STAGGER_S):
  """Process 1 looks for the checkpoint folder `seconds` after process 0, which creates it
  meanwhile: processes that each read the file system would disagree and issue different
  collectives (the gloo abort "Received data size doesn't match expected size")."""
  from jaxcomp.runtime import train
  check = train.saved_epochs
  def late(checkpoint_dir):
    time.sleep(seconds)
    return check(checkpoint_dir)
  train.saved_epochs = late


def worker(coordinator, process_id, out_dir):
  from jaxcomp.runtime import distributed
  assert distributed.initialize(coordinator, PROCESSES, int(process_id)) == PROCESSES
  if process_id == "1":
    stagger_checkpoint_check()
  import jax
  assert len(jax.devices()) == PROCESSES * LOCAL_DEVICES and len(jax.local_devices()) == LOCAL_DEVICES
  history = run_training(pathlib.Path(out_dir) / "ckpt")
  (pathlib.Path(out_dir) / f"history{process_id}.json").write_text(json.dumps(history))


def tcp_bytes_sent() -> int:
  """Bytes the peers of this process's TCP sockets have acknowledged (`tcp_info.tcpi_bytes_acked`, Linux):
  everything it has sent to other processes (gloo's collectives, the jax.distributed service)."""
  total = 0
  for fd in os.listdir("/proc/self/fd"):
    try:
      if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
        continue
      sock = socket.socket(fileno=os.dup(int(fd)))
    except OSError:
      continue
    with sock:
      if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
        total += struct.unpack_from("Q", sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232), 120)[0]
  return total


def save_worker(coordinator, process_id, out_dir):
  """Saves the sharded state of a wide 4 x 2 GPipe (AQ-SGD tables) and records the bytes this process
  sent while saving and the bytes of state its devices hold; the checkpoint restores to the state."""
  import chex
  import jax
  import jaxcomp
  import optax

  from jaxcomp.models.mlp import mlp_stages
  from jaxcomp.parallel import sharded
  from jaxcomp.runtime import checkpoint, distributed
  distributed.initialize(coordinator, PROCESSES, int(process_id))
  x = np.random.default_rng(0).normal(size=(B, 256)).astype(np.float32)
  batch = {"x": x, "label": (x[:, 0] > 0).astype(np.int32), "id": np.arange(B)}
  pipe = jaxcomp.Pipeline(mlp_stages(256, 2, STAGES), jaxcomp.parse_boundary("aqsgd+quant:2", "ef+quant:4",
                                                                             num_examples=512),
                          jaxcomp.losses.classification, "x", microbatches=2)
  opt, ex = optax.adam(1e-2), sharded.ShardedExecutor(sharded.make_mesh(STAGES, DATA))
  state = jax.block_until_ready(ex.init_state(pipe, opt, jax.random.key(0), batch))
  ckpt = checkpoint.Checkpointer(pathlib.Path(out_dir) / "ckpt")
  time.sleep(1)  # what start-up sent is acknowledged
  before = tcp_bytes_sent()
  ckpt.save(1, state, {"epoch": 1, "history": []}, None, ex.rows_description(pipe, opt, batch))
  time.sleep(1)
  sent = tcp_bytes_sent() - before
  held = sum(shard.data.nbytes for a in jax.tree.leaves(state._replace(rng=jax.random.key_data(state.rng)))
             for shard in a.addressable_shards)
  like = jax.eval_shape(lambda s: ex.unstack(pipe, opt, s, batch), state)
  chex.assert_trees_all_equal(ckpt.restore(1, like)[0], checkpoint.simulate_layout(ex, pipe, opt, state, batch))
  (pathlib.Path(out_dir) / f"saved{process_id}.json").write_text(json.dumps({"sent": sent, "held": held}))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_processes(out_dir, argv):
  """Runs `argv(coordinator, i)` as process i of PROCESSES on loopback, each with LOCAL_DEVICES
  CPU devices and its output in out_dir/worker{i}.log; kills them at TIMEOUT_S; asserts all exit 0."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(pathlib.Path(__file__).parents[1]),
         "XLA_FLAGS": subprocess_xla_flags(LOCAL_DEVICES)}
  coordinator = f"127.0.0.1:{_free_port()}"
  logs = [open(out_dir / f"worker{i}.log", "w") for i in range(PROCESSES)]
  procs = [subprocess.Popen(argv(coordinator, i), env=env, stdout=logs[i], stderr=subprocess.STDOUT)
           for i in range(PROCESSES)]
  try:
    for p in procs:
      p.wait(timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired:
    pass
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
    for log in logs:
      log.close()
  report = "\n".join(f"--- worker {i} (exit {p.returncode}):\n{(out_dir / f'worker{i}.log').read_text()[-3000:]}"
                     for i, p in enumerate(procs))
  assert all(p.returncode == 0 for p in procs), report


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_two_processes_train_as_one(tmp_path):
  (tmp_path / "two").mkdir()
  _run_processes(tmp_path / "two", lambda coordinator, i: [sys.executable, __file__, "train", coordinator, str(i),
                                                          str(tmp_path / "two")])
  expected = run_training(tmp_path / "one" / "ckpt")  # this process: 8 devices
  assert [r["mode"] for r in expected] == ["warmup", "train", "train"]
  for i in range(PROCESSES):
    assert json.loads((tmp_path / "two" / f"history{i}.json").read_text()) == expected
  import jax
  import optax

  from jaxcomp.parallel import simulate
  from jaxcomp.runtime import checkpoint
  pipe, data = problem()
  like = checkpoint.to_host(simulate.init_state(pipe, optax.adam(1e-2), jax.random.key(0), data.example_batch))
  saved = [checkpoint.Checkpointer(tmp_path / run / "ckpt").restore(3, like)[0] for run in ("one", "two")]
  jax.tree.map(np.testing.assert_array_equal, *saved)  # one simulate-layout checkpoint, whatever the process count
  assert np.abs(saved[0].links[0].fwd_send.buffer).max() > 0


def test_a_checkpoint_moves_no_state_between_processes(tmp_path):
  """Each process writes the shards its devices hold: saving sends a few KB (checksums, Orbax's
  barriers) while each process holds MBs of state (gathering it, as checkpoints once did, sends them)."""
  _run_processes(tmp_path, lambda coordinator, i: [sys.executable, __file__, "save", coordinator, str(i),
                                                   str(tmp_path)])
  for i in range(PROCESSES):
    saved = json.loads((tmp_path / f"saved{i}.json").read_text())
    assert saved["held"] > 2_000_000 and saved["sent"] < 64 * 1024, saved


CLI = ["-m", "experiments.gpt2_wikitext", "--executor", "gpipe", "--stages", str(STAGES), "--data-parallel",
       str(DATA), "--fwd", "aqsgd+quant:2", "--bwd", "quant:4", "--warmup-epochs", "1", "--epochs", "2",
       "--batch-size", "8", "--train-examples", "16", "--eval-examples", "8", "--no-progress", "--run-name", "r"]


@pytest.mark.slow
def test_cli_runs_on_two_processes(tmp_path):
  """The experiment CLI with --coordinator/--num-processes/--process-id: both processes train
  (process 0 holds the run folder's lock for both), results are written once, and they match
  one process with 8 devices. Not bitwise: toy GPT-2 clips by global norm, a sum over the 4
  stages that gloo and the in-process all-reduce add up in different orders."""
  two, one = tmp_path / "two", tmp_path / "one"
  two.mkdir()
  _run_processes(two, lambda coordinator, i: [sys.executable, *CLI, "--out", str(two), "--coordinator", coordinator,
                                             "--num-processes", str(PROCESSES), "--process-id", str(i)])
  assert sorted(p.name for p in (two / "results").iterdir()) == ["r.csv", "r.json", "r.md"]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": subprocess_xla_flags(8)}
  subprocess.run([sys.executable, *CLI, "--out", str(one)], env=env, check=True, timeout=TIMEOUT_S,
                 capture_output=True)
  runs = [json.loads((run / "results" / "r.json").read_text())["history"] for run in (two, one)]
  assert [r["mode"] for r in runs[0]] == [r["mode"] for r in runs[1]] == ["warmup", "train"]
  for key in ("train_loss", "wire_bytes_fwd", "wire_bytes_bwd", "wire_bytes_data"):
    np.testing.assert_allclose([r[key] for r in runs[0]], [r[key] for r in runs[1]], rtol=1e-4, err_msg=key)


if __name__ == "__main__":
  {"train": worker, "save": save_worker}[sys.argv[1]](*sys.argv[2:])
