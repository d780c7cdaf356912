"""2 OS processes x 4 CPU devices (jax.distributed on 127.0.0.1, gloo collectives) train a
4-stage x 2-data GPipe exactly as 1 process x 8 devices: 2 steps, a checkpoint, a resume in
a new `fit`, a 3rd step; losses and checkpoints bitwise equal. Process 1 is made late to the
checkpoint-folder check that process 0's checkpointer races with.

The test runs this file as its two workers (`python tests/test_multiprocess.py ...`) with a
time limit; on failure or timeout it kills those two processes only.
"""
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import subprocess_xla_flags  # noqa: I001 - tests/ is on the path (pytest, and as a script)

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
  _run_processes(tmp_path / "two", lambda coordinator, i: [sys.executable, __file__, coordinator, str(i),
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
  worker(*sys.argv[1:])
