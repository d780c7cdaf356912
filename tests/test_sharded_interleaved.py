"""Interleaved 1F1B on the sharded executor (`ShardedExecutor(schedule="interleaved:V")`): V chunks per device,
chunk c on device c mod S, its boundaries on a ring; bitwise 1F1B's numbers on an S V-device mesh (the same
arithmetic: each chunk's weight gradients summed in microbatch order), simulate's, and its errors."""
import jax
import numpy as np
import optax
import pytest

from jaxcomp.compress.boundary import Mode
from jaxcomp.models.mlp import mlp_stages
from jaxcomp.parallel import sharded, simulate

from pipeline_cases import BATCH, assert_trees_close, mlp_pipe, train_sharded


@pytest.mark.parametrize("fwd, bwd, devices, chunks, m, data", [("none", "none", 2, 2, 4, 1),
                                                                  ("quant:4", "quant:8", 2, 2, 2, 2)])
def test_interleaved_matches_1f1b_and_simulate(fwd, bwd, devices, chunks, m, data):
  """Against 1F1B with one chunk per device (bitwise) and simulate, with dense data parallelism too."""
  pipe = mlp_pipe(fwd, bwd, stages=mlp_stages(16, 2, devices * chunks), m=m)
  opt = optax.sgd(0.1, momentum=0.9)
  losses, state = train_sharded(pipe, opt, data=data, stage_devices=devices, schedule=f"interleaved:{chunks}")
  jax.tree.map(np.testing.assert_array_equal, (losses, state), train_sharded(pipe, opt, data=data, schedule="1f1b"))
  sim_pipe = mlp_pipe(fwd, bwd, stages=mlp_stages(16, 2, devices * chunks), m=m * data)  # D shards of M: simulate's M D
  sim = simulate.init_state(sim_pipe, opt, jax.random.key(1), BATCH)
  step = simulate.make_train_step(sim_pipe, opt, Mode.TRAIN)
  for loss in losses:
    sim, metrics = step(sim, BATCH)
    np.testing.assert_allclose(float(loss), float(metrics["loss"]), rtol=1e-5)
  assert_trees_close(state.params, sim.params, atol=2e-6)
  assert_trees_close(state.opt_state, sim.opt_state, atol=2e-6)


def test_init_state_puts_chunk_c_on_device_c_mod_s():
  """Each device initialises its chunks d, d+S, ... ([S, V, P] rows) = simulate's init, stacked."""
  pipe, opt = mlp_pipe("none", "none", stages=mlp_stages(16, 2, 4), m=2), optax.adam(1e-2)
  ex = sharded.ShardedExecutor(sharded.make_mesh(2, data=2), schedule="interleaved:2")
  flat = ex.init_state(pipe, opt, jax.random.key(1), BATCH)
  simulated = simulate.init_state(pipe, opt, jax.random.key(1), BATCH)
  assert_trees_close(flat._replace(rng=()), ex.stack(pipe, opt, simulated, BATCH)._replace(rng=()), 0)
  assert flat.params.shape[:2] == (2, 2)
  assert_trees_close(ex.unstack(pipe, opt, flat, BATCH).params[1], simulated.params[1], 0)
  assert_trees_close(flat.params[1, 0], ex.layout(pipe, opt, BATCH).params.put(1, simulated.params[1]), 0)


def test_interleaved_errors_name_the_value_and_the_fix():
  opt = optax.sgd(0.1)
  ex = sharded.ShardedExecutor(sharded.make_mesh(2), schedule="interleaved:2")
  with pytest.raises(ValueError, match=r"the model has 2 stages but the mesh's stage axis has 2 devices x 2 chunks"):
    ex.make_train_step(mlp_pipe("none", "none", stages=mlp_stages(16, 2, 2), m=2), opt)
  with pytest.raises(ValueError, match=r"multiple of the stages, got M=3 for S=2 \(use M = 4\)"):
    ex.make_train_step(mlp_pipe("none", "none", stages=mlp_stages(16, 2, 4), m=3), opt)
  with pytest.raises(ValueError, match=r"does not run with a boundary scheme with state \(EF, EF21, AQ-SGD\) yet"):
    ex.make_train_step(mlp_pipe("ef+quant:4", "none", stages=mlp_stages(16, 2, 4), m=2), opt)
  with pytest.raises(ValueError, match="eval steps of schedule interleaved:2 do not run yet"):
    ex.make_eval_step(mlp_pipe("none", "none", stages=mlp_stages(16, 2, 4), m=2), compressed=True)
  with pytest.raises(ValueError, match=r"or interleaved:V \(V >= 1 chunks per device\), got 'interleaved:0'"):
    sharded.ShardedExecutor(sharded.make_mesh(2), schedule="interleaved:0")
