"""The sharded executor: stages on a `stage` mesh axis, compressed payloads on `ppermute`.

Mesh axes ("data", "stage") (`mesh.make_mesh`). Device (d, s) runs stage s on data shard d and
holds stage s's rows of the state (`state_layout`: no device holds the whole model). The step
runs a schedule (`jaxcomp.parallel.schedules`: its timetable's ticks with explicit backwards; or GPipe's
forward ticks differentiated by autodiff with `remat="none"`) under `jax.shard_map`;
every schedule sends exactly M x sum_b wire_bytes(b) each way per data shard. Each data shard
differentiates its mean loss / D, so its boundary gradients equal those of `simulate` at
the global batch; the weight gradients are then exchanged over `data` (`dataparallel`: dense,
compressed by `grad_scheme`, or QuantizedAdam's first moment) and the optimizer runs per stage.
Numerics (keys, state rows, microbatch order) equal `simulate`'s.
"""
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import pipeline
from jaxcomp.compress import schemes
from jaxcomp.compress.boundary import LinkState, Mode
from jaxcomp.parallel import dataparallel, memory, schedules
from jaxcomp.parallel.autodiff_ticks import AutodiffRunner
from jaxcomp.parallel.mesh import DATA, STAGE, make_mesh
from jaxcomp.parallel.overlapped_sends import OverlappedRunner
from jaxcomp.parallel.stage_runner import REMAT, StageRunner
from jaxcomp.parallel.state_layout import StateLayout

__all__ = ["DATA", "STAGE", "ShardedExecutor", "make_mesh"]


@dataclasses.dataclass(frozen=True)
class ShardedExecutor(pipeline.Executor):
  """`init_state`, `make_train_step`, `make_eval_step` as `simulate`, with the stages across the mesh.

  `grad_scheme` (Plain or EF around a codec, e.g. `parse_scheme("ef+quant:4")`) compresses the
  data-parallel weight-gradient exchange; warm-up steps (Mode.WARMUP) exchange dense gradients.
  With the optimizer `qadam.QuantizedAdam` it compresses Adam's first moment instead (Adam's
  second moment is frozen after warm-up); each replica's EF error is its row of `grad_state`.
  Padding has zero gradient, moments and (masked) exchanged momentum, so it stays exactly zero.
  Ties and clipping apply to each replica's local gradient after warm-up (the mean gradient is
  never formed), to the mean one during warm-up.
  `schedule` (`jaxcomp.parallel.schedules`): `GPipe()` (all forwards, then all backwards: M microbatch
  inputs saved per stage), `OneFOneB()` (PipeDream-flush: one forward or backward per stage per
  tick, at most S inputs saved whatever M) or `OneFOneB(fused=True)` (a forward and a backward per
  stage per tick: at most 2S-1 inputs, half of 1F1B's ticks) or `ZeroBubbleH1()` (1F1B's order with each
  backward split into B, the input gradient sent upstream at once, and W, the weight gradient, deferred
  into the bubbles; W recomputes the stage's forward from the stashed input and output cotangent); all
  send the same bytes and give the same numbers. `Interleaved(chunks=V)` (interleaved 1F1B): the pipeline's
  S V stages cut into chunks, device d holding chunks d, d+S, ... (its rows [S, V, ...]), boundaries on a ring;
  its bubble (S-1)/(VM+S-1) against 1F1B's (S-1)/(M+S-1); its eval steps run the forwards of interleaved GPipe
  (VM+S-1 ticks); each chunk has its own data-parallel error rows (`grad_state` [S, V, D, P]).
  `remat="stage"` (default) saves a stage's input per microbatch and recomputes the stage in
  its explicit backward (`StageRunner.run_explicit`); `remat="none"` (GPipe only) differentiates
  the forward schedule with autodiff, which saves every stage's internals.
  A schedule's `forwarding_delay=2` (`Schedule.with_overlapped_sends()`: train steps of every schedule,
  `remat="stage"`): overlapped sends, MaxText's delayed activation forwarding: a payload encoded at tick t
  crosses its link during tick t+1 while the stages compute, and is decoded at t+2 where it is used (S-1 more
  ticks each way, S V - 1 with interleaved 1F1B; M >= 2S microbatches); the same bytes and numbers. Eval steps
  run without it.
  """
  mesh: jax.sharding.Mesh
  grad_scheme: Any = None
  remat: str = "stage"
  schedule: schedules.Schedule = schedules.GPipe()
  # (pipe, optimizer, batch shapes) -> its StateLayout, built once (an abstract trace of the initial state)
  layouts: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

  def __post_init__(self):
    g = self.grad_scheme
    if g is not None and not schemes.sender_only(g):
      raise ValueError(f"grad_scheme must be a Plain or EF scheme (no receiver state), got {g!r}")
    if self.remat not in REMAT:
      raise ValueError(f"remat must be one of {REMAT}, got {self.remat!r}")
    if not isinstance(self.schedule, schedules.Schedule):
      raise ValueError(f"schedule must be a `schedules.Schedule` (e.g. schedules.OneFOneB(), or "
                       f"schedules.parse('1f1b')), got {self.schedule!r}")
    if not isinstance(self.schedule, schedules.GPipe) and self.remat == "none":
      raise ValueError(f"the {self.schedule.name} schedule always recomputes a stage from its stashed input; "
                       "use remat='stage'")
    if self.schedule.overlapped_sends and self.remat == "none":
      raise ValueError("overlapped sends run the explicit backward (remat='stage'); remat='none' differentiates "
                       "GPipe's forward ticks, whose messages cannot wait a tick: use remat='stage'")

  @property
  def num_stages(self) -> int:
    return self.mesh.shape[STAGE]

  @property
  def data(self) -> int:
    return self.mesh.shape[DATA]

  @property
  def chunks(self) -> int:
    """V: the chunks (consecutive stages of the model) each stage device holds, chunk c on device c mod S."""
    return self.schedule.chunks_per_device

  def _check(self, pipe: pipeline.Pipeline, optimizer=None):
    if pipe.num_stages != self.schedule.model_stages(self.num_stages):
      per = f" x {self.chunks} chunks per device (schedule {self.schedule.name})" if self.chunks > 1 else ""
      raise ValueError(f"the model has {pipe.num_stages} stages but the mesh's stage axis has "
                       f"{self.num_stages} devices{per}")
    self.schedule.check(self.num_stages, pipe.microbatches)
    dataparallel.check_optimizer(optimizer, self.grad_scheme)
    if pipe.tied_scheme is not None:
      one_device = [(a, b) for (a, _), (b, _) in pipe.tied if a % self.num_stages == b % self.num_stages]
      if one_device:
        raise ValueError(f"tied pairs of stages {one_device} are held by one stage device: nothing to compress "
                         "there; use tied_scheme=None")

  def local_batch(self, batch):
    """Shapes of one data shard's share of a global batch (arrays or ShapeDtypeStructs): B/D examples."""
    b = jax.tree.leaves(batch)[0].shape[0]
    if b % self.data:
      raise ValueError(f"batch size {b} does not split over {self.data} data shards")
    return pipeline.microbatch_shapes(batch, self.data)

  def state_layout(self, pipe: pipeline.Pipeline, optimizer, batch) -> StateLayout:
    """The state layout of this mesh for `pipe`, `optimizer` and global batches shaped like `batch`: built the
    first time the executor is bound to them, then read by every method that takes them."""
    shapes = tuple((tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves(batch))
    key = (id(pipe), id(optimizer), shapes)
    bound = self.layouts.get(key)
    if bound is None or bound[0] is not pipe or bound[1] is not optimizer:  # ids of objects gone may be reused
      self.local_batch(batch)
      bound = self.layouts[key] = (pipe, optimizer, StateLayout(pipe, optimizer, batch, self.num_stages, self.data,
                                                                self.grad_scheme, self.chunks))
    return bound[2]

  # ---------------------------------------------------------------- state
  def stack(self, pipe, optimizer, state: pipeline.TrainState, batch):
    """simulate-layout TrainState for the global `batch` -> sharded state. Every process passes the same
    state: it computes the rows on its host CPU and transfers only the slices its own devices hold, so
    nothing crosses between processes (one jitted program from the host state would: XLA partitions
    it into all-to-alls)."""
    self._check(pipe, optimizer)
    lay = self.state_layout(pipe, optimizer, batch)
    host = jax.device_get(state._replace(rng=jax.random.key_data(state.rng)))
    rows = jax.device_get(jax.jit(lay.stack)(jax.device_put(host, jax.local_devices(backend="cpu")[0])))
    placed = jax.tree.map(lambda a, sharding: jax.make_array_from_callback(a.shape, sharding, lambda i: a[i]),
                          rows, lay.shardings(self.mesh, rows))
    return placed._replace(rng=jax.random.wrap_key_data(placed.rng, impl=jax.random.key_impl(state.rng)))

  def rows_description(self, pipe, optimizer, batch) -> dict:
    """Executor protocol: checkpoints save the rows as they are (`StateRows.description`)."""
    return self.state_layout(pipe, optimizer, batch).description()

  def unstack(self, pipe, optimizer, flat_state, batch) -> pipeline.TrainState:
    """Sharded state -> simulate layout for the global `batch` (replicated arrays)."""
    lay = self.state_layout(pipe, optimizer, batch)
    return jax.jit(lay.unstack, out_shardings=NamedSharding(self.mesh, P()))(flat_state)

  def init_state(self, pipe: pipeline.Pipeline, optimizer: optax.GradientTransformation, rng, batch, params=None):
    """The train state, created sharded: device s initialises only stage s (rows of its
    parameters, model state and optimizer state). `params` (per-stage trees, e.g. pretrained
    weights) are read from the host instead."""
    self._check(pipe, optimizer)
    lay = self.state_layout(pipe, optimizer, batch)
    memory.check_aqsgd_memory(pipe.boundary, lay.shapes)
    if params is not None:
      return self.stack(pipe, optimizer, pipeline.init_state(pipe, optimizer, rng, batch, params), batch)
    build = lay.initializer(self.mesh, jax.random.key_impl(rng))
    key_data = jax.device_get(jax.random.key_data(rng))
    return jax.jit(build, out_shardings=lay.shardings(self.mesh, jax.eval_shape(build, key_data)))(key_data)

  def state_shapes(self, pipe: pipeline.Pipeline, optimizer: optax.GradientTransformation, batch):
    """ShapeDtypeStructs, with their shardings, of what `init_state` returns, traced abstractly: nothing
    is allocated and no memory is checked (executor protocol)."""
    self._check(pipe, optimizer)
    lay, key = self.state_layout(pipe, optimizer, batch), jax.random.key(0)
    shapes = jax.eval_shape(lay.initializer(self.mesh, jax.random.key_impl(key)), jax.random.key_data(key))
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes,
                        lay.shardings(self.mesh, shapes))

  # ---------------------------------------------------------------- steps
  def make_train_step(self, pipe: pipeline.Pipeline, optimizer: optax.GradientTransformation,
                      mode: Mode = Mode.TRAIN):
    """jit-compiled (state, batch) -> (state, metrics) over the mesh."""
    self._check(pipe, optimizer)
    if not mode.trains:
      raise ValueError(f"train step mode must be TRAIN, WARMUP or FIRST_VISIT, got {mode}")
    return self._cached(pipe, optimizer, mode, train=True)

  def make_eval_step(self, pipe: pipeline.Pipeline, compressed: bool):
    self._check(pipe)
    mode = Mode.EVAL_COMPRESSED if compressed else Mode.EVAL_UNCOMPRESSED
    return self._cached(pipe, None, mode, train=False)

  def wire_bytes_per_step(self, pipe, batch, mode: Mode = Mode.TRAIN) -> dict[str, int]:
    """Executor protocol: every data shard's pipeline bytes each way, its tied-parameter exchange
    (`tied`, when the pipeline ties parameters: `StateLayout.tied_bytes`), plus the gradient (or
    QuantizedAdam momentum) exchange; warm-up steps send everything dense (`pipeline.as_sent`)."""
    local = pipeline.boundary_bytes(pipeline.as_sent(pipe, mode), self.local_batch(batch))
    out = {k: v * self.data for k, v in local.items()}
    if pipe.tied:
      out["tied"] = self.data * self.state_layout(pipe, None, batch).tied_bytes()
    if self.data > 1:
      out["data"] = self.grad_wire_bytes(pipe, None, batch, dense=mode is Mode.WARMUP)
    return out

  def grad_wire_bytes(self, pipe, optimizer, batch, dense: bool = False) -> int:
    """Bytes all replicas send per step for the data-parallel gradient exchange (all stages);
    QuantizedAdam's momentum exchange sends the same [1, P] messages."""
    params = self.state_layout(pipe, optimizer, batch).params
    return dataparallel.exchange_bytes(self.grad_scheme, params.size, pipe.num_stages, self.data, dense)

  def collective_ways(self, mode: Mode = Mode.TRAIN) -> tuple[str, ...]:
    """Executor protocol: the pipeline's messages each way, the data-parallel exchange (a ring of permutes when
    compressed; the dense mean of warm-up and of `grad_scheme=None` an all-reduce under `mesh.DATA_EXCHANGE`) and
    the tied-parameter exchange (permutes under `mesh.TIED`)."""
    return ("fwd", "bwd", "data", "tied")

  def describe(self) -> str:
    return (f"sharded: {self.num_stages} stages x {self.data} data, schedule {self.schedule.name}"
            + (", overlapped sends" if self.schedule.overlapped_sends else ""))

  def batch_shapes(self, batch):
    """Executor protocol: `batch` split over the mesh's `data` axis."""
    sharding = NamedSharding(self.mesh, P(DATA))
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), batch)

  def trace_step(self, pipe, optimizer, mode: Mode, state, batch):
    """Executor protocol: the jitted step of `mode` for this batch shape, traced."""
    optimizer = optimizer if mode.trains else None
    self._check(pipe, optimizer)
    lay = self.state_layout(pipe, optimizer, batch)
    return self._step(lay, optimizer, mode, mode.trains, state).trace(state, batch)

  def _cached(self, pipe, optimizer, mode, train):
    cache = {}

    def step(state, batch):
      key = tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(batch))
      if key not in cache:
        lay = self.state_layout(pipe, optimizer, batch)
        if train:
          lay.optimizer.check(state.opt_state, warmup=mode is Mode.WARMUP)
        cache[key] = self._step(lay, optimizer, mode, train, state)
      return cache[key](state, batch)

    return step

  def _step(self, lay: StateLayout, optimizer, mode, train, state):
    pipe, local = lay.pipe, lay.local_batch
    m_count, scale = pipe.microbatches, 1 / (pipe.microbatches * self.data)
    explicit = train and self.remat == "stage"
    # train steps run the schedule's table; eval steps (and GPipe with remat="none") its forward ticks
    table = (self.schedule.train_table if explicit else self.schedule.eval_table)(self.num_stages, m_count)
    runner_class = (AutodiffRunner if train and not explicit else OverlappedRunner if table.overlapped_sends
                    else StageRunner)
    runner = runner_class(pipe, lay.template, local, mode, train, table)
    exchange = dataparallel.exchange_for(optimizer, self.grad_scheme, warmup=mode is Mode.WARMUP)
    total = lambda v: jax.lax.pmean(jax.lax.psum(v, STAGE), DATA)
    mine = lambda tree: jax.tree.map(lambda a: a[0], tree)  # this device's block
    mean = lambda out: (out.loss_sum / m_count, jax.tree.map(lambda v: v / m_count, out.metric_sums))

    def device_step(state, batch):
      step_key = jax.random.fold_in(state.rng, state.step)
      mbs = pipeline.split_microbatches(batch, m_count)
      fwd = (mine(state.links.fwd_send), mine(state.links.fwd_recv))
      bwd = (mine(state.links.bwd_send), mine(state.links.bwd_recv))

      def loss_of(params_row, bwd):
        out = runner.run_forward(params_row, state.model_state[0], fwd, bwd, mbs, step_key)
        loss, metrics = mean(out)
        # / D: the boundary gradients of this shard's microbatches are those of the global mean loss
        return loss / self.data, (loss, metrics, out.model_state, out.fwd_tables)

      chunk_rows = lambda row: row.reshape(self.chunks, row.shape[-1])  # this device's [V, P]; [1, P] when V = 1
      if not train:
        loss, metrics = mean(runner.run_explicit(chunk_rows(state.params[0]), chunk_rows(state.model_state[0]),
                                                 fwd, bwd, mbs, step_key, None))
        return jax.tree.map(total, {"loss": loss, **metrics})
      if explicit:
        out = runner.run_explicit(chunk_rows(state.params[0]), chunk_rows(state.model_state[0]), fwd, bwd, mbs,
                                  step_key, jnp.asarray(scale, jnp.float32))
        (loss, metrics), ms, fwd, grads, bwd = mean(out), out.model_state, out.fwd_tables, out.grads, out.bwd_tables
      else:
        (_, (loss, metrics, ms, fwd)), (grads, bwd) = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)(
            state.params[0], bwd)
      chunks = lay.chunks_of(jax.lax.axis_index(STAGE))  # this device's stage, or its chunks' [V]
      at = dataparallel.StageStep(chunks, jax.random.fold_in(step_key, 2), lay.real(chunks),
                                  lambda g, tied: lay.finish(g, tied, step_key), lay.device_optimizer,
                                  mine(state.tied_state))
      params_row, opt, grad_state, tied = exchange(grads.reshape(state.params.shape[1:]), mine(state.opt_state),
                                                   state.params[0], state.grad_state, at)
      ms = jax.lax.pmean(ms, DATA).reshape(state.model_state.shape[1:])  # BatchNorm statistics synchronised
      add = lambda tree: jax.tree.map(lambda a: a[None], tree)
      links = LinkState(add(fwd[0]), add(fwd[1]), add(bwd[0]), add(bwd[1]))
      new_state = pipeline.TrainState(state.step + 1, state.rng, params_row[None], ms[None], add(opt), links,
                                      grad_state, add(tied))
      return new_state, jax.tree.map(total, {"loss": loss, **metrics})

    state_specs = StateLayout.specs(state)
    batch_specs = jax.tree.map(lambda _: P(DATA), local)
    mapped = jax.shard_map(device_step, mesh=self.mesh, in_specs=(state_specs, batch_specs),
                           out_specs=(state_specs, P()) if train else P(), check_vma=False)
    return jax.jit(mapped, donate_argnums=0 if train else ())

