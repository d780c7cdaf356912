"""AQ-SGD buffers on the host give bit-identical training to the on-device table."""
import jax
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp import hostbuffer, simulate
from jaxcomp.boundary import Mode
from jaxcomp.models.mlp import mlp_stages

N, B = 24, 8
X = np.random.default_rng(0).normal(size=(N, 6)).astype(np.float32)
LABELS = (X[:, 0] > 0).astype(np.int32)
# consecutive batches share examples (5, 6, 7 and 16..19): the prefetch hazard
ID_SEQUENCE = [np.arange(0, 8), np.arange(8, 16), np.r_[16:24], np.r_[5:8, 16:20, 0], np.r_[20:24, 1:5],
               np.r_[8:16]]
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


@pytest.mark.parametrize("prefetch, memmap", [(True, False), (False, False), (True, True)])
def test_host_buffers_are_bit_identical_to_device_tables(tmp_path, prefetch, memmap):
  expected = _on_device()
  pipe = _pipe(B)
  state = simulate.init_state(pipe, OPT, jax.random.key(0), _batch(ID_SEQUENCE[0]))
  tables = hostbuffer.HostTables(N, [(8,), (8,)], directory=tmp_path if memmap else None)
  assert "0.000 GiB" in tables.summary
  wrapped = {m: hostbuffer.HostBufferedStep(simulate.make_train_step(pipe, OPT, m), tables, prefetch)
             for m in set(MODES)}
  for t, (ids, mode) in enumerate(zip(ID_SEQUENCE, MODES)):
    next_ids = ID_SEQUENCE[t + 1] if t + 1 < len(ID_SEQUENCE) and MODES[t + 1] == mode else None
    state, _ = wrapped[mode](state, _batch(ids), next_ids)
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
  with pytest.raises(ValueError, match=r"AQ-SGD host buffers: 3 boundaries x 1000 examples .* does not fit"):
    hostbuffer.HostTables(1000, [(1024, 768)] * 3, available=10**6)
  with pytest.raises(ValueError, match="in disk at"):
    hostbuffer.HostTables(1000, [(1024, 768)] * 3, directory=tmp_path, available=10**6)
