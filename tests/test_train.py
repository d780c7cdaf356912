"""The training driver: bit-identical resume (device or host AQ-SGD tables), NaN stop, warm start, result files."""
import json
import threading

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from jaxcomp import pipeline
from jaxcomp.data import batching
from jaxcomp.models.mlp import mlp_stages
from jaxcomp.parallel import hostbuffer, schedules, sharded, simulate
from jaxcomp.runtime import checkpoint, results, train
from jaxcomp.runtime.checkpoint import Checkpointer
from training_cases import ARRAYS, B, N, OPT, toy_data, toy_fit, toy_pipe

def _host(tables_dir=None):
  """A new host-buffered executor (fresh zero tables, as in a new process)."""
  batch = toy_data().example_batch
  return hostbuffer.HostBuffered(hostbuffer.HostTables.for_pipeline(toy_pipe(), batch, tables_dir), len(batch["id"]))


def _assert_same_as_device(state, history, host, device_run):
  """Bitwise: history (but timing), params, optimizer, keys, backward states, host tables = device tables."""
  expected, expected_history = device_run
  untimed = lambda h: [{k: v for k, v in r.items() if k != "steps_per_s"} for r in h]
  assert untimed(history) == untimed(expected_history)
  without_tables = lambda s: (jax.random.key_data(s.rng), s.step, s.params, s.model_state, s.opt_state,
                              [(link.bwd_send, link.bwd_recv) for link in s.links])
  chex.assert_trees_all_equal(without_tables(state), without_tables(expected))
  for table, link in zip(host.tables.tables, expected.links, strict=True):
    np.testing.assert_array_equal(table, np.asarray(link.fwd_send.buffer))
  assert float(np.abs(host.tables.tables[0]).max()) > 0


@pytest.fixture(scope="module")
def device_run(tmp_path_factory):
  """An uninterrupted 2-epoch run (warm-up, then AQ-SGD) with the tables on the device."""
  return toy_fit(tmp_path_factory.mktemp("device"), 2)


def test_resumed_run_is_bit_identical(tmp_path):
  full, full_history = toy_fit(tmp_path / "a", 3)
  toy_fit(tmp_path / "b", 1)
  resumed, history = toy_fit(tmp_path / "b", 3, resume=True)
  chex.assert_trees_all_equal(jax.random.key_data(full.rng), jax.random.key_data(resumed.rng))
  chex.assert_trees_all_equal(full._replace(rng=0), resumed._replace(rng=0))
  assert [r["epoch"] for r in history] == [1, 2, 3]
  assert [r["mode"] for r in history] == ["warmup", "train", "train"]
  assert history[1]["eval_on"] == full_history[1]["eval_on"]
  assert float(np.abs(np.asarray(resumed.links[0].fwd_send.buffer)).max()) > 0  # AQ-SGD state came back


@pytest.mark.slow  # test_hostbuffer.py checks the same bit identity by default
def test_host_tables_train_bit_identical_to_device_tables(tmp_path, device_run, monkeypatch):
  calls = []  # (ids, next_ids) of every host-buffered step
  call = hostbuffer.HostBufferedStep.__call__
  monkeypatch.setattr(hostbuffer.HostBufferedStep, "__call__",
                      lambda self, state, batch, next_ids=None: calls.append((batch["id"], next_ids))
                      or call(self, state, batch, next_ids))
  host = _host()
  state, history = toy_fit(tmp_path, 2, executor=host)
  _assert_same_as_device(state, history, host, device_run)
  assert [r["mode"] for r in history] == ["warmup", "train"]
  per_epoch = N // B
  assert len(calls) == 2 * per_epoch
  for t, (_, next_ids) in enumerate(calls):  # the driver hands every step the next batch's ids, within an epoch
    if (t + 1) % per_epoch:
      np.testing.assert_array_equal(next_ids, calls[t + 1][0])
    else:
      assert next_ids is None


@pytest.mark.parametrize("memmap", [pytest.param(False, marks=pytest.mark.slow), True])
def test_resumed_host_buffered_run_is_bit_identical(tmp_path, device_run, memmap):
  """Killed after the warm-up epoch and resumed in a new process: ends as the uninterrupted run (which the
  test above shows equal to the device-table run)."""
  tables_dir = tmp_path / "tables" if memmap else None
  toy_fit(tmp_path / "ckpt", 1, executor=_host(tables_dir))
  with pytest.raises(ValueError, match="was saved with host state .*; restore it with host state too"):
    toy_fit(tmp_path / "ckpt", 2, resume=True)
  host = _host(tables_dir)
  assert not any(t.any() for t in host.tables.tables)  # the warm-up's tables can only come from the checkpoint
  state, history = toy_fit(tmp_path / "ckpt", 2, resume=True, executor=host)
  _assert_same_as_device(state, history, host, device_run)
  if memmap:
    np.testing.assert_array_equal(np.load(tables_dir / "boundary1.npy"), host.tables.tables[1])


def test_a_host_buffered_run_leaves_no_prefetch_thread(tmp_path, monkeypatch):
  """train.fit closes the steps it made when the run ends, also when it stops at a NaN: their prefetch threads
  end though the steps themselves are still referenced (here by the test)."""
  made, make = [], hostbuffer.HostBuffered.make_train_step
  monkeypatch.setattr(hostbuffer.HostBuffered, "make_train_step", lambda *a, **k: made.append(make(*a, **k)) or made[-1])
  before = set(threading.enumerate())
  prefetching = lambda: [t for t in set(threading.enumerate()) - before if t.name.startswith(hostbuffer.PREFETCH_THREAD)]
  toy_fit(tmp_path / "a", 2, executor=_host())
  assert len(made) == 2 and not prefetching()
  with pytest.raises(train.NonFiniteLossError):
    toy_fit(tmp_path / "b", 2, data=toy_data(poison_epoch=1), executor=_host())
  assert len(made) == 4 and not prefetching()


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
  written = []
  with pytest.raises(train.NonFiniteLossError, match=r"training loss is nan at epoch 2, step 1 .* epoch 1 in"):
    cfg = train.RunConfig(epochs=3, checkpoint_dir=str(tmp_path), progress=False)
    train.fit(toy_pipe(), OPT, simulate.Simulate(), toy_data(poison_epoch=1), cfg, jax.random.key(0),
              on_epoch=lambda h: written.append(results.write(tmp_path / "res", "run", {}, h)))
  assert Checkpointer(tmp_path).epochs() == [1]
  assert len(json.loads((tmp_path / "res" / "run.json").read_text())["history"]) == 1


@pytest.mark.parametrize("spec", ["quant:4", "maxabs:4"])
def test_a_nan_in_the_batch_reaches_the_compiled_steps_loss(spec):
  """The README's MLP in 4 stages: XLA's compiled min/max reductions skip the NaN, so the codec's range or
  scale must carry it, else the loss stays finite while the parameters turn NaN."""
  x = jax.random.normal(jax.random.key(0), (256, 16))
  batch = {"x": x.at[5, 3].set(np.nan), "label": (x[:, 0] > 0) + 2 * (x[:, 1] > 0)}
  pipe = jaxcomp.Pipeline(mlp_stages(64, 4, num_stages=4), jaxcomp.parse_boundary(spec, spec),
                          jaxcomp.losses.classification, "x")
  state = simulate.init_state(pipe, OPT, jax.random.key(1), batch)
  _, metrics = simulate.make_train_step(pipe, OPT)(state, batch)
  assert np.isnan(float(metrics["loss"]))


class _ZeroesNaN(nn.Module):
  """Dense, then NaN activations set to 0: the loss stays finite while the weight gradient x^T dh carries NaN."""

  @nn.compact
  def __call__(self, x, train=False):
    h = nn.Dense(8)(x)
    return jnp.where(jnp.isnan(h), 0.0, h)


def test_a_step_that_returns_nan_parameters_stops_the_run_there(tmp_path):
  pipe = jaxcomp.Pipeline((pipeline.FlaxStage(_ZeroesNaN()), *mlp_stages(8, 2, 2)),
                          jaxcomp.parse_boundary("none", "none"), jaxcomp.losses.classification, "x")
  good = toy_data()

  def batches(epoch):
    for i, batch in enumerate(good.train_batches(epoch)):
      if (epoch, i) == (1, 2):  # one NaN entry in the third batch of epoch 2
        batch = {**batch, "x": batch["x"].copy()}
        batch["x"][0, 0] = np.nan
      yield batch

  data = train.Data(batches, good.steps_per_epoch, good.eval_batches, good.example_batch, "toy")
  with pytest.raises(train.NonFiniteLossError, match=r"training loss is [\d.]+ but the step's new parameters hold "
                                                     r"NaN/Inf .* at epoch 2, step 3 of the epoch \(global step 9\)"):
    toy_fit(tmp_path, 3, data=data, pipe=pipe)
  assert Checkpointer(tmp_path).epochs() == [1]


def test_warm_start_takes_the_baselines_model(tmp_path):
  baseline = toy_pipe("none", "none")
  toy_fit(tmp_path / "base", 2, pipe=baseline)
  base_state, _ = Checkpointer(tmp_path / "base").restore(1, simulate.init_state(baseline, OPT, jax.random.key(9), toy_data().example_batch))
  cfg = train.RunConfig(epochs=2, checkpoint_dir=str(tmp_path / "warm"), init_from=(str(tmp_path / "base"), 1),
                        progress=False)
  pipe = toy_pipe("ef21+topk:0.5", "quant:8")
  captured = {}

  class Spy(simulate.Simulate):  # records the state the driver starts training from
    def make_train_step(self, pipe, opt, mode):
      step = simulate.make_train_step(pipe, opt, mode)
      def first(state, batch):
        captured.setdefault("params", jax.tree.map(np.asarray, state.params))
        captured.setdefault("estimate", np.asarray(state.links[0].fwd_send.estimate))
        return step(state, batch)
      return first

  _, history = train.fit(pipe, OPT, Spy(), toy_data(), cfg, jax.random.key(5))
  assert [r["epoch"] for r in history] == [2]
  jax.tree.map(np.testing.assert_array_equal, captured["params"], jax.tree.map(np.asarray, base_state.params))
  assert not captured["estimate"].any()  # compression state starts fresh


def test_existing_checkpoints_are_not_overwritten(tmp_path):
  toy_fit(tmp_path, 1)
  with pytest.raises(ValueError, match="already holds checkpoints"):
    toy_fit(tmp_path, 2)
  assert Checkpointer(tmp_path).epochs() == [1]


def test_results_files(tmp_path):
  history = [{"epoch": 1, "eval_on": {"accuracy": 0.5}, "wire_bytes_fwd": 10}]
  paths = results.write(tmp_path, "r1", {"fwd": "quant:4"}, history)
  results.write(tmp_path, "r2", {}, history)
  assert json.loads(paths["json"].read_text())["config"] == {"fwd": "quant:4"}
  assert paths["csv"].read_text().splitlines()[0] == "epoch,eval_on.accuracy,wire_bytes_fwd"
  assert "| 1 | 0.5 | 10 |" in paths["md"].read_text()
  assert [r["run"] for r in results.load(tmp_path)] == ["r1", "r2"]


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_run_cut_short_inside_epochs_resumes_exactly(tmp_path):
  """--steps may stop inside an epoch (6 batches each); resuming finishes that epoch exactly."""
  full, full_history = toy_fit(tmp_path / "a", 2)
  _, cut = toy_fit(tmp_path / "b", 2, steps=4)  # 4 of epoch 1's 6 batches
  assert [(r["epoch"], r["epoch_batches"]) for r in cut] == [(1, 4)]
  _, cut = toy_fit(tmp_path / "b", 2, resume=True, steps=9)  # rest of epoch 1, 3 of epoch 2
  assert [(r["epoch"], r["epoch_batches"]) for r in cut] == [(1, 6), (2, 3)]
  resumed, history = toy_fit(tmp_path / "b", 2, resume=True)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               full._replace(rng=0), resumed._replace(rng=0))
  for got, want in zip(history, full_history, strict=True):
    assert {k: got[k] for k in ("epoch", "epoch_batches", "step", "train_loss", "eval_on", "eval_off")} == \
        {k: want[k] for k in ("epoch", "epoch_batches", "step", "train_loss", "eval_on", "eval_off")}
  assert Checkpointer(tmp_path / "b").epochs() == [1, 2]


def test_warm_start_refuses_an_unfinished_epoch(tmp_path):
  toy_fit(tmp_path / "base", 2, pipe=toy_pipe("none", "none"), steps=3)
  cfg = train.RunConfig(epochs=2, init_from=(str(tmp_path / "base"), 1), progress=False)
  with pytest.raises(ValueError, match="epoch 1 .* holds an unfinished epoch \\(3 of its batches\\)"):
    train.fit(toy_pipe("none", "none"), OPT, simulate.Simulate(), toy_data(), cfg, jax.random.key(0))


def test_checkpoints_of_every_keep_period_th_epoch_stay(tmp_path):
  """baseN warm starts need epoch N of a longer baseline run."""
  state = simulate.init_state(toy_pipe(), OPT, jax.random.key(0), toy_data().example_batch)
  ckpt = Checkpointer(tmp_path, keep=2, keep_period=3)
  for epoch in range(1, 9):
    ckpt.save(epoch, state, {"epoch": epoch, "history": []})
  assert ckpt.epochs() == [3, 6, 7, 8]


def test_aqsgd_first_visit_without_warmup_sends_the_activation(tmp_path):
  """warmup_epochs=0: the first step sends a densely, so both ends hold m(xi) = a exactly;
  its gradients stay compressed."""
  pipe, data = toy_pipe(), toy_data()
  state0 = simulate.init_state(pipe, OPT, jax.random.key(0), data.example_batch)
  batch = next(data.train_batches(0))
  cfg = train.RunConfig(epochs=1, steps=1, progress=False)
  state, history = train.fit(pipe, OPT, simulate.Simulate(), data, cfg, jax.random.key(0))
  activation = pipe.stages[0].apply(state0.params[0], state0.model_state[0], batch["x"], train=True,
                                    rng=jax.random.key(0))[0]
  link = state.links[0]
  np.testing.assert_array_equal(np.asarray(link.fwd_recv.buffer)[batch["id"]],
                                np.asarray(activation.astype(link.fwd_recv.buffer.dtype)))
  np.testing.assert_array_equal(np.asarray(link.fwd_send.buffer), np.asarray(link.fwd_recv.buffer))
  assert history[0]["dense_steps"] == 1
  assert history[0]["epoch_wire_bytes_fwd"] == simulate.wire_bytes_per_step(pipe, batch, train.Mode.WARMUP)["fwd"]
  assert history[0]["epoch_wire_bytes_bwd"] == simulate.wire_bytes_per_step(pipe, batch, train.Mode.TRAIN)["bwd"]


def test_aqsgd_examples_missed_by_warmup_are_sent_dense_and_counted(tmp_path):
  """20 examples in batches of 8: each epoch drops 4, so epoch 2 meets some examples first."""
  n = 20
  arrays = {k: v[:n] for k, v in ARRAYS.items()}
  data = train.Data(lambda e: batching.iterate(arrays, B, seed=3, epoch=e), n // B,
                    lambda: batching.iterate(arrays, B, 0, 0, shuffle=False),
                    next(batching.iterate(arrays, B, 0, 0, shuffle=False)), "toy")
  pipe = jaxcomp.Pipeline(mlp_stages(8, 2, 3), jaxcomp.parse_boundary("aqsgd+quant:2", "quant:4", num_examples=n),
                          jaxcomp.losses.classification, "x", microbatches=2)
  warm_ids = np.concatenate([b["id"] for b in data.train_batches(0)])
  first_visits = sum(not np.isin(b["id"], warm_ids).all() for b in data.train_batches(1))
  assert first_visits >= 1  # the data really has the case
  _, history = toy_fit(tmp_path, 2, data=data, pipe=pipe)
  wire = {m: simulate.wire_bytes_per_step(pipe, data.example_batch, m) for m in train.Mode if m.trains}
  assert wire[train.Mode.FIRST_VISIT] == {"fwd": wire[train.Mode.WARMUP]["fwd"], "bwd": wire[train.Mode.TRAIN]["bwd"]}
  assert [r["dense_steps"] for r in history] == [2, first_visits]
  for k in ("fwd", "bwd"):
    assert history[0][f"epoch_wire_bytes_{k}"] == 2 * wire[train.Mode.WARMUP][k]
    assert history[1][f"epoch_wire_bytes_{k}"] == (first_visits * wire[train.Mode.FIRST_VISIT][k]
                                                   + (2 - first_visits) * wire[train.Mode.TRAIN][k])
    assert history[1][f"avg_wire_bytes_per_step_{k}"] == (history[0][f"epoch_wire_bytes_{k}"]
                                                         + history[1][f"epoch_wire_bytes_{k}"]) / 4


# ---------------------------------------------------------------- checkpoints: integrity, one layout
def _saved_twice(tmp_path):
  """The same state saved as epochs 1 and 2; 128-wide layers make array files hold raw data."""
  pipe = jaxcomp.Pipeline(mlp_stages(128, 2, 3), toy_pipe().boundary, jaxcomp.losses.classification, "x", microbatches=2)
  state = checkpoint.to_host(simulate.init_state(pipe, OPT, jax.random.key(0), toy_data().example_batch))
  ckpt = Checkpointer(tmp_path)
  for epoch in (1, 2):
    ckpt.save(epoch, state, {"epoch": epoch, "history": []})
  return state


def _model_files(tmp_path):
  return [p for p in (tmp_path / "2" / "model").rglob("*") if p.is_file() and p.parent.name == "d"]


def _damage_truncate(tmp_path):
  for f in _model_files(tmp_path):
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _damage_flip(tmp_path):
  """64 bytes flipped in the middle of the largest array file: Orbax alone restores it silently."""
  f = max(_model_files(tmp_path), key=lambda f: f.stat().st_size)
  data = bytearray(f.read_bytes())
  mid = len(data) // 2
  data[mid: mid + 64] = bytes(b ^ 0xFF for b in data[mid: mid + 64])
  f.write_bytes(bytes(data))


def _damage_empty_meta(tmp_path):
  (tmp_path / "2" / "meta" / "metadata").write_text("")


@pytest.mark.parametrize("damage, why", [(_damage_truncate, "arrays do not read back"),
                                         (_damage_flip, "model arrays do not match their checksums"),
                                         (_damage_empty_meta, "meta does not read back")])
def test_corrupt_checkpoints_are_detected_and_skipped(tmp_path, damage, why):
  state = _saved_twice(tmp_path)
  damage(tmp_path)
  ckpt = Checkpointer(tmp_path)
  with pytest.raises(checkpoint.CorruptCheckpointError, match=f"checkpoint of epoch 2 .* is corrupt: its {why}"):
    ckpt.restore(2, state)
  with pytest.warns(UserWarning, match="epoch 2 .* is corrupt.*; trying the previous checkpoint"):
    epoch, restored, meta = ckpt.restore_latest(state)
  assert epoch == 1 and meta["epoch"] == 1
  chex.assert_trees_all_equal(restored, state)


def test_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path):
  toy_fit(tmp_path, 2)
  _damage_empty_meta(tmp_path)
  with pytest.warns(UserWarning, match="epoch 2 .* is corrupt"):  # resumes after epoch 1 and redoes epoch 2
    _, history = toy_fit(tmp_path, 2, resume=True)
  assert [r["epoch"] for r in history] == [1, 2]


def test_restore_of_another_model_names_it(tmp_path):
  toy_fit(tmp_path, 1)
  wider = jaxcomp.Pipeline(mlp_stages(16, 2, 3), toy_pipe().boundary, jaxcomp.losses.classification, "x", microbatches=2)
  like = simulate.init_state(wider, OPT, jax.random.key(0), toy_data().example_batch)
  with pytest.raises(ValueError, match="holds model arrays of other shapes than this run's"):
    Checkpointer(tmp_path).restore(1, like)


def test_epoch_with_non_finite_eval_loss_is_not_checkpointed(tmp_path):
  good = toy_data()
  poisoned = lambda: ({**b, "x": b["x"] * np.inf} for b in good.eval_batches())
  data = train.Data(good.train_batches, good.steps_per_epoch, poisoned, good.example_batch, "toy")
  with pytest.raises(train.NonFiniteLossError, match=r"epoch 1 ends with .*evaluation losses \[nan.*without "
                                                     r"checkpointing it. Last good checkpoint: none"):
    toy_fit(tmp_path, 2, data=data)
  assert Checkpointer(tmp_path).epochs() == []


def _layout_parts(state):
  """What every layout holds the same (grad_state is the executor's own)."""
  return (state.step, state.rng, state.params, state.model_state, state.opt_state, state.links)


@pytest.mark.slow  # heavy: python -m pytest -m slow
@pytest.mark.parametrize("stages_data", [(3, 1), (3, 2)])
def test_checkpoint_layout_round_trips_through_gpipe(tmp_path, stages_data):
  """A simulate checkpoint placed on a (data, stage) mesh and converted back is unchanged,
  AQ-SGD rows and slot rows of every data shard included."""
  toy_fit(tmp_path, 2)
  pipe, batch = toy_pipe(), toy_data().example_batch
  saved, _ = Checkpointer(tmp_path).restore(2, checkpoint.to_host(simulate.init_state(pipe, OPT, jax.random.key(0), batch)))
  assert np.abs(saved.links[0].fwd_send.buffer).max() > 0  # AQ-SGD rows
  assert any(np.abs(leaf).max() > 0 for leaf in jax.tree.leaves(saved.links[0][2:]))  # EF slot rows
  ex = sharded.ShardedExecutor(sharded.make_mesh(*stages_data))
  placed = checkpoint.executor_layout(ex, pipe, OPT, saved, batch, ex.init_state(pipe, OPT, jax.random.key(1), batch))
  if ex.data > 1:  # each data shard holds only its own examples' AQ-SGD rows
    table = np.asarray(placed.links.fwd_send.buffer)[0]
    for d in range(ex.data):
      others = batching.shard_of(np.arange(N), ex.data) != d
      assert not table[d * N: (d + 1) * N][others].any() and table[d * N: (d + 1) * N][~others].any()
  back = checkpoint.simulate_layout(ex, pipe, OPT, placed, batch)
  chex.assert_trees_all_equal(_layout_parts(back), _layout_parts(saved))


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_warm_starts_and_resumes_across_executors(tmp_path):
  """simulate baseline -> GPipe warm start; GPipe (3 x 2) baseline -> simulate warm start and
  a GPipe (3 x 1) resume of it."""
  baseline, batch = toy_pipe("none", "none"), toy_data().example_batch
  runs = {"sim": simulate.Simulate(), "gp32": sharded.ShardedExecutor(sharded.make_mesh(3, 2)), "gp31": sharded.ShardedExecutor(sharded.make_mesh(3, 1))}
  for name in ("sim", "gp32"):
    toy_fit(tmp_path / name, 1, pipe=baseline, executor=runs[name])
  template = checkpoint.to_host(simulate.init_state(baseline, OPT, jax.random.key(0), batch))
  for base, target in (("sim", "gp32"), ("gp32", "sim"), ("gp32", "gp31")):
    saved, _ = Checkpointer(tmp_path / base).restore(1, template)
    resume = base == "gp32" and target == "gp31"
    directory = tmp_path / base if resume else tmp_path / f"{base}-{target}"
    kw = {} if resume else {"init_from": (str(tmp_path / base), 1)}
    state, _ = toy_fit(directory, 1, resume=resume, pipe=baseline, executor=runs[target], **kw)  # nothing left to train
    got = checkpoint.simulate_layout(runs[target], baseline, OPT, state, batch)
    chex.assert_trees_all_equal((got.step, got.rng, got.params, got.opt_state), (saved.step, saved.rng, saved.params, saved.opt_state))


@pytest.mark.slow  # heavy: python -m pytest -m slow
@pytest.mark.parametrize("first, then, stages", [("gpipe", "zb-h1", 3), ("zb-h1", "1f1b", 3),
                                                 ("1f1b", "interleaved:2", 4), ("interleaved:2", "1f1b", 4)])
def test_a_run_resumes_bit_identically_on_another_schedule(tmp_path, first, then, stages):
  """Epoch 1 on `first`, epoch 2 resumed on `then`: bitwise the run that stayed on `then` (the schedules sum
  the same numbers in the same order, so the checkpoint need not say which one ran; interleaved:2 holds the
  4 stages' rows 2 per device, 1f1b one: the checkpoint converts them)."""
  ex = lambda name: sharded.ShardedExecutor(sharded.make_mesh(stages // schedules.parse(name).chunks_per_device, 1),
                                            schedule=schedules.parse(name))
  pipe = toy_pipe(stages=stages)
  full, full_history = toy_fit(tmp_path / "a", 2, executor=ex(then), pipe=pipe)
  toy_fit(tmp_path / "b", 1, executor=ex(first), pipe=pipe)
  resumed, history = toy_fit(tmp_path / "b", 2, resume=True, executor=ex(then), pipe=pipe)
  chex.assert_trees_all_equal(jax.random.key_data(full.rng), jax.random.key_data(resumed.rng))
  chex.assert_trees_all_equal(full._replace(rng=0), resumed._replace(rng=0))
  assert history[1]["eval_on"] == full_history[1]["eval_on"]


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_gpipe_resumed_run_is_bit_identical(tmp_path):
  """Through the simulate-layout checkpoint and back: params, optimizer rows, tables, keys (3 stages x 2 data,
  each example on its data shard in every epoch)."""
  ex, data = lambda: sharded.ShardedExecutor(sharded.make_mesh(3, 2)), toy_data(shards=2)
  full, full_history = toy_fit(tmp_path / "a", 2, executor=ex(), data=data)
  toy_fit(tmp_path / "b", 1, executor=ex(), data=data)
  resumed, history = toy_fit(tmp_path / "b", 2, resume=True, executor=ex(), data=data)
  chex.assert_trees_all_equal(jax.random.key_data(full.rng), jax.random.key_data(resumed.rng))
  chex.assert_trees_all_equal(full._replace(rng=0), resumed._replace(rng=0))
  assert history[1]["eval_on"] == full_history[1]["eval_on"]
