"""Single-device executor: every stage and boundary in one program (the papers' method).

Microbatches run one after another through all stages; boundary b between stage b and b+1
compresses the forward activation and, via its custom_vjp, the backward gradient. Numerics
(keys, state rows, microbatch order) match the sharded GPipe executor exactly.
"""
import dataclasses
from typing import Any

import jax
import optax
from jax.sharding import SingleDeviceSharding

from jaxcomp import pipeline
from jaxcomp.compress.boundary import LinkState, Mode
from jaxcomp.parallel import memory


def _run(pipe: pipeline.Pipeline, params, model_state, fwd_tables, bwd_tables, batch, step_key, mode, train):
  """Forward pass of a whole batch. Returns (mean loss, (metrics, model_state, fwd_tables))."""
  mbs = pipeline.split_microbatches(batch, pipe.microbatches)
  mb_size = jax.tree.leaves(mbs)[0].shape[1]
  model_state, fwd_tables = list(model_state), list(fwd_tables)
  losses, metrics = [], []
  for i in range(pipe.microbatches):
    mb = jax.tree.map(lambda x: x[i], mbs)
    rows_of = lambda scheme: pipeline.rows(scheme, i, mb_size, mb.get("id"))
    x = mb[pipe.input_key]
    for s, stage in enumerate(pipe.stages):
      x, model_state[s] = stage.apply(params[s], model_state[s], x, train=train,
                                      rng=pipeline.stage_key(step_key, i, s))
      if s == pipe.num_stages - 1:
        break
      (fs, fr), (bs, br) = fwd_tables[s], bwd_tables[s]
      link = pipeline.link_rows(LinkState(fs, fr, bs, br), pipe.boundary, rows_of, rows_of)
      x, (fs_rows, fr_rows) = pipe.boundary(x, link, pipeline.link_key(step_key, i, s), mode)
      if mode.trains:
        fwd_tables[s] = (pipeline.scatter(fs, rows_of(pipe.boundary.fwd), fs_rows),
                         pipeline.scatter(fr, rows_of(pipe.boundary.fwd), fr_rows))
    loss, m = pipe.loss_fn(x, mb)
    losses.append(loss)
    metrics.append(m)
  mean = lambda xs: sum(xs) / len(xs)
  metrics = jax.tree.map(lambda *v: mean(v), *metrics)
  return mean(losses), (metrics, tuple(model_state), tuple(fwd_tables))


def init_state(pipe: pipeline.Pipeline, optimizer: optax.GradientTransformation, rng, batch,
               params=None) -> pipeline.TrainState:
  """Executor protocol: the train state on the default device (see `pipeline.init_state`); AQ-SGD
  tables that cannot fit are a ValueError before anything is allocated."""
  memory.check_aqsgd_memory(pipe.boundary, lambda: pipeline.activation_shapes(pipe, batch))
  return pipeline.init_state(pipe, optimizer, rng, batch, params)


def wire_bytes_per_step(pipe: pipeline.Pipeline, batch, mode: Mode = Mode.TRAIN) -> dict[str, int]:
  """Executor protocol: bytes one training step sends over all boundaries, each way
  (warm-up steps send dense tensors)."""
  return pipeline.boundary_bytes(pipeline.as_sent(pipe, mode), batch)


def _tables(state: pipeline.TrainState):
  """(forward tables, backward tables) per boundary: (sender, receiver) pairs."""
  return (tuple((l.fwd_send, l.fwd_recv) for l in state.links),
          tuple((l.bwd_send, l.bwd_recv) for l in state.links))


def step_grads(pipe: pipeline.Pipeline, state: pipeline.TrainState, batch, mode: Mode = Mode.TRAIN):
  """One step's (loss, metrics, model_state, finished weight grads, new LinkStates, new tied_state), no
  optimizer.

  The new backward states are the gradients w.r.t. the backward tables (see boundary.py).
  """
  step_key = jax.random.fold_in(state.rng, state.step)
  fwd, bwd = _tables(state)
  run = lambda p, b: _run(pipe, p, state.model_state, fwd, b, batch, step_key, mode, True)
  (loss, (metrics, model_state, fwd)), (grads, bwd) = jax.value_and_grad(
      run, argnums=(0, 1), has_aux=True)(state.params, bwd)
  links = tuple(LinkState(*f, *b) for f, b in zip(fwd, bwd))
  grads, tied_state = pipeline.finish_grads(pipe, grads, state.tied_state, step_key)
  return loss, metrics, model_state, grads, links, tied_state


def loss_and_grads(pipe: pipeline.Pipeline, state: pipeline.TrainState, batch, mode: Mode = Mode.TRAIN):
  """One step's (loss, metrics, model_state, weight grads, new LinkStates): `step_grads` without the tied state."""
  return step_grads(pipe, state, batch, mode)[:5]


def make_train_step(pipe: pipeline.Pipeline, optimizer: optax.GradientTransformation, mode: Mode = Mode.TRAIN):
  """jit-compiled (state, batch) -> (state, metrics). `mode` is TRAIN, WARMUP or FIRST_VISIT."""
  if not mode.trains:
    raise ValueError(f"train step mode must be TRAIN, WARMUP or FIRST_VISIT, got {mode}")

  def step(state: pipeline.TrainState, batch):
    loss, metrics, model_state, grads, links, tied_state = step_grads(pipe, state, batch, mode)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    new_state = pipeline.TrainState(state.step + 1, state.rng, optax.apply_updates(state.params, updates),
                                    model_state, opt_state, links, state.grad_state, tied_state)
    return new_state, {"loss": loss, **metrics}

  return jax.jit(step, donate_argnums=0)


def make_eval_step(pipe: pipeline.Pipeline, compressed: bool):
  """jit-compiled (state, batch) -> metrics, with C(x) at boundaries or dense tensors."""
  mode = Mode.EVAL_COMPRESSED if compressed else Mode.EVAL_UNCOMPRESSED

  def step(state: pipeline.TrainState, batch):
    fwd, bwd = _tables(state)
    loss, (metrics, _, _) = _run(pipe, state.params, state.model_state, fwd, bwd, batch,
                                 jax.random.fold_in(state.rng, state.step), mode, False)
    return {"loss": loss, **metrics}

  return jax.jit(step)


@dataclasses.dataclass(frozen=True)
class Simulate(pipeline.Executor):
  """This module's functions as an `Executor` object; its state is the simulate layout itself. `device`
  is where a dry run places its state and batch (None: the default device)."""
  device: Any = dataclasses.field(default=None, kw_only=True)

  def init_state(self, pipe, optimizer, rng, batch, params=None):
    return init_state(pipe, optimizer, rng, batch, params)

  def make_train_step(self, pipe, optimizer, mode: Mode = Mode.TRAIN):
    return make_train_step(pipe, optimizer, mode)

  def make_eval_step(self, pipe, compressed: bool):
    return make_eval_step(pipe, compressed)

  def wire_bytes_per_step(self, pipe, batch, mode: Mode = Mode.TRAIN):
    return wire_bytes_per_step(pipe, batch, mode)

  def _placed(self, tree):
    sharding = SingleDeviceSharding(self.device or jax.devices()[0])
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)

  def state_shapes(self, pipe, optimizer, batch):
    return self._placed(jax.eval_shape(lambda b: pipeline.init_state(pipe, optimizer, jax.random.key(0), b), batch))

  def batch_shapes(self, batch):
    return self._placed(batch)

  def trace_step(self, pipe, optimizer, mode, state, batch):
    step = make_train_step(pipe, optimizer, mode) if mode.trains else make_eval_step(
        pipe, mode is Mode.EVAL_COMPRESSED)
    return step.trace(state, batch)

  def describe(self) -> str:
    return "simulate: one device"
