"""Pipelines, a batch and helpers shared by the executor tests (test_sharded*, test_qadam, test_schedule)."""
import dataclasses

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from jaxcomp.compress import bottleneck
from jaxcomp.compress.boundary import Mode
from jaxcomp.models.mlp import mlp_stages
from jaxcomp.parallel import schedules, sharded, simulate
from jaxcomp.pipeline import FlaxStage

X = jax.random.normal(jax.random.key(0), (16, 8))
BATCH = {"x": X, "label": (X[:, 0] > 0).astype(jnp.int32), "id": jnp.arange(16) + 2}


class BNStage(nn.Module):
  """Dense(width) + BatchNorm + relu: heterogeneous widths and a model-state collection."""
  width: int
  out: int = 0

  @nn.compact
  def __call__(self, x, train=False):
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(nn.Dense(self.width)(x)))
    return nn.Dense(self.out)(x) if self.out else x


def hetero_stages():
  return tuple(FlaxStage(m) for m in (BNStage(24), BNStage(8), BNStage(12, out=2)))


def mlp_pipe(fwd, bwd, stages=None, m=2):
  stages = stages or mlp_stages(16, 2, 4)
  return jaxcomp.Pipeline(stages, jaxcomp.parse_boundary(fwd, bwd, num_examples=20),
                          jaxcomp.losses.classification, "x", microbatches=m)


def bottleneck_pipe(spec, fwd="maxabs:4", bwd="quant:8", m=4):
  """`mlp_pipe` of 4 stages with the learned bottleneck `spec` at every boundary."""
  learned = bottleneck.parse(spec)
  return dataclasses.replace(mlp_pipe(fwd, bwd, stages=bottleneck.wrap(mlp_stages(16, 2, 4), learned, 16), m=m),
                             tied=bottleneck.tied(learned, 4))


def assert_trees_close(a, b, atol):
  """Every leaf of a within atol of b's (compared in float32: states hold integer counters too)."""
  as_f32 = lambda tree: jax.tree.map(lambda x: np.asarray(x, np.float32), tree)
  chex.assert_trees_all_close(as_f32(a), as_f32(b), atol=atol, rtol=0)


def compare_with_simulate(pipe, opt, steps, data=1, sim_pipe=None, modes=(Mode.TRAIN,), atol=2e-6, schedule="gpipe",
                          overlap=False, stage_devices=None, remat="stage"):
  """`steps` train steps per mode, then eval steps (compressed and not), on the sharded executor (`stage_devices`,
  default one per stage) and on simulate (`sim_pipe`): the same losses and states (the tied exchange's on every
  replica)."""
  sim_pipe = sim_pipe or pipe
  ex = sharded.ShardedExecutor(sharded.make_mesh(stage_devices or pipe.num_stages, data),
                               schedule=schedules.parse(schedule, overlap), remat=remat)
  state = simulate.init_state(sim_pipe, opt, jax.random.key(1), BATCH)
  flat = ex.stack(pipe, opt, state, BATCH)
  for mode in modes:
    sim_step, g_step = simulate.make_train_step(sim_pipe, opt, mode), ex.make_train_step(pipe, opt, mode)
    for _ in range(steps):
      state, sim_metrics = sim_step(state, BATCH)
      flat, g_metrics = g_step(flat, BATCH)
      np.testing.assert_allclose(float(g_metrics["loss"]), float(sim_metrics["loss"]), rtol=1e-5)
      np.testing.assert_allclose(float(g_metrics["accuracy"]), float(sim_metrics["accuracy"]), atol=1e-6)
  back = ex.unstack(pipe, opt, flat, BATCH)
  assert_trees_close(back.params, state.params, atol)
  assert_trees_close(back.model_state, state.model_state, atol)
  every_replica = lambda sim, sharded_: np.broadcast_to(np.asarray(sim), sharded_.shape)  # simulate: one replica's
  assert_trees_close(back.tied_state, jax.tree.map(every_replica, state.tied_state, back.tied_state), atol)
  if data == 1 or not pipe.boundary.fwd.keyed_by_example:
    assert_trees_close(back.links, state.links, atol)
  for compressed in (True, False):
    sim_eval = simulate.make_eval_step(sim_pipe, compressed)(state, BATCH)
    g_eval = ex.make_eval_step(pipe, compressed)(flat, BATCH)
    np.testing.assert_allclose(float(g_eval["loss"]), float(sim_eval["loss"]), rtol=1e-5)
  return state


def train_sharded(pipe, opt, modes=(Mode.TRAIN,), steps=2, data=1, stage_devices=None, evals=False, schedule="gpipe",
                  overlap=False, **executor):
  """Losses of `steps` train steps per mode on `ShardedExecutor(**executor)` of `schedule` (`overlap`: with
  overlapped sends; `stage_devices`, default one per stage) from simulate's initial state (`evals`: then an eval
  step's, compressed and not), and the state after, as simulate lays it out (its key as data)."""
  ex = sharded.ShardedExecutor(sharded.make_mesh(stage_devices or pipe.num_stages, data),
                               schedule=schedules.parse(schedule, overlap), **executor)
  flat = ex.stack(pipe, opt, simulate.init_state(pipe, opt, jax.random.key(1), BATCH), BATCH)
  losses = []
  for mode in modes:
    step = ex.make_train_step(pipe, opt, mode)
    for _ in range(steps):
      flat, metrics = step(flat, BATCH)
      losses.append(np.asarray(metrics["loss"]))
  for compressed in (True, False)[:2 * evals]:
    losses.append(np.asarray(ex.make_eval_step(pipe, compressed)(flat, BATCH)["loss"]))
  state = ex.unstack(pipe, opt, flat, BATCH)
  return losses, state._replace(rng=jax.random.key_data(state.rng))


def slow(*args):
  """A heavier variant: runs with `python -m pytest -m slow` (CI runs the rest)."""
  return pytest.param(*args, marks=pytest.mark.slow)
