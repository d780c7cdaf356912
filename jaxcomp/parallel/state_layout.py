"""The sharded executor's state: the simulate layout's TrainState as stage rows and link tables.

Per device (d, s) of the (data, stage) mesh, every per-stage quantity is a zero-padded row
(`padded_rows.FlatRows`), so that one stage-sharded array holds all of them:
  params [S, P], model state [S, Q], optimizer state [S, O]    (sharded on stage);
  with V > 1 chunks per device (interleaved schedules) [S, V, P] etc.: device d holds chunks d, d+S, ...
  link tables [S, D*rows, F] ([S, V, D*rows, F]): chunk c holds the forward-sender / backward-receiver
  rows of boundary c and the forward-receiver / backward-sender rows of boundary c-1; a batch-slot
  table's rows are split over the data shards, a per-example (AQ-SGD) table is held whole
  by every data shard (shard d's copy holds its own examples' rows, zeros elsewhere).
  grad_state [S, D, P] ([S, V, D, P]): each replica's error row of the data-parallel exchange.
  tied_state, per tied pair, [S, D, n]: each replica's state of the compressed tied exchange of the member
  its stage device holds (zeros on the devices that hold neither member).
`StateRows` converts between the simulate layout and these rows from shapes alone (a checkpoint
of the rows records its `description`; the optimizer's rows: `padded_rows.optimizer_rows`); `StateLayout` adds what the
executor needs of the pipeline. `StateLayout.specs` is the one source of every partition spec.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import pipeline
from jaxcomp.compress import packing
from jaxcomp.compress.boundary import LinkState
from jaxcomp.parallel import padded_rows
from jaxcomp.parallel.mesh import DATA, STAGE, TIED
from jaxcomp.parallel.padded_rows import (OPTIMIZER_ROWS, ChunkRows, MomentRows, OptaxRows, OptimizerRows,
                                          optimizer_rows)

class TiedMessage(NamedTuple):
  """One tied pair's exchange in a train step: its members' stage devices, and the bytes each sends the other."""
  ends: tuple[int, int]
  nbytes: int


_OWNER = {"fwd_send": 0, "bwd_recv": 0, "fwd_recv": 1, "bwd_send": 1}  # boundary of chunk c: c - offset


def exchange_tied(message, pairs):
  """`message` (an array or a codec's payload) sent between the stages of `pairs` ((source, target) on the stage
  axis; zeros where nothing arrives), bit patterns on the wire (`packing.as_bits`), under the scope `mesh.TIED`
  that names these collectives in the compiled program."""
  with jax.named_scope(TIED):
    return jax.tree.map(lambda a: packing.from_bits(jax.lax.ppermute(packing.as_bits(a), STAGE, pairs), a.dtype),
                        message)


def abstract_state(pipe: pipeline.Pipeline, optimizer, batch) -> pipeline.TrainState:
  """The simulate-layout TrainState's shapes (no real initialisation)."""
  opt = optimizer or optax.identity()
  return jax.eval_shape(lambda b: pipeline.init_state(pipe, opt, jax.random.key(0), b), batch)


class StateRows:
  """The simulate layout's TrainState <-> stage rows and link tables on `num_stages` x `data`
  devices, from shapes alone: `template` (the simulate-layout state's shapes), whether the
  forward link state is per example (`keyed`), the optimizer's rows, the tables' width `f_max`
  and one replica's data-parallel error state `grad_template` (None: no such state); `chunks` V per
  device (the template's S V stages, chunk c on device c mod S).
  `tied_stages` ((stage a, stage b) of each tied pair) places the template's `tied_state`, when it has one.
  `description` is what a checkpoint of the rows records, `from_description` rebuilds them
  from it and the simulate layout's shapes alone (no pipeline needed)."""

  def __init__(self, template: pipeline.TrainState, num_stages: int, data: int, keyed: bool,
               optimizer: OptimizerRows | None, f_max: int, grad_template=None, chunks: int = 1,
               tied_stages: tuple = ()):
    self.template, self.num_stages, self.data, self.keyed = template, num_stages, data, keyed
    self.chunks = chunks
    self.tied_stages = tuple(tuple(pair) for pair in tied_stages) if template.tied_state else ()
    self.params = padded_rows.FlatRows(template.params)
    self.model_state = padded_rows.FlatRows(template.model_state)
    self.optimizer, self.f_max, self.grad_template = optimizer, f_max, grad_template

  def description(self) -> dict:
    """JSON: what `from_description` needs besides the simulate layout's shapes."""
    opt = self.optimizer
    return {"stages": self.num_stages, **({"chunks": self.chunks} if self.chunks > 1 else {}),
            "data": self.data, "keyed": self.keyed, "width": self.f_max,
            "optimizer": None if opt is None else OPTIMIZER_ROWS[type(opt)],
            "optimizer_leaves": [] if not isinstance(opt, OptaxRows) else
            [[list(leaf.shape) for leaf in stage] for stage in opt.fl.leaves],
            **({"tied": [list(pair) for pair in self.tied_stages]} if self.tied_stages else {})}

  @classmethod
  def from_description(cls, template: pipeline.TrainState, described: dict) -> "StateRows":
    """The rows `description` describes, for the simulate-layout shapes `template`; ValueError when the
    template's optimizer state is not the one the rows were made of."""
    params = padded_rows.FlatRows(template.params)
    optimizer = None
    if described["optimizer"] == "moments":
      optimizer = MomentRows(None, params)
    elif described["optimizer"] == "optax":
      optimizer = OptaxRows(None, params, padded_rows.split_by_stage(template.opt_state, template.params))
      if [[list(leaf.shape) for leaf in stage] for stage in optimizer.fl.leaves] != described["optimizer_leaves"]:
        raise ValueError("the optimizer state of these rows has other shapes than this run's")
    return cls(template, described["stages"], described["data"], described["keyed"], optimizer, described["width"],
               chunks=described.get("chunks", 1), tied_stages=described.get("tied", ()))

  # ------------------------------------------------------------ whole states
  def by_device(self, rows):
    """Chunk rows [S V, ...] (chunk order) -> [S, V, ...]: device d's chunks d, d+S, ...; as they are for V = 1."""
    if self.chunks == 1:
      return rows
    return jax.tree.map(lambda a: a.reshape(self.chunks, self.num_stages, *a.shape[1:]).swapaxes(0, 1), rows)

  def by_chunk(self, rows):
    """Inverse of `by_device`."""
    if self.chunks == 1:
      return rows
    return jax.tree.map(lambda a: a.swapaxes(0, 1).reshape(-1, *a.shape[2:]), rows)

  def stack(self, state: pipeline.TrainState) -> pipeline.TrainState:
    """simulate-layout TrainState (PRNG key as key data) -> rows; traceable."""
    opt_state = ()
    if self.optimizer is not None:
      opt_state = self.by_device(self.optimizer.stack(padded_rows.split_by_stage(state.opt_state, state.params)))
    return pipeline.TrainState(state.step, state.rng, self.by_device(self.params.stack(state.params)),
                               self.by_device(self.model_state.stack(state.model_state)), opt_state,
                               self.tables(state.links), self.grad_rows(state.grad_state),
                               self.tied_rows(state.tied_state))

  def unstack(self, flat: pipeline.TrainState) -> pipeline.TrainState:
    """Inverse of `stack`: the optimizer state in `optimizer.init(params)`'s structure, `grad_state`
    per stage a tree of [D, ...] error rows, each example's row from the shard that owns it, `tied_state`
    per pair its members' [D, n] rows."""
    return pipeline.TrainState(flat.step, flat.rng, *self.unstack_model(flat.params, flat.model_state, flat.opt_state),
                               self.untables(flat.links), self.grad_canonical(flat.grad_state),
                               self.tied_canonical(flat.tied_state))

  def unstack_model(self, params, model_state, opt_state) -> tuple:
    """(params, model state, optimizer state) rows -> their simulate layout (part of `unstack`)."""
    params = self.params.unstack(self.by_chunk(params))
    if self.optimizer is not None:
      opt_state = padded_rows.merge_stages(tuple(self.optimizer.unstack(self.by_chunk(opt_state))), params)
    return params, self.model_state.unstack(self.by_chunk(model_state)), opt_state if self.optimizer is not None else ()

  # ------------------------------------------------------------ link tables
  def _keyed(self, field: str) -> bool:
    """Whether a LinkState field has one row per example (AQ-SGD forward state)."""
    return field.startswith("fwd") and self.keyed

  def tables(self, links) -> LinkState:
    """Per-boundary LinkStates (global batch) -> [S, D*rows, F] tables ([S, V, D*rows, F]), one per field."""
    def table(field):
      def leaf(*per_boundary):
        rows, dtype = per_boundary[0].shape[0], per_boundary[0].dtype
        blocks = []
        for c in range(self.num_stages * self.chunks):
          b = c - _OWNER[field]
          block = jnp.zeros((rows, self.f_max), dtype)
          if 0 <= b < len(per_boundary):
            flat = per_boundary[b].reshape(rows, -1)
            block = block.at[:, : flat.shape[1]].set(flat)
          blocks.append(self._example_copies(block) if self._keyed(field) else block)
        return self.by_device(jnp.stack(blocks))
      parts = [getattr(link, field) for link in links]
      return jax.tree.map(leaf, *parts) if parts else ()
    return LinkState(*(table(f) for f in LinkState._fields))

  def untables(self, tables) -> tuple:
    """Inverse of `tables`."""
    out = []
    for b, link in enumerate(self.template.links):
      def field(name):
        c = b + _OWNER[name]
        def leaf(t, like):
          t = self.by_chunk(t)[c]
          t = self._example_rows(t) if self._keyed(name) else t
          return t[: like.shape[0], : padded_rows.feature_size(like.shape)].reshape(like.shape).astype(like.dtype)
        return jax.tree.map(leaf, getattr(tables, name), getattr(link, name))
      out.append(LinkState(*(field(f) for f in LinkState._fields)))
    return tuple(out)

  def _example_copies(self, table):
    """A per-example [rows, F] table -> [D*rows, F]: data shard d's copy holds the rows of its
    own examples (`pipeline.example_shard`) and zeros elsewhere, as training leaves it."""
    owner = pipeline.example_shard(jnp.arange(table.shape[0]), self.data)
    return jnp.concatenate([jnp.where((owner == d)[:, None], table, jnp.zeros_like(table)) for d in range(self.data)])

  def _example_rows(self, copies):
    """Inverse of `_example_copies`: each example's row from the shard that owns it."""
    rows = copies.shape[0] // self.data
    owner = pipeline.example_shard(jnp.arange(rows), self.data)
    return copies.reshape(self.data, rows, -1)[owner, jnp.arange(rows)]

  # ------------------------------------------------------------ data-parallel error rows
  def grad_rows(self, canonical):
    """grad_state: per stage, trees with a leading [D] axis -> [S, D, P] rows ([S, V, D, P]; zeros if ())."""
    if self.grad_template is None:
      return ()
    stages = self.num_stages * self.chunks
    if canonical == ():
      return self.by_device(jax.tree.map(lambda r: jnp.tile(r[None], (stages, self.data, 1)), self.grad_template))
    structure = jax.tree.structure(self.grad_template)
    rows = [jnp.stack([jax.vmap(lambda t, s=s: self.params.put(s, t))(per_stage[s]) for s in range(stages)])
            for per_stage in structure.flatten_up_to(canonical)]
    return self.by_device(jax.tree.unflatten(structure, rows))

  def grad_canonical(self, rows):
    """Inverse of `grad_rows` (any tree of [S, D, P] rows: each leaf becomes its S per-stage trees)."""
    if not jax.tree.leaves(rows):
      return ()
    canonical = [tuple(jax.vmap(lambda r, s=s: self.params.get(s, r))(leaf[s]) for s in range(leaf.shape[0]))
                 for leaf in jax.tree.leaves(self.by_chunk(rows))]
    return jax.tree.unflatten(jax.tree.structure(rows), canonical)

  # ------------------------------------------------------------ the compressed tied exchange's rows
  def tied_devices(self) -> list[tuple[int, int]]:
    """The stage devices of each tied pair's members (stage c on device c mod S)."""
    return [(sa % self.num_stages, sb % self.num_stages) for sa, sb in self.tied_stages]

  def tied_rows(self, canonical):
    """tied_state: per pair (member a's, member b's) trees of [D', n] rows (D' = D, or 1 when every replica's is
    the same, as one replica's is) -> per pair a tree of [S, D, n] rows, each member's on its own device, zeros
    on the others; fresh (zero) states if (); () without a compressed tied exchange."""
    if not self.tied_stages:
      return ()
    if canonical == ():
      canonical = jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), self.template.tied_state)

    def pair(devices, members):
      def leaf(a, b):
        rows = jnp.zeros((self.num_stages, self.data, a.shape[-1]), a.dtype)
        for device, member in zip(devices, (a, b)):
          rows = rows.at[device].set(jnp.broadcast_to(member, (self.data, a.shape[-1])))
        return rows
      return jax.tree.map(leaf, *members)
    return tuple(pair(devices, members) for devices, members in zip(self.tied_devices(), canonical))

  def tied_canonical(self, rows):
    """Inverse of `tied_rows`."""
    return tuple(tuple(jax.tree.map(lambda r, d=d: r[d], tree) for d in devices)
                 for devices, tree in zip(self.tied_devices(), rows))


class StateLayout(StateRows):
  """The layout of one (pipeline, optimizer, global batch) on a mesh of `num_stages` x `data`
  devices; built from shapes alone. `grad_scheme` compresses the data-parallel exchange (None: a
  dense one); `grad_template` is then one replica's error state for a `[P]` row."""

  def __init__(self, pipe: pipeline.Pipeline, optimizer, batch, num_stages: int, data: int, grad_scheme=None,
               chunks: int = 1):
    self.pipe = pipe
    template = abstract_state(pipe, optimizer, batch)
    params = padded_rows.FlatRows(template.params)
    self.batch_size = jax.tree.leaves(batch)[0].shape[0]
    self.local_batch = pipeline.microbatch_shapes(batch, data)
    self.microbatch = pipeline.microbatch_shapes(self.local_batch, pipe.microbatches)
    self.shapes = pipeline.boundary_shapes(pipe, template.params, template.model_state,
                                           self.microbatch[pipe.input_key])
    super().__init__(template, num_stages, data, pipe.boundary.fwd.keyed_by_example,
                     optimizer_rows(optimizer, params, template.params),
                     max([padded_rows.feature_size(s.shape) for s in self.shapes] or [1]),
                     None if grad_scheme is None else grad_scheme.init_sender(1, (params.size,), jnp.float32),
                     chunks, tuple((sa, sb) for (sa, _), (sb, _) in pipe.tied))

  # ------------------------------------------------------------ partition specs
  @staticmethod
  def table_spec(ndim: int) -> P:
    """A link table's or error row's spec: [S, D*rows, F] on (stage, data), [S, V, D*rows, F] (V > 1 chunks
    per device) on (stage, -, data)."""
    return P(STAGE, DATA) if ndim == 3 else P(STAGE, None, DATA)

  @staticmethod
  def specs(state: pipeline.TrainState) -> pipeline.TrainState:
    """Every partition spec of a sharded state (arrays or shapes)."""
    rows = lambda tree: jax.tree.map(lambda a: StateLayout.table_spec(a.ndim), tree)
    return pipeline.TrainState(P(), P(), P(STAGE), P(STAGE), jax.tree.map(lambda _: P(STAGE), state.opt_state),
                               rows(state.links), rows(state.grad_state), rows(state.tied_state))

  @classmethod
  def shardings(cls, mesh, state: pipeline.TrainState) -> pipeline.TrainState:
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), cls.specs(state),
                        is_leaf=lambda x: isinstance(x, P))

  def initializer(self, mesh, impl):
    """key data -> the sharded train state: device (d, s) initialises only stage s's rows and its own
    blocks of the link tables (`fresh_tables`)."""
    pipe, inputs = self.pipe, [self.microbatch[self.pipe.input_key], *self.shapes]

    def stage_rows(init_rng):
      s = jax.lax.axis_index(STAGE)

      def init(j):
        def run():
          p, ms = pipe.stages[j].init(jax.random.fold_in(init_rng, j), jnp.zeros(inputs[j].shape, inputs[j].dtype))
          return self.params.put(j, p), self.model_state.put(j, ms)
        return run

      chunks = [v * self.num_stages + s for v in range(self.chunks)]
      rows = [jax.lax.switch(c, [init(j) for j in range(len(pipe.stages))]) for c in chunks]
      p_rows, ms_rows = rows[0] if self.chunks == 1 else jax.tree.map(lambda *r: jnp.stack(r), *rows)
      p_rows = self.tie(p_rows)
      opt_rows = [self.optimizer.init_row(p, c) for p, c in zip(p_rows.reshape(self.chunks, -1), chunks)]
      opt_rows = opt_rows[0] if self.chunks == 1 else jax.tree.map(lambda *r: jnp.stack(r), *opt_rows)
      return (*jax.tree.map(lambda a: a[None], (p_rows, ms_rows, opt_rows)), self.fresh_tables())

    def build(key_data):
      init_rng, state_rng = jax.random.split(jax.random.wrap_key_data(key_data, impl=impl))
      specs = (P(STAGE),) * 3 + (self.table_spec(3 + (self.chunks > 1)),)
      rows = jax.shard_map(stage_rows, mesh=mesh, in_specs=P(), out_specs=specs, check_vma=False)
      p_rows, ms_rows, opt_rows, tables = rows(init_rng)
      return pipeline.TrainState(jnp.zeros((), jnp.int32), state_rng, p_rows, ms_rows, opt_rows, tables,
                                 self.grad_rows(()), self.tied_rows(()))

    return build

  def fresh_tables(self) -> LinkState:
    """Inside a shard_map over (data, stage): this device's `[1, rows, F]` blocks of the tables of
    fresh link states (`Boundary.init`), as `tables` lays them out. Each device builds only its own
    block: nothing is exchanged (XLA partitions a whole-table `tables` into all-to-alls)."""
    if not self.shapes:
      return LinkState((), (), (), ())
    s, d = jax.lax.axis_index(STAGE), jax.lax.axis_index(DATA)
    fresh = lambda b: self.pipe.boundary.init(self.batch_size, self.shapes[b].shape[1:], self.shapes[b].dtype)

    def table(field):
      def leaf(k, like):
        rows = like.shape[0]
        local = rows if self._keyed(field) else rows // self.data

        def stage(j):
          def run():
            b = j - _OWNER[field]
            if not 0 <= b < len(self.shapes):
              return jnp.zeros((local, self.f_max), like.dtype)
            flat = jax.tree.leaves(getattr(fresh(b), field))[k].reshape(rows, -1)
            block = jnp.zeros((rows, self.f_max), like.dtype).at[:, : flat.shape[1]].set(flat)
            if self._keyed(field):  # shard d's copy: its own examples' rows
              return jnp.where((pipeline.example_shard(jnp.arange(rows), self.data) == d)[:, None], block, 0)
            return jax.lax.dynamic_slice_in_dim(block, d * local, local)
          return run
        blocks = [jax.lax.switch(v * self.num_stages + s, [stage(j) for j in range(len(self.pipe.stages))])
                  for v in range(self.chunks)]
        return (blocks[0] if self.chunks == 1 else jnp.stack(blocks))[None]
      like = getattr(jax.eval_shape(lambda: fresh(0)), field)
      return jax.tree.unflatten(jax.tree.structure(like), [leaf(k, l) for k, l in enumerate(jax.tree.leaves(like))])
    return LinkState(*(table(f) for f in LinkState._fields))

  # ------------------------------------------------------------ tied parameters, clipping
  def tied_ends(self, pairs=None):
    """Per pair of `pairs` (default: the pipeline's tied pairs): ((device, slot, offset) of each member's segment),
    its length: chunk c at slot c // S of device c mod S."""
    for (sa, pa), (sb, pb) in self.pipe.tied if pairs is None else pairs:
      (oa, n), (ob, _) = self.params.leaf_span(sa, pa), self.params.leaf_span(sb, pb)
      yield (sa % self.num_stages, sa // self.num_stages, oa), (sb % self.num_stages, sb // self.num_stages, ob), n

  def tie(self, rows):
    """Tied parameters and initial copies (`Pipeline.init_copies`) start equal: each pair's second member takes
    the first's value, sent from the first member's device to the second's (`exchange_tied`; none when one device
    holds both). `rows`: this device's parameter row [P] (a stage per device) or its chunks' rows [V, P]."""
    d, chunk_rows = jax.lax.axis_index(STAGE), rows.reshape(self.chunks, -1)
    for (da, va, oa), (db, vb, ob), n in self.tied_ends(self.pipe.tied + self.pipe.init_copies):
      first = chunk_rows[va, oa: oa + n]
      first = first if da == db else exchange_tied(first, [(da, db)])
      chunk_rows = jnp.where(d == db, chunk_rows.at[vb, ob: ob + n].set(first), chunk_rows)
    return chunk_rows.reshape(rows.shape)

  def finish(self, grads, tied_state, step_key):
    """(gradient row(s), tied_state'): ties (each member's gradient segment, or with `Pipeline.tied_scheme` its
    compressed message m = C(g + e) (`pipeline.tie_grads`), sent to the other member's device: g_a + g_b, or
    D(m_a) + D(m_b), on both) and global-norm clipping. `grads`: this device's gradient row [P] (a stage per
    device) or its chunks' rows [V, P]; `tied_state`: per pair this replica's state of the member it holds
    ([1, n] leaves; () for an exact exchange); `step_key`: the step's (`pipeline.tied_member_key`)."""
    d, rows, scheme, states = jax.lax.axis_index(STAGE), grads.reshape(self.chunks, -1), self.pipe.tied_scheme, []
    for k, ((da, va, oa), (db, vb, ob), n) in enumerate(self.tied_ends()):
      g_a, g_b = rows[va, oa: oa + n], rows[vb, ob: ob + n]
      if da == db:
        total = g_a + g_b
        rows = jnp.where(d == da, rows.at[va, oa: oa + n].set(total).at[vb, ob: ob + n].set(total), rows)
        continue
      is_a = d == da
      exchange = lambda message: exchange_tied(message, [(da, db), (db, da)])
      key = pipeline.tied_member_key(step_key, k, jnp.where(is_a, 0, 1))
      total, state = pipeline.tied_member_total(scheme, jnp.where(is_a, g_a, g_b), tied_state[k] if scheme else (),
                                                key, is_a, exchange)
      if scheme is not None:
        states.append(jax.tree.map(lambda e: jnp.where(is_a | (d == db), e, 0), state))  # zero off the pair
      # one write of the one sum at this device's member: were each member's write its own, XLA would compute the
      # sum in each write's fusion, whose code may round it differently (an FMA in one), and the copies drift apart
      at = (jnp.where(is_a, va, vb), jnp.where(is_a, oa, ob))
      rows = jnp.where(is_a | (d == db), jax.lax.dynamic_update_slice(rows, total.astype(rows.dtype)[None], at),
                       rows)
    if self.pipe.grad_clip_norm is not None:
      rows = rows * pipeline.clip_factor(jax.lax.psum(jnp.sum(jnp.square(rows)), STAGE), self.pipe.grad_clip_norm)
    return rows.reshape(grads.shape), tuple(states)

  def tied_messages(self) -> list["TiedMessage"]:
    """What one replica's stage devices send per train step to keep tied parameters equal (`finish`): per pair
    whose members are on two devices, one message each way, of the member's gradient segment (fp32) or, with
    `Pipeline.tied_scheme`, of its payload (nothing where one device holds both)."""
    scheme, dtype = self.pipe.tied_scheme, self.params.dtype
    size = (lambda n: scheme.wire_bytes((1, n), dtype)) if scheme else (lambda n: n * jnp.dtype(dtype).itemsize)
    return [TiedMessage((da, db), size(n)) for (da, _, _), (db, _, _), n in self.tied_ends() if da != db]

  def tied_bytes(self) -> int:
    """Bytes one replica's stages send per train step to keep tied parameters equal (`tied_messages`, both ways)."""
    return sum(2 * m.nbytes for m in self.tied_messages())

  def real(self, s):
    """Mask of stage s's row that is not padding (of each chunk's row: `chunks_of`)."""
    return jnp.arange(self.params.size) < jnp.asarray(self.params.sizes)[s][..., None]

  def chunks_of(self, s):
    """What stands for the stages whose rows device s holds: s itself (a stage per device), or its chunks
    s, s + S, ... ([V])."""
    return s if self.chunks == 1 else s + self.num_stages * jnp.arange(self.chunks)

  @property
  def device_optimizer(self) -> OptimizerRows:
    """The optimizer's rows as one device holds them (`ChunkRows` with V > 1 chunks per device)."""
    return self.optimizer if self.chunks == 1 else ChunkRows(self.optimizer)
