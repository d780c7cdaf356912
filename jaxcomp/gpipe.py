"""GPipe across devices: stages on a `stage` mesh axis, compressed payloads on `ppermute`.

Mesh axes ("data", "stage"). Device (d, s) runs stage s on data shard d. Per device, every
per-stage quantity is a zero-padded row (`layout.FlatRows`), so that one stage-sharded
array holds all of them (heterogeneous stages):
  params [S, P], model state [S, Q], optimizer state [S, O]    (sharded on stage)
  link tables [S, D*rows, F]: device s holds the forward-sender / backward-receiver rows of
  boundary s and the forward-receiver / backward-sender rows of boundary s-1; a batch-slot
  table's rows are split over the data shards, a per-example (AQ-SGD) table is held whole
  by every data shard.
The step runs a schedule of `jaxcomp.schedule` under `jax.shard_map` (GPipe or 1F1B with
explicit backward ticks; or GPipe's forward differentiated by autodiff with `remat="none"`);
every schedule sends exactly M x sum_b wire_bytes(b) each way per data shard. Each data shard
differentiates its mean loss / D, so its boundary gradients equal those of `simulate` at
the global batch, and the weight gradients are summed over `data` (densely, or compressed
by `grad_scheme`, see `dataparallel`); the optimizer runs per stage. With a
`qadam.QuantizedAdam` optimizer the replicas exchange Adam's first moment instead.
Numerics (keys, state rows, microbatch order) equal `simulate`'s.
"""
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxcomp import dataparallel, feedback, hlo_bytes, layout, pipeline as pl, schedule
from jaxcomp.boundary import LinkState, Mode
from jaxcomp.qadam import QuantizedAdam

STAGE, DATA = schedule.STAGE, dataparallel.DATA
SCHEDULES = schedule.SCHEDULES


def make_mesh(num_stages: int, data: int = 1, devices=None) -> jax.sharding.Mesh:
  """A (data, stage) mesh, topology-aware where the platform tells (`jax.make_mesh`):
  stage neighbours are physical neighbours; a clear error when there are too few devices."""
  devices = jax.devices() if devices is None else list(devices)
  if num_stages < 1 or data < 1:
    raise ValueError(f"mesh needs stages >= 1 and data >= 1, got stages={num_stages}, data={data}")
  if num_stages * data > len(devices):
    raise ValueError(f"a mesh of {data} data x {num_stages} stages needs {num_stages * data} devices, "
                     f"but only {len(devices)} are available")
  auto = (jax.sharding.AxisType.Auto,) * 2
  return jax.make_mesh((data, num_stages), (DATA, STAGE), axis_types=auto,
                       devices=devices[: num_stages * data])


def _abstract_template(pipe, optimizer, batch):
  """The simulate-layout TrainState's shapes (no real initialisation)."""
  opt = optimizer or optax.identity()
  return jax.eval_shape(lambda b: pl.init_state(pipe, opt, jax.random.key(0), b), batch)


def _table_keyed(pipe, field: str) -> bool:
  """Whether a LinkState field has one row per example (AQ-SGD forward state)."""
  return field.startswith("fwd") and pipe.boundary.fwd.keyed_by_example


_OWNER = {"fwd_send": 0, "bwd_recv": 0, "fwd_recv": 1, "bwd_send": 1}  # boundary of stage s: s - offset


@dataclasses.dataclass(frozen=True)
class GPipe:
  """The sharded executor: `init_state`, `make_train_step`, `make_eval_step` as `simulate`.

  `grad_scheme` (Plain or EF around a codec, e.g. `parse_scheme("ef+quant:4")`) compresses the
  data-parallel weight-gradient exchange; warm-up steps (Mode.WARMUP) exchange dense gradients.
  With the optimizer `qadam.QuantizedAdam` it compresses Adam's first moment instead (Adam's
  second moment is frozen after warm-up). Its `opt_state` is a QuantizedAdamState of [S] step
  counts and [S, P] moment rows (the same on every replica); each replica's EF error is its row
  of `grad_state`. Padding has zero gradient, moments and (masked) exchanged momentum, so it
  stays exactly zero. Ties and clipping apply to each replica's local gradient after warm-up
  (the mean gradient is never formed), to the mean one during warm-up.
  `schedule` (`schedule.timing`): "gpipe" (all forwards, then all backwards: M microbatch
  inputs saved per stage), "1f1b" (PipeDream-flush: one forward or backward per stage per
  tick, at most S inputs saved whatever M) or "1f1b-fused" (a forward and a backward per
  stage per tick: at most 2S-1 inputs, half of 1f1b's ticks); all send the same bytes and
  give the same numbers.
  `remat="stage"` (default) saves a stage's input per microbatch and recomputes the stage in
  its explicit backward (`schedule.run_explicit`); `remat="none"` (GPipe only) differentiates
  the forward schedule with autodiff, which saves every stage's internals.
  """
  mesh: jax.sharding.Mesh
  grad_scheme: Any = None
  remat: str = "stage"
  schedule: str = "gpipe"

  def __post_init__(self):
    g = self.grad_scheme
    if g is not None and (not isinstance(g, feedback.Scheme) or type(g) not in (feedback.Plain, feedback.EF)):
      raise ValueError(f"grad_scheme must be a Plain or EF scheme (no receiver state), got {g!r}")
    if self.remat not in schedule.REMAT:
      raise ValueError(f"remat must be one of {schedule.REMAT}, got {self.remat!r}")
    if self.schedule not in SCHEDULES:
      raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
    if self.schedule != "gpipe" and self.remat == "none":
      raise ValueError(f"the {self.schedule} schedule always recomputes a stage from its stashed input; "
                       "use remat='stage'")

  @property
  def num_stages(self) -> int:
    return self.mesh.shape[STAGE]

  @property
  def data(self) -> int:
    return self.mesh.shape[DATA]

  def _check(self, pipe: pl.Pipeline, optimizer=None):
    if pipe.num_stages != self.num_stages:
      raise ValueError(f"the model has {pipe.num_stages} stages but the mesh's stage axis has "
                       f"{self.num_stages} devices")
    if isinstance(optimizer, QuantizedAdam) and self.grad_scheme is None:
      raise ValueError("QuantizedAdam exchanges Adam's first moment compressed by grad_scheme, but this GPipe "
                       "has grad_scheme=None; pass e.g. grad_scheme=parse_scheme('ef+quant:4') ('none' for an "
                       "uncompressed exchange), or use optax.adam")

  def local_batch(self, batch):
    """Shapes of one data shard's share of a global batch (arrays or ShapeDtypeStructs): B/D examples."""
    b = jax.tree.leaves(batch)[0].shape[0]
    if b % self.data:
      raise ValueError(f"batch size {b} does not split over {self.data} data shards")
    return pl.microbatch_shapes(batch, self.data)

  # ---------------------------------------------------------------- state layout
  def shardings(self, flat_state):
    stage = NamedSharding(self.mesh, P(STAGE))
    rows = NamedSharding(self.mesh, P(STAGE, DATA))
    replicated = NamedSharding(self.mesh, P())
    return pl.TrainState(replicated, replicated, stage, stage,
                         jax.tree.map(lambda _: stage, flat_state.opt_state),
                         jax.tree.map(lambda _: rows, flat_state.links),
                         jax.tree.map(lambda _: rows, flat_state.grad_state))

  def _tables(self, pipe, links, f_max):
    """Per-boundary LinkStates (global batch) -> [S, D*rows, F] tables, one per field."""
    def table(field):
      def leaf(*per_boundary):
        keyed = _table_keyed(pipe, field)
        rows, dtype = per_boundary[0].shape[0], per_boundary[0].dtype
        blocks = []
        for s in range(self.num_stages):
          b = s - _OWNER[field]
          block = jnp.zeros((rows, f_max), dtype)
          if 0 <= b < len(per_boundary):
            flat = per_boundary[b].reshape(rows, -1)
            block = block.at[:, : flat.shape[1]].set(flat)
          blocks.append(self._example_copies(block) if keyed else block)
        return jnp.stack(blocks)
      parts = [getattr(link, field) for link in links]
      return jax.tree.map(leaf, *parts) if parts else ()
    return LinkState(*(table(f) for f in LinkState._fields))

  def _example_copies(self, table):
    """A per-example [rows, F] table -> [D*rows, F]: data shard d's copy holds the rows of its
    own examples (`pl.example_shard`) and zeros elsewhere, as training leaves it."""
    owner = pl.example_shard(jnp.arange(table.shape[0]), self.data)
    return jnp.concatenate([jnp.where((owner == d)[:, None], table, jnp.zeros_like(table)) for d in range(self.data)])

  def _example_rows(self, copies):
    """Inverse of `_example_copies`: each example's row from the shard that owns it."""
    rows = copies.shape[0] // self.data
    owner = pl.example_shard(jnp.arange(rows), self.data)
    return copies.reshape(self.data, rows, -1)[owner, jnp.arange(rows)]

  def _untables(self, pipe, tables, like_links):
    """Inverse of `_tables`."""
    out = []
    for b, link in enumerate(like_links):
      def field(name):
        s = b + _OWNER[name]
        keyed = _table_keyed(pipe, name)
        def leaf(t, like):
          t = self._example_rows(t[s]) if keyed else t[s]
          return t[: like.shape[0], : layout.feature_size(like.shape)].reshape(like.shape).astype(like.dtype)
        return jax.tree.map(leaf, getattr(tables, name), getattr(link, name))
      out.append(LinkState(*(field(f) for f in LinkState._fields)))
    return tuple(out)

  def _grad_template(self, params_fl):
    return self.grad_scheme.init_sender(1, (params_fl.size,), jnp.float32)

  def _opt_rows(self, optimizer, params_fl, per_stage):
    """Per-stage optimizer states -> stage rows."""
    if isinstance(optimizer, QuantizedAdam):  # moments are rows like the parameters
      rows = [st._replace(mu=params_fl.put(s, st.mu), nu=params_fl.put(s, st.nu)) for s, st in enumerate(per_stage)]
      return jax.tree.map(lambda *r: jnp.stack(r), *rows)
    return layout.FlatRows(per_stage).stack(per_stage)

  def _layout(self, pipe, optimizer, batch):
    """(template, params rows, model-state rows, per-stage optimizer template, widest activation)."""
    template = _abstract_template(pipe, optimizer, batch)
    mb = pl.microbatch_shapes(self.local_batch(batch), pipe.microbatches)
    shapes = pl.boundary_shapes(pipe, template.params, template.model_state, mb[pipe.input_key])
    f_max = max([layout.feature_size(s.shape) for s in shapes] or [1])
    return template, layout.FlatRows(template.params), layout.FlatRows(template.model_state), shapes, f_max

  def stack(self, pipe, optimizer, state: pl.TrainState, batch):
    """simulate-layout TrainState for the global `batch` -> sharded executor state.

    Runs as one jitted program whose outputs are created sharded; the input state is read
    from host memory, so this works when the mesh spans several processes (every process
    passes the same state)."""
    self._check(pipe, optimizer)
    template, params_fl, ms_fl, _, f_max = self._layout(pipe, optimizer, batch)
    host = jax.device_get(state._replace(rng=jax.random.key_data(state.rng)))
    impl = jax.random.key_impl(state.rng)

    def build(st):
      opt_state = ()
      if optimizer is not None:
        opt_state = self._opt_rows(optimizer, params_fl, layout.split_by_stage(st.opt_state, st.params))
      grad_state = ()
      if self.grad_scheme is not None:
        grad_state = self._grad_rows(params_fl, st.grad_state)
      return pl.TrainState(st.step, jax.random.wrap_key_data(st.rng, impl=impl), params_fl.stack(st.params),
                           ms_fl.stack(st.model_state), opt_state, self._tables(pipe, st.links, f_max), grad_state)

    shapes = jax.eval_shape(build, host)
    return jax.jit(build, out_shardings=self.shardings(shapes))(host)

  def _grad_rows(self, params_fl, canonical):
    """grad_state: per stage, trees with a leading [D] axis -> [S, D, P] rows (zeros if ())."""
    template = self._grad_template(params_fl)
    if canonical == ():
      return jax.tree.map(lambda r: jnp.tile(r[None], (self.num_stages, self.data, 1)), template)
    leaves = jax.tree.structure(template).flatten_up_to(canonical)
    rows = [jnp.stack([jax.vmap(lambda t, s=s: params_fl.put(s, t))(per_stage[s]) for s in range(self.num_stages)])
            for per_stage in leaves]
    return jax.tree.unflatten(jax.tree.structure(template), rows)

  def unstack(self, pipe, optimizer, flat_state, batch) -> pl.TrainState:
    """Sharded executor state -> simulate layout for the global `batch` (replicated arrays).

    The optimizer state is the real one, in `optimizer.init(params)`'s structure (also
    QuantizedAdam's); `grad_state` holds per stage a tree of [D, ...] error rows. A
    per-example (AQ-SGD) table takes each example's row from the shard that owns it."""
    template, params_fl, ms_fl, _, _ = self._layout(pipe, optimizer, batch)

    def build(flat):
      params = params_fl.unstack(flat.params)
      opt_state = ()
      if optimizer is not None:
        opt_tmpl = [optimizer.init(p) for p in template.params]
        if isinstance(optimizer, QuantizedAdam):
          per_stage = [qadam_stage_state(flat.opt_state, s, params_fl) for s in range(self.num_stages)]
        else:
          opt_fl = layout.FlatRows(opt_tmpl)
          per_stage = list(opt_fl.unstack(flat.opt_state))
        opt_state = layout.merge_stages(tuple(per_stage), params)
      grad_state = ()
      if self.grad_scheme is not None:
        tmpl = self._grad_template(params_fl)
        rows = jax.tree.leaves(flat.grad_state)
        canonical = [tuple(jax.vmap(lambda r, s=s: params_fl.get(s, r))(leaf[s]) for s in range(self.num_stages))
                     for leaf in rows]
        grad_state = jax.tree.unflatten(jax.tree.structure(tmpl), canonical)
      return pl.TrainState(flat.step, flat.rng, params, ms_fl.unstack(flat.model_state), opt_state,
                           self._untables(pipe, flat.links, template.links), grad_state)

    return jax.jit(build, out_shardings=NamedSharding(self.mesh, P()))(flat_state)

  def init_state(self, pipe: pl.Pipeline, optimizer: optax.GradientTransformation, rng, batch, params=None):
    """The train state, created sharded: device s initialises only stage s (rows of its
    parameters, model state and optimizer state); no device holds the whole model.

    `params` (per-stage trees, e.g. pretrained weights) are read from the host instead."""
    self._check(pipe, optimizer)
    self.local_batch(batch)
    pl.check_aqsgd_memory(pipe.boundary, self._layout(pipe, optimizer, batch)[3])
    if params is not None:
      return self.stack(pipe, optimizer, pl.init_state(pipe, optimizer, rng, batch, params), batch)
    build = self._initializer(pipe, optimizer, jax.random.key_impl(rng), batch)
    key_data = jax.device_get(jax.random.key_data(rng))
    return jax.jit(build, out_shardings=self.shardings(jax.eval_shape(build, key_data)))(key_data)

  def state_shapes(self, pipe: pl.Pipeline, optimizer: optax.GradientTransformation, batch):
    """ShapeDtypeStructs, with their shardings, of what `init_state` returns, traced abstractly: nothing
    is allocated and no memory is checked (for compiling ahead of time for a target, `jaxcomp.dryrun`)."""
    self._check(pipe, optimizer)
    key = jax.random.key(0)
    build = self._initializer(pipe, optimizer, jax.random.key_impl(key), batch)
    shapes = jax.eval_shape(build, jax.random.key_data(key))
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes,
                        self.shardings(shapes))

  def _initializer(self, pipe, optimizer, impl, batch):
    """key data -> the sharded train state (device s initialises stage s's rows)."""
    template, params_fl, ms_fl, shapes, f_max = self._layout(pipe, optimizer, batch)
    inputs = [pl.microbatch_shapes(self.local_batch(batch), pipe.microbatches)[pipe.input_key], *shapes]
    qadam = isinstance(optimizer, QuantizedAdam)
    opt_fl = None if qadam else layout.FlatRows([optimizer.init(p) for p in template.params])

    def stage_rows(init_rng):
      s = jax.lax.axis_index(STAGE)

      def init(j):
        def run():
          p, ms = pipe.stages[j].init(jax.random.fold_in(init_rng, j), jnp.zeros(inputs[j].shape, inputs[j].dtype))
          return params_fl.put(j, p), ms_fl.put(j, ms)
        return run

      p_row, ms_row = jax.lax.switch(s, [init(j) for j in range(self.num_stages)])
      p_row = tie_rows(pipe, params_fl, p_row, s)
      if qadam:
        opt = optimizer.init(jnp.zeros((params_fl.size,), params_fl.dtype))
      else:
        opt = jax.lax.switch(s, [lambda j=j: opt_fl.put(j, optimizer.init(params_fl.get(j, p_row)))
                                 for j in range(self.num_stages)])
      return jax.tree.map(lambda a: a[None], (p_row, ms_row, opt))

    def build(key_data):
      init_rng, state_rng = jax.random.split(jax.random.wrap_key_data(key_data, impl=impl))
      rows = jax.shard_map(stage_rows, mesh=self.mesh, in_specs=P(), out_specs=P(STAGE), check_vma=False)
      p_rows, ms_rows, opt_rows = rows(init_rng)
      batch_size = jax.tree.leaves(batch)[0].shape[0]
      links = tuple(pipe.boundary.init(batch_size, x.shape[1:], x.dtype) for x in shapes)
      grad_state = self._grad_rows(params_fl, ()) if self.grad_scheme is not None else ()
      return pl.TrainState(jnp.zeros((), jnp.int32), state_rng, p_rows, ms_rows, opt_rows,
                           self._tables(pipe, links, f_max), grad_state)

    return build

  # ---------------------------------------------------------------- steps
  def make_train_step(self, pipe: pl.Pipeline, optimizer: optax.GradientTransformation,
                      mode: Mode = Mode.TRAIN):
    """jit-compiled (state, batch) -> (state, metrics) over the mesh."""
    self._check(pipe, optimizer)
    if not mode.trains:
      raise ValueError(f"train step mode must be TRAIN, WARMUP or FIRST_VISIT, got {mode}")
    return self._cached(pipe, optimizer, mode, train=True)

  def make_eval_step(self, pipe: pl.Pipeline, compressed: bool):
    self._check(pipe)
    mode = Mode.EVAL_COMPRESSED if compressed else Mode.EVAL_UNCOMPRESSED
    return self._cached(pipe, None, mode, train=False)

  def wire_bytes_per_step(self, pipe, batch, mode: Mode = Mode.TRAIN) -> dict[str, int]:
    """Executor protocol: every data shard's pipeline bytes each way, plus the gradient (or
    QuantizedAdam momentum) exchange; warm-up steps send everything dense (`pipeline.as_sent`)."""
    warm = mode is Mode.WARMUP
    local = pl.wire_bytes_per_step(pl.as_sent(pipe, mode), None, self.local_batch(batch))
    out = {k: v * self.data for k, v in local.items()}
    if self.data > 1:
      out["data"] = self.grad_wire_bytes(pipe, optax.identity(), batch, dense=warm)
    return out

  def grad_wire_bytes(self, pipe, optimizer, batch, dense: bool = False) -> int:
    """Bytes all replicas send per step for the data-parallel gradient exchange (all stages);
    QuantizedAdam's momentum exchange sends the same [1, P] messages."""
    params = layout.FlatRows(_abstract_template(pipe, optimizer, self.local_batch(batch)).params)
    return dataparallel.exchange_bytes(self.grad_scheme, params.size, self.num_stages, self.data, dense)

  def collective_bytes(self, hlo_text: str) -> dict[str, int]:
    """Bytes the collectives of a compiled program of this mesh send per call: fwd, bwd, data (`hlo_bytes`)."""
    return hlo_bytes.collective_bytes(hlo_text, self.num_stages)

  def compiled_text(self, pipe, optimizer, state, batch, mode: Mode = Mode.TRAIN) -> str:
    """HLO of the compiled train step for this batch shape (for wire accounting)."""
    return self.lowered(pipe, optimizer, state, batch, mode).compile().as_text()

  def lowered(self, pipe, optimizer, state, batch, mode: Mode = Mode.TRAIN):
    """The lowered train step (`.compile()`, `.compile().memory_analysis()`, ...)."""
    self._check(pipe, optimizer)
    return self.build_step(pipe, optimizer, mode, True, state, batch).lower(state, batch)

  def _cached(self, pipe, optimizer, mode, train):
    cache = {}

    def step(state, batch):
      key = tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(batch))
      if key not in cache:
        if isinstance(optimizer, QuantizedAdam) and mode is not Mode.WARMUP and not int(state.opt_state.nu_count[0]):
          raise ValueError("QuantizedAdam freezes Adam's second moment after warm-up, but this state has had "
                           "no warm-up step (v = 0): run Mode.WARMUP steps first")
        cache[key] = self.build_step(pipe, optimizer, mode, train, state, batch)
      return cache[key](state, batch)

    return step

  def build_step(self, pipe, optimizer, mode, train, state, batch):
    """The jitted step for this batch shape (state and batch give the shapes)."""
    local = self.local_batch(batch)
    template = _abstract_template(pipe, optimizer, local)
    s_count, d_count, m_count = self.num_stages, self.data, pipe.microbatches
    explicit = train and self.remat == "stage"
    timing = schedule.timing(self.schedule, s_count, m_count) if explicit else schedule.Timing()
    prog = schedule.make_program(pipe, template, local, mode, train, timing)
    params_fl = prog.params
    qadam = isinstance(optimizer, QuantizedAdam)
    opt_fl = layout.FlatRows([optimizer.init(p) for p in template.params]) if optimizer and not qadam else None
    total = lambda v: jax.lax.pmean(jax.lax.psum(v, STAGE), DATA)

    def device_step(state, batch):
      step_key = jax.random.fold_in(state.rng, state.step)
      mbs = pl.split_microbatches(batch, m_count)
      mine = lambda tree: jax.tree.map(lambda a: a[0], tree)  # this device's block
      fwd = (mine(state.links.fwd_send), mine(state.links.fwd_recv))
      bwd = (mine(state.links.bwd_send), mine(state.links.bwd_recv))

      def loss_of(params_row, bwd):
        out = schedule.run_gpipe(prog, params_row, state.model_state[0], fwd, bwd, mbs, step_key)
        loss = out.loss_sum / m_count
        metrics = jax.tree.map(lambda v: v / m_count, out.metric_sums)
        # / D: the boundary gradients of this shard's microbatches are those of the global mean loss
        return loss / d_count, (loss, metrics, out.model_state, out.fwd_tables)

      if not train:
        _, (loss, metrics, _, _) = loss_of(state.params[0], bwd)
        return jax.tree.map(total, {"loss": loss, **metrics})

      if explicit:
        out = schedule.run_explicit(prog, state.params[0], state.model_state[0], fwd, bwd, mbs, step_key,
                                    jnp.asarray(1 / (m_count * d_count), jnp.float32))
        loss, metrics = out.loss_sum / m_count, jax.tree.map(lambda v: v / m_count, out.metric_sums)
        ms, fwd, grads, bwd = out.model_state, out.fwd_tables, out.grads, out.bwd_tables
      else:
        (_, (loss, metrics, ms, fwd)), (grads, bwd) = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)(
            state.params[0], bwd)
      grad_state, opt = state.grad_state, mine(state.opt_state)
      s, key = jax.lax.axis_index(STAGE), jax.random.fold_in(step_key, 2)
      real = jnp.arange(params_fl.size) < jnp.asarray(params_fl.sizes)[s]  # not this stage row's padding
      dense = self.grad_scheme is None or mode is Mode.WARMUP
      if dense:
        grads = jax.lax.psum(grads, DATA)
      else:
        grads = grads * d_count  # this replica's own mean gradient
        if not qadam:
          grads, grad_state = dataparallel.compressed_mean(self.grad_scheme, grads, grad_state, key, real)
      grads = finish_grads(pipe, params_fl, grads, s)
      if qadam and dense:
        params_row, opt = optimizer.dense_update(grads, opt, state.params[0])
      elif qadam:  # the replicas exchange the first moment
        mu, grad_state = dataparallel.compressed_mean(self.grad_scheme, optimizer.local_momentum(grads, opt),
                                                      grad_state, key, real)  # decoded padding need not be 0:
        params_row, opt = optimizer.frozen_update(jnp.where(real, mu, 0.0), opt, state.params[0])
      else:
        def update(j):
          def run(params_row, grads_row, opt_row):
            p, g, o = params_fl.get(j, params_row), params_fl.get(j, grads_row), opt_fl.get(j, opt_row)
            updates, o = optimizer.update(g, o, p)
            return params_fl.put(j, optax.apply_updates(p, updates)), opt_fl.put(j, o)
          return run

        params_row, opt = jax.lax.switch(s, [update(j) for j in range(s_count)], state.params[0], grads, opt)
      ms = jax.lax.pmean(ms, DATA)  # BatchNorm running statistics synchronised over data shards
      add = lambda tree: jax.tree.map(lambda a: a[None], tree)
      links = LinkState(add(fwd[0]), add(fwd[1]), add(bwd[0]), add(bwd[1]))
      new_state = pl.TrainState(state.step + 1, state.rng, params_row[None], ms[None], add(opt), links, grad_state)
      return new_state, jax.tree.map(total, {"loss": loss, **metrics})

    state_specs = pl.TrainState(P(), P(), P(STAGE), P(STAGE), jax.tree.map(lambda _: P(STAGE), state.opt_state),
                                jax.tree.map(lambda _: P(STAGE, DATA), state.links),
                                jax.tree.map(lambda _: P(STAGE, DATA), state.grad_state))
    batch_specs = jax.tree.map(lambda _: P(DATA), batch)
    out_specs = (state_specs, P()) if train else P()
    mapped = jax.shard_map(device_step, mesh=self.mesh, in_specs=(state_specs, batch_specs),
                           out_specs=out_specs, check_vma=False)
    return jax.jit(mapped, donate_argnums=0 if train else ())


def qadam_stage_state(rows, s, params_fl):
  """Stage s's QuantizedAdamState (moments as parameter trees) from the [S, ...] rows."""
  return rows._replace(count=rows.count[s], nu_count=rows.nu_count[s], mu=params_fl.get(s, rows.mu[s]),
                       nu=params_fl.get(s, rows.nu[s]))


def tie_rows(pipe, params_fl, row, s):
  """Tied parameters start equal: each pair's second member takes the first's value (a psum
  over stages of the first member's segment)."""
  for (sa, pa), (sb, pb) in pipe.tied:
    (oa, n), (ob, _) = params_fl.leaf_span(sa, pa), params_fl.leaf_span(sb, pb)
    first = jax.lax.psum(jnp.where(s == sa, row[oa: oa + n], 0), STAGE)
    row = jnp.where(s == sb, row.at[ob: ob + n].set(first), row)
  return row


def finish_grads(pipe, params_fl, grads_row, s):
  """Ties (psum of each tied segment over its two stages) and global-norm clipping."""
  for (sa, pa), (sb, pb) in pipe.tied:
    (oa, n), (ob, _) = params_fl.leaf_span(sa, pa), params_fl.leaf_span(sb, pb)
    mine = jnp.where(s == sa, grads_row[oa: oa + n], jnp.where(s == sb, grads_row[ob: ob + n], 0.0))
    total = jax.lax.psum(mine, STAGE)
    grads_row = jnp.where(s == sa, grads_row.at[oa: oa + n].set(total),
                          jnp.where(s == sb, grads_row.at[ob: ob + n].set(total), grads_row))
  if pipe.grad_clip_norm is not None:
    grads_row = grads_row * pl.clip_factor(jax.lax.psum(jnp.sum(jnp.square(grads_row)), STAGE),
                                           pipe.grad_clip_norm)
  return grads_row
