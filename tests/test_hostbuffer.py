"""AQ-SGD buffers on the host give bit-identical training to the on-device table; the CLI's --aqsgd-buffers."""
import json
import re

import jax
import numpy as np
import optax
import pytest

import jaxcomp
from experiments import gpt2_wikitext
from experiments.cli import main
from jaxcomp.compress.boundary import Mode
from jaxcomp.models.mlp import mlp_stages
from jaxcomp.parallel import hostbuffer, memory, simulate

N, B = 24, 8
X = np.random.default_rng(0).normal(size=(N, 6)).astype(np.float32)
LABELS = (X[:, 0] > 0).astype(np.int32)
# consecutive compressed batches share examples (16..19, then 20, 21): the prefetch reads their rows
# before the step before writes them (the read-after-write hazard)
ID_SEQUENCE = [np.arange(0, 8), np.arange(8, 16), np.r_[16:24], np.r_[5:8, 16:20, 0], np.r_[20:24, 16:20],
               np.r_[20:22, 8:14]]
MODES = [Mode.WARMUP] * 3 + [Mode.TRAIN] * 3
OPT = optax.sgd(0.1)


def _pipe(num_examples):
  return jaxcomp.Pipeline(mlp_stages(8, 2, 3), jaxcomp.parse_boundary("aqsgd+maxabs:2:stoch", "quant:4",
                                                                      num_examples=num_examples),
                          jaxcomp.losses.classification, "x", microbatches=2)


def _batch(ids):
  return {"x": X[ids], "label": LABELS[ids], "id": ids.astype(np.int32)}


def _on_device():
  pipe = _pipe(N)
  state = simulate.init_state(pipe, OPT, jax.random.key(0), _batch(ID_SEQUENCE[0]))
  steps = {m: simulate.make_train_step(pipe, OPT, m) for m in set(MODES)}
  for ids, mode in zip(ID_SEQUENCE, MODES):
    state, _ = steps[mode](state, _batch(ids))
  return state


# prefetch + memmap by default; the other two ways with -m slow
@pytest.mark.parametrize("prefetch, memmap", [pytest.param(True, False, marks=pytest.mark.slow),
                                              pytest.param(False, False, marks=pytest.mark.slow), (True, True)])
def test_host_buffers_are_bit_identical_to_device_tables(tmp_path, prefetch, memmap):
  expected = _on_device()
  pipe = _pipe(B)
  state = simulate.init_state(pipe, OPT, jax.random.key(0), _batch(ID_SEQUENCE[0]))
  tables = hostbuffer.HostTables(N, [(8,), (8,)], directory=tmp_path if memmap else None)
  assert "2 boundaries x 24 examples x (8,) float16 = 7.15e-07 GiB" in tables.summary
  wrapped = {m: hostbuffer.HostBufferedStep(simulate.make_train_step(pipe, OPT, m), tables, prefetch)
             for m in set(MODES)}
  for t, (ids, mode) in enumerate(zip(ID_SEQUENCE, MODES)):
    next_ids = ID_SEQUENCE[t + 1] if t + 1 < len(ID_SEQUENCE) and MODES[t + 1] == mode else None
    state, _ = wrapped[mode](state, _batch(ids), next_ids)
  for step in wrapped.values():
    step.close()
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), state.params,
               expected.params)
  for b, link in enumerate(expected.links):
    np.testing.assert_array_equal(tables.tables[b], np.asarray(link.fwd_send.buffer))
    np.testing.assert_array_equal(np.asarray(link.fwd_send.buffer), np.asarray(link.fwd_recv.buffer))
  if memmap:
    np.testing.assert_array_equal(np.load(tmp_path / "boundary0.npy", mmap_mode="r"), tables.tables[0])
  assert float(np.abs(tables.tables[0]).max()) > 0


def test_memory_estimate_and_clear_error(tmp_path):
  assert hostbuffer.memory_estimate(1000, [(1024, 768)] * 3) == 3 * 1000 * 1024 * 768 * 2
  sizes = re.escape("3 boundaries x 1000 examples x (1024, 768) float16 = 4.39 GiB (0.000931 GiB free): does not fit")
  with pytest.raises(ValueError, match="AQ-SGD tables in host memory: " + sizes):
    hostbuffer.HostTables(1000, [(1024, 768)] * 3, available=10**6)
  with pytest.raises(ValueError, match=f"AQ-SGD tables on disk at {tmp_path / 'tables'}: {sizes}"):
    hostbuffer.HostTables(1000, [(1024, 768)] * 3, directory=tmp_path / "tables", available=10**6)
  assert not (tmp_path / "tables").exists()


# tiny offline GPT-2: 16 training blocks of 32 byte tokens, batches of 4; 3 boundaries of (32, 64) activations
GPT2_AQSGD = ["--preset", "aqsgd-fw2-bw4", "--steps", "2", "--batch-size", "4", "--block-size", "32",
              "--train-examples", "16", "--eval-examples", "8", "--no-progress"]
ROWS = "3 boundaries x 16 examples x (32, 64) float16"


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_cli_trains_with_host_buffers_and_prints_the_estimate(tmp_path, capsys):
  main(gpt2_wikitext.EXPERIMENT, [*GPT2_AQSGD, "--aqsgd-buffers", "host", "--out", str(tmp_path)])
  out = capsys.readouterr().out
  assert re.search(rf"^AQ-SGD tables in host memory: {re.escape(ROWS)} = 0.000183 GiB \([\d.]+ GiB free\)$", out,
                   re.MULTILINE), out
  run = json.loads((tmp_path / "results" / "aqsgd-fw2-bw4.json").read_text())
  assert run["config"]["aqsgd_buffers"] == "host"
  assert [(r["mode"], r["step"]) for r in run["history"]] == [("warmup", 2)]
  assert run["history"][-1]["eval_on"]["perplexity"] > 1


@pytest.mark.parametrize("buffers", ["device", "host", "DIR"])
def test_tables_that_do_not_fit_stop_the_run_before_anything_is_written(tmp_path, monkeypatch, capsys, buffers):
  monkeypatch.setattr(memory, "available_memory_bytes", lambda: 10**5)
  monkeypatch.setattr(hostbuffer, "free_bytes", lambda directory=None: 10**5)
  tables = tmp_path / "tables"
  where, error = {
      "device": ("device", r"AQ-SGD buffers need .* \(16 examples x 3 boundaries x 2 ends, float16\) but only"),
      "host": ("host", re.escape(f"in host memory: {ROWS} = 0.000183 GiB (9.31e-05 GiB free): does not fit")),
      "DIR": (str(tables), re.escape(f"on disk at {tables}: {ROWS} = 0.000183 GiB (9.31e-05 GiB free): does not")),
  }[buffers]
  with pytest.raises(SystemExit, match=error):
    main(gpt2_wikitext.EXPERIMENT, [*GPT2_AQSGD, "--aqsgd-buffers", where, "--out", str(tmp_path / "runs")])
  assert not (tmp_path / "runs").exists() and not tables.exists()  # no checkpoint, results or tables
  if buffers == "device":  # the estimate line comes first; memory.check_aqsgd_memory stops before allocating
    assert f"AQ-SGD tables on device (cpu): {ROWS} x 2 ends = 0.000366 GiB (9.31e-05 GiB free)" in \
        capsys.readouterr().out


@pytest.mark.parametrize("argv, match", [
    (["--preset", "top10-reuse", "--aqsgd-buffers", "host"],
     "--aqsgd-buffers host holds AQ-SGD tables, but the forward spec 'topk:0.1' keeps none"),
    (["--preset", "aqsgd-fw2-bw4", "--aqsgd-buffers", "/tmp/t", "--executor", "sharded"],
     "--aqsgd-buffers /tmp/t needs --executor simulate; the sharded executor keeps AQ-SGD tables on the stage devices"),
])
def test_cli_rejects_host_buffers_it_cannot_use(argv, match):
  with pytest.raises(SystemExit, match=re.escape(match)):
    main(gpt2_wikitext.EXPERIMENT, argv)
