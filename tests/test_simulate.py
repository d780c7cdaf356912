import pathlib
import os
import subprocess
import sys
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp import pipeline
from jaxcomp.compress.boundary import Mode
from jaxcomp.models.mlp import mlp_stages
from jaxcomp.parallel import memory, simulate

X = jax.random.normal(jax.random.key(0), (16, 8))
BATCH = {"x": X, "label": (X[:, 0] > 0).astype(jnp.int32), "id": jnp.arange(16) + 3}


def _pipe(fwd="none", bwd="none", m=2, stages=3):
  return jaxcomp.Pipeline(mlp_stages(16, 2, stages), jaxcomp.parse_boundary(fwd, bwd, num_examples=20),
                          jaxcomp.losses.classification, "x", microbatches=m)


def test_uncompressed_microbatched_equals_whole_model_gradient():
  pipe = _pipe(m=4)
  state = jaxcomp.init_state(pipe, optax.sgd(0.1), jax.random.key(1), BATCH)
  loss, _, _, grads, _ = jax.jit(lambda st, b: simulate.loss_and_grads(pipe, st, b))(state, BATCH)  # one compile

  def whole(params):
    x = BATCH["x"]
    for stage, p in zip(pipe.stages, params):
      x = stage.apply(p, {}, x, train=True, rng=jax.random.key(0))[0]
    return jaxcomp.losses.classification(x, BATCH)[0]

  ref_loss, ref_grads = jax.jit(jax.value_and_grad(whole))(state.params)
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7),
               grads, ref_grads)


def test_every_microbatch_slot_gets_its_own_ef_rows():
  pipe = _pipe("ef+topk:0.2", "ef21+quant:2", m=4)
  state = jaxcomp.init_state(pipe, optax.sgd(0.1), jax.random.key(1), BATCH)
  assert state.links[0].fwd_send.error.shape == (16, 16)  # one row per batch slot
  _, _, _, _, links = jax.jit(lambda st, b: simulate.loss_and_grads(pipe, st, b))(state, BATCH)
  per_microbatch = lambda a: np.abs(np.asarray(a)).reshape(4, -1).max(axis=1)  # 4 slots x 4 rows
  for link in links:
    assert np.all(per_microbatch(link.fwd_send.error) > 0)
    np.testing.assert_array_equal(np.asarray(link.bwd_send.estimate), np.asarray(link.bwd_recv.estimate))
    assert np.all(per_microbatch(link.bwd_send.estimate) > 0)


def test_aqsgd_warmup_then_compressed_keeps_mirrors():
  pipe = _pipe("aqsgd+quant:2", "quant:4", m=2)
  opt = optax.sgd(0.05)
  state = jaxcomp.init_state(pipe, opt, jax.random.key(1), BATCH)
  assert state.links[0].fwd_send.buffer.shape == (20, 16)
  state, _ = simulate.make_train_step(pipe, opt, Mode.WARMUP)(state, BATCH)
  touched = np.asarray(BATCH["id"])
  for link in state.links:
    buf = np.asarray(link.fwd_send.buffer)
    assert np.all(np.abs(buf[touched]).max(axis=1) > 0) and not buf[[0, 1, 2, 19]].any()
  step = simulate.make_train_step(pipe, opt)
  for _ in range(3):
    state, metrics = step(state, BATCH)
  for link in state.links:
    np.testing.assert_array_equal(np.asarray(link.fwd_send.buffer), np.asarray(link.fwd_recv.buffer))
  assert np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("fwd, bwd", [("quant:2", "quant:8"), ("topk:0.3", "reuse"), ("ef21+topk:0.2", "topk:0.5")])
def test_training_reduces_loss_and_eval_reports_both_modes(fwd, bwd):
  pipe = _pipe(fwd, bwd, m=2)
  opt = optax.adam(1e-2)
  state = jaxcomp.init_state(pipe, opt, jax.random.key(1), BATCH)
  step = simulate.make_train_step(pipe, opt)
  first = None
  for _ in range(40):
    state, metrics = step(state, BATCH)
    first = first if first is not None else float(metrics["loss"])
  assert float(metrics["loss"]) < 0.5 * first
  on = simulate.make_eval_step(pipe, compressed=True)(state, BATCH)
  off = simulate.make_eval_step(pipe, compressed=False)(state, BATCH)
  assert set(on) == set(off) == {"loss", "accuracy"}
  assert float(on["loss"]) != float(off["loss"])


def test_nan_input_shows_up_in_the_loss():
  pipe = _pipe("quant:4", "quant:8", m=1)
  opt = optax.sgd(0.1)
  state = jaxcomp.init_state(pipe, opt, jax.random.key(1), BATCH)
  bad = {**BATCH, "x": BATCH["x"].at[3, 2].set(jnp.nan)}
  _, metrics = simulate.make_train_step(pipe, opt)(state, bad)
  assert np.isnan(float(metrics["loss"]))


def test_bad_pipeline_configs():
  pipe = _pipe(m=3)
  with pytest.raises(ValueError, match="batch size 16 does not divide into 3 microbatches"):
    jaxcomp.init_state(pipe, optax.sgd(0.1), jax.random.key(1), BATCH)
  with pytest.raises(ValueError, match="microbatches must be a positive integer, got 0"):
    _pipe(m=0)
  with pytest.raises(ValueError, match="train step mode must be TRAIN, WARMUP or FIRST_VISIT"):
    simulate.make_train_step(_pipe(), optax.sgd(0.1), Mode.EVAL_COMPRESSED)
  aq = _pipe("aqsgd+quant:2", "quant:4")
  shapes = [jax.ShapeDtypeStruct((8, 16), jnp.float32)] * 2
  with pytest.raises(ValueError, match=r"AQ-SGD buffers need .* GiB .* only 0.00 GiB is free"):
    memory.check_aqsgd_memory(aq.boundary, shapes, available=1000)
  memory.check_aqsgd_memory(aq.boundary, shapes, available=10**6)


def test_readme_example_runs_and_learns(capsys):
  readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
  code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
  namespace = {}
  exec(compile(code, "README.md", "exec"), namespace)
  # learned: far below chance (ln 4 = 1.39). The exact figure depends on the CPU's code generation (0.0003 at
  # XLA's default optimisation level, 0.23 at the suite's level 0 on an AMD EPYC): 2-bit forwards train noisily
  assert float(namespace["metrics"]["loss"]) < 0.5
  assert float(namespace["metrics"]["accuracy"]) > 0.9
  assert "'fwd': 12312" in capsys.readouterr().out  # 3 boundaries x (256x64 2-bit codes + min/max)


class _RecordDropoutMask(nn.Module):
  """Identity on x; keeps the dropout mask of its last two calls in a 'record' collection."""

  @nn.compact
  def __call__(self, x, train):
    mask = nn.Dropout(0.5, deterministic=not train)(jnp.ones((1, 64)))
    record = self.variable("record", "masks", jnp.zeros, (2, 64))
    if train:
      record.value = jnp.concatenate([record.value[1:], mask])
    return x


def test_microbatches_and_stages_draw_different_dropout_masks():
  stages = (pipeline.FlaxStage(_RecordDropoutMask()), pipeline.FlaxStage(_RecordDropoutMask()))
  pipe = jaxcomp.Pipeline(stages, jaxcomp.parse_boundary("none", "none"),
                          lambda y, mb: (jnp.mean(y), {}), "x", microbatches=2)
  state = simulate.init_state(pipe, optax.sgd(0.1), jax.random.key(1), BATCH)
  _, _, model_state, _, _ = jax.jit(lambda st, b: simulate.loss_and_grads(pipe, st, b))(state, BATCH)
  masks = [np.asarray(ms["record"]["masks"]) for ms in model_state]  # [microbatch 0, 1] per stage
  for m in masks:
    assert not np.array_equal(m[0], m[1])  # each microbatch its own mask
  assert not np.array_equal(masks[0], masks[1])  # each stage its own mask


def test_an_executor_that_leaves_out_part_of_the_contract_cannot_be_built():
  """`pipeline.Executor` is an ABC: a subclass must implement every step, shape and trace method; the optional
  hooks (stack, unstack, collective_ways, describe, rows_description) have defaults."""
  class TrainsOnly(pipeline.Executor):
    def init_state(self, pipe, optimizer, rng, batch, params=None):
      return simulate.init_state(pipe, optimizer, rng, batch, params)

    def make_train_step(self, pipe, optimizer, mode=Mode.TRAIN):
      return simulate.make_train_step(pipe, optimizer, mode)

  with pytest.raises(TypeError, match="abstract methods") as refused:
    TrainsOnly()
  # Python 3.12 quotes the names ('batch_shapes', ...), 3.11 does not
  assert re.findall(r"\w+", str(refused.value).split("abstract methods", 1)[1]) == [
      "batch_shapes", "make_eval_step", "state_shapes", "trace_step", "wire_bytes_per_step"]
  assert simulate.Simulate().collective_ways(Mode.TRAIN) == ()


def test_activation_shapes_are_traced_once_per_pipeline_and_batch_shapes(monkeypatch):
  """A run asks for its boundary shapes many times (its checks, its bytes in each mode, its tables): equal
  pipelines and batch shapes reuse one trace; other stages, microbatches or batch shapes get their own."""
  traces, init = [], pipeline.init_state
  monkeypatch.setattr(pipeline, "init_state", lambda *args: traces.append(args) or init(*args))
  pipe = lambda fwd="none", m=2, stages=3: jaxcomp.Pipeline(  # a width no other test uses: nothing traced before
      mlp_stages(24, 2, stages), jaxcomp.parse_boundary(fwd, "none"), jaxcomp.losses.classification, "x",
      microbatches=m)
  batch = {"x": jnp.zeros((12, 8)), "label": jnp.zeros(12, jnp.int32)}
  shapes = lambda pipe, batch: [tuple(s.shape) for s in pipeline.activation_shapes(pipe, batch)]
  assert shapes(pipe(), batch) == [(6, 24)] * 2
  assert shapes(pipe("quant:2"), batch) == [(6, 24)] * 2  # codecs change no shape: the same trace
  assert pipeline.boundary_bytes(pipe(), batch) == {"fwd": 2 * 2 * 6 * 24 * 4, "bwd": 2 * 2 * 6 * 24 * 4}
  assert len(traces) == 1
  assert shapes(pipe(), jax.tree.map(lambda a: a[:6], batch)) == [(3, 24)] * 2
  assert shapes(pipe(m=3), batch) == [(4, 24)] * 2
  assert shapes(pipe(stages=4), batch) == [(6, 24)] * 3
  assert len(traces) == 4


def test_a_raw_flax_module_as_a_stage_is_one_error_naming_flaxstage_and_the_contract():
  """A plain Flax module is not a stage (its init returns one dict, not (params, state)): refused when the pipeline
  is built, naming FlaxStage and the stage contract."""
  class Head(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
      return nn.Dense(4)(x)

  with pytest.raises(TypeError, match=r"stage 1 is a Flax module \(Head\); wrap it as jaxcomp.FlaxStage\(module\): a "
                                      r"stage is init\(rng, x\) -> \(params, model_state\)"):
    jaxcomp.Pipeline((jaxcomp.FlaxStage(Head()), Head()), jaxcomp.parse_boundary("none", "none"),
                     jaxcomp.losses.classification, "x")


def test_the_own_model_example_trains_the_same_pipeline_on_simulate_and_sharded(capsys):
  """examples/own_model.py (docs/guide/own_model.md): both executors train and count the same bytes."""
  from examples import own_model
  own_model.main()
  lines = capsys.readouterr().out.splitlines()
  (sim,), (shd,) = ([line for line in lines if line.startswith(kind)] for kind in ("simulate", "sharded"))
  assert sim.split(" ", 2)[2] == shd.split(" ", 2)[2] == "{'fwd': 12288, 'bwd': 20480}"
  assert float(sim.split()[1]) < 0.1 and float(shd.split()[1]) < 0.1


def test_the_library_byte_count_refuses_a_batch_where_its_state_goes_and_its_old_name_warns_once():
  pipe = jaxcomp.Pipeline(mlp_stages(8, 4, num_stages=2), jaxcomp.parse_boundary("quant:4", "quant:8"),
                          jaxcomp.losses.classification, "x")
  batch = {"x": jnp.zeros((4, 8)), "label": jnp.zeros(4, jnp.int32)}
  with pytest.raises(TypeError, match=r"takes a TrainState \(or None\) as state, got dict"):
    jaxcomp.boundary_bytes(pipe, batch, batch)
  assert jaxcomp.boundary_bytes(pipe, batch) == simulate.wire_bytes_per_step(pipe, batch)
  old_name_twice = ("import jax.numpy as jnp, jaxcomp; from jaxcomp.models.mlp import mlp_stages\n"
                    "pipe = jaxcomp.Pipeline(mlp_stages(8, 4, num_stages=2), jaxcomp.parse_boundary('quant:4', "
                    "'quant:8'), jaxcomp.losses.classification, 'x')\n"
                    "batch = {'x': jnp.zeros((4, 8)), 'label': jnp.zeros(4, jnp.int32)}\n"
                    "print(jaxcomp.wire_bytes_per_step(pipe, None, batch))\n"  # two call sites: Python's own filter would warn at each
                    "print(jaxcomp.wire_bytes_per_step(pipe, None, batch))")
  done = subprocess.run([sys.executable, "-c", old_name_twice], capture_output=True, text=True, timeout=120,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert done.stdout.splitlines() == [str(jaxcomp.boundary_bytes(pipe, batch))] * 2
  assert done.stderr.count("FutureWarning: jaxcomp.wire_bytes_per_step(pipe, state, batch) is now "
                           "jaxcomp.boundary_bytes(pipe, batch, state=None)") == 1
