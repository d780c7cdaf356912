"""GPipe across devices: stages on a `stage` mesh axis, compressed payloads on `ppermute`.

Mesh axes ("data", "stage"). Device (d, s) runs stage s on data shard d. Per device, every
per-stage quantity is flattened and zero-padded to the largest stage so that one
stage-sharded array holds all of them (heterogeneous stages):
  params [S, P], model state [S, Q], optimizer state [S, O]    (sharded on stage)
  link tables [S, D*rows, F]: device s holds the forward-sender / backward-receiver rows of
  boundary s and the forward-receiver / backward-sender rows of boundary s-1.
A step unrolls the M+S-1 ticks of the GPipe schedule. At tick t device s runs stage s on
microbatch t-s (`lax.switch` on the stage index; bubble ticks are masked), then every
boundary b with a microbatch in flight (0 <= t-b < M) runs its custom_vjp op with a
`ppermute` from b to b+1 carrying the *encoded payload*; autodiff replays the schedule in
reverse and each op's backward rule ppermutes the encoded gradient from b+1 to b. Bubble
ticks issue no collective at all, so the program sends exactly M x sum_b wire_bytes(b)
each way. Weight gradients are averaged over `data` (densely, or compressed by
`grad_scheme`: each replica sends C(g + e) to the others with an all-gather, e' = g + e - C(g + e));
the optimizer runs per stage. With a `qadam.QuantizedAdam` optimizer the replicas exchange Adam's
first moment instead, compressed by `grad_scheme`, and Adam runs on each device's flat row.
Numerics (keys, state rows, microbatch order) equal `simulate`'s.
"""
import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxcomp import distributed, feedback, pipeline as pl
from jaxcomp.boundary import LinkState, Mode, Transport
from jaxcomp.qadam import QuantizedAdam

STAGE, DATA = "stage", "data"


@dataclasses.dataclass(frozen=True)
class PPermute(Transport):
  """Moves a payload from stage `src` to `src + 1` forward, and back."""
  src: int = 0

  def forward(self, payload):
    return jax.tree.map(lambda a: jax.lax.ppermute(a, STAGE, [(self.src, self.src + 1)]), payload)

  def backward(self, payload):
    return jax.tree.map(lambda a: jax.lax.ppermute(a, STAGE, [(self.src + 1, self.src)]), payload)


def make_mesh(num_stages: int, data: int = 1, devices=None) -> jax.sharding.Mesh:
  """A (data, stage) mesh; a clear error when there are not enough devices."""
  devices = jax.devices() if devices is None else devices
  if num_stages < 1 or data < 1:
    raise ValueError(f"mesh needs stages >= 1 and data >= 1, got stages={num_stages}, data={data}")
  if num_stages * data > len(devices):
    raise ValueError(f"a mesh of {data} data x {num_stages} stages needs {num_stages * data} devices, "
                     f"but only {len(devices)} are available")
  grid = np.asarray(devices[: num_stages * data]).reshape(data, num_stages)
  return jax.sharding.Mesh(grid, (DATA, STAGE))


class _Flat:
  """Per-stage pytrees <-> rows of one [S, size] zero-padded array (tree_flatten order).

  Built from shapes alone (arrays or ShapeDtypeStructs); every leaf is stored in the
  common dtype and cast back on the way out (exact for int counters below 2^24).
  """

  def __init__(self, trees):
    self.leaves = [jax.tree.leaves(t) for t in trees]
    self.treedefs = [jax.tree.structure(t) for t in trees]
    self.sizes = [sum(int(np.prod(l.shape, dtype=np.int64)) for l in ls) for ls in self.leaves]
    self.size = max(1, *self.sizes)
    dtypes = [l.dtype for ls in self.leaves for l in ls]
    self.dtype = jnp.result_type(*dtypes) if dtypes else jnp.float32

  def get(self, s, row):
    out, offset = [], 0
    for leaf in self.leaves[s]:
      n = int(np.prod(leaf.shape, dtype=np.int64))
      out.append(row[offset: offset + n].reshape(leaf.shape).astype(leaf.dtype))
      offset += n
    return jax.tree.unflatten(self.treedefs[s], out)

  def put(self, s, tree):
    parts = [jnp.ravel(l).astype(self.dtype) for l in jax.tree.leaves(tree)]
    flat = jnp.concatenate(parts) if parts else jnp.zeros((0,), self.dtype)
    return jnp.pad(flat, (0, self.size - flat.shape[0]))

  def stack(self, trees):
    return jnp.stack([self.put(s, t) for s, t in enumerate(trees)])


def _feature_size(shape):
  return int(np.prod(shape[1:], dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class GPipe:
  """The sharded executor: `init_state`, `make_train_step`, `make_eval_step` as `simulate`.

  `grad_scheme` (Plain or EF around a codec, e.g. `parse_scheme("ef+quant:4")`) compresses the
  data-parallel weight-gradient exchange; warm-up steps (Mode.WARMUP) exchange dense gradients.
  With the optimizer `qadam.QuantizedAdam` it compresses Adam's first moment instead (Adam's
  second moment is frozen after warm-up). Its `opt_state` is a QuantizedAdamState of [S] step
  counts and [S, P] moment rows (the same on every replica); each replica's EF error is its row
  of `grad_state`.
  Adam is elementwise and padding has zero gradient, moments and (masked) exchanged momentum,
  so padding stays exactly zero. Ties and clipping apply to each replica's local gradient
  after warm-up (the mean gradient is never formed), to the mean one during warm-up.
  """
  mesh: jax.sharding.Mesh
  grad_scheme: Any = None

  def __post_init__(self):
    g = self.grad_scheme
    if g is not None and (not isinstance(g, feedback.Scheme) or type(g) not in (feedback.Plain, feedback.EF)):
      raise ValueError(f"grad_scheme must be a Plain or EF scheme (no receiver state), got {g!r}")

  @property
  def num_stages(self) -> int:
    return self.mesh.shape[STAGE]

  @property
  def data(self) -> int:
    return self.mesh.shape[DATA]

  # ---------------------------------------------------------------- layout
  def _check(self, pipe: pl.Pipeline, optimizer=None):
    if pipe.num_stages != self.num_stages:
      raise ValueError(f"the model has {pipe.num_stages} stages but the mesh's stage axis has "
                       f"{self.num_stages} devices")
    if isinstance(optimizer, QuantizedAdam) and self.grad_scheme is None:
      raise ValueError("QuantizedAdam exchanges Adam's first moment compressed by grad_scheme, but this GPipe "
                       "has grad_scheme=None; pass e.g. grad_scheme=parse_scheme('ef+quant:4') ('none' for an "
                       "uncompressed exchange), or use optax.adam")

  def _layout(self, pipe, state: pl.TrainState, batch):
    """Static shapes: boundary activations of one microbatch on one data shard."""
    local = jax.tree.map(lambda x: x[: x.shape[0] // self.data], batch)
    mb = jax.tree.map(lambda x: x[0], pl.split_microbatches(local, pipe.microbatches))
    return pl.boundary_shapes(pipe, state.params, state.model_state, mb[pipe.input_key])

  def init_state(self, pipe: pl.Pipeline, optimizer: optax.GradientTransformation, rng, batch, params=None):
    """The simulate-layout state, flattened, padded and placed on the mesh."""
    self._check(pipe, optimizer)
    state = pl.init_state(pipe, optimizer, rng, self._local(batch), params)
    return self.stack(pipe, optimizer, state, batch)

  def _local(self, batch):
    b = jax.tree.leaves(batch)[0].shape[0]
    if b % self.data:
      raise ValueError(f"batch size {b} does not split over {self.data} data shards")
    return jax.tree.map(lambda x: x[: b // self.data], batch)

  def stack(self, pipe, optimizer, state: pl.TrainState, batch):
    """simulate TrainState (one data shard's tables) -> sharded GPipe TrainState."""
    s_count = self.num_stages
    state = jax.tree.map(jnp.array, state)  # copies: the caller may donate its own buffers
    shapes = self._layout(pipe, state, batch)
    f_max = max([_feature_size(s.shape) for s in shapes] or [1])

    def table(which, owner):
      """[S, D*rows, F]: device s holds `which` of boundary owner(s) (zeros if none)."""
      def leaf(*per_boundary):
        rows, dtype = per_boundary[0].shape[0], per_boundary[0].dtype
        blocks = []
        for s in range(s_count):
          b = owner(s)
          block = jnp.zeros((rows, f_max), dtype)
          if 0 <= b < s_count - 1:
            flat = per_boundary[b].reshape(rows, -1)
            block = block.at[:, : flat.shape[1]].set(flat)
          blocks.append(jnp.tile(block, (self.data, 1)))
        return jnp.stack(blocks)
      parts = [getattr(link, which) for link in state.links]
      return jax.tree.map(leaf, *parts) if parts else ()

    before, after = (lambda s: s), (lambda s: s - 1)
    links = LinkState(table("fwd_send", before), table("fwd_recv", after),
                      table("bwd_send", after), table("bwd_recv", before))
    params = _Flat(state.params)
    grad_state = ()
    if self.grad_scheme is not None:  # one row per (stage, data) device
      rows = self.grad_scheme.init_sender(1, (params.size,), jnp.float32)
      grad_state = jax.tree.map(lambda r: jnp.tile(r[None], (s_count, self.data, 1)), rows)
    if isinstance(optimizer, QuantizedAdam):  # one flat row per stage, like the parameters
      row = optimizer.init(jnp.zeros((params.size,), params.dtype))
      opt_state = jax.tree.map(lambda r: jnp.repeat(r[None], s_count, axis=0), row)
    else:
      opt_states = [optimizer.init(p) for p in state.params]
      opt_state = _Flat(opt_states).stack(opt_states)
    flat_state = pl.TrainState(state.step, state.rng, params.stack(state.params),
                               _Flat(state.model_state).stack(state.model_state), opt_state, links, grad_state)
    return distributed.put_global(flat_state, self.shardings(flat_state))  # the mesh may span processes

  def shardings(self, flat_state):
    stage = NamedSharding(self.mesh, P(STAGE))
    rows = NamedSharding(self.mesh, P(STAGE, DATA))
    replicated = NamedSharding(self.mesh, P())
    return pl.TrainState(replicated, replicated, stage, stage, stage,
                         jax.tree.map(lambda _: rows, flat_state.links),
                         jax.tree.map(lambda _: rows, flat_state.grad_state))

  def unstack(self, pipe, optimizer, flat_state, batch, template: pl.TrainState) -> pl.TrainState:
    """Sharded GPipe state -> simulate layout (data shard 0's tables), for checks and export."""
    params = _Flat(template.params)
    model_state = _Flat(template.model_state)
    p = tuple(params.get(s, flat_state.params[s]) for s in range(self.num_stages))
    ms = tuple(model_state.get(s, flat_state.model_state[s]) for s in range(self.num_stages))
    links = []
    for b, link in enumerate(template.links):
      def leaf(t, like, s):
        rows = like.shape[0]
        return t[s, :rows, : _feature_size(like.shape)].reshape(like.shape).astype(like.dtype)
      fl = flat_state.links
      links.append(LinkState(
          jax.tree.map(lambda t, l: leaf(t, l, b), fl.fwd_send, link.fwd_send),
          jax.tree.map(lambda t, l: leaf(t, l, b + 1), fl.fwd_recv, link.fwd_recv),
          jax.tree.map(lambda t, l: leaf(t, l, b + 1), fl.bwd_send, link.bwd_send),
          jax.tree.map(lambda t, l: leaf(t, l, b), fl.bwd_recv, link.bwd_recv)))
    return template._replace(step=flat_state.step, params=p, model_state=ms, links=tuple(links))

  # ---------------------------------------------------------------- schedule
  def _schedule(self, pipe, layout, mode, params, model_state, tables, batch, step_key, train):
    """One device's share of a batch through the GPipe schedule.

    Returns (this device's loss contribution, metric sums, model_state, forward tables).
    """
    s_count, m_count = self.num_stages, pipe.microbatches
    params_fl, ms_fl, shapes = layout
    s = jax.lax.axis_index(STAGE)
    mbs = pl.split_microbatches(batch, m_count)
    mb_size = jax.tree.leaves(mbs)[0].shape[1]
    a_max = max([_feature_size(x.shape) for x in shapes] or [1])
    act_dtype = jnp.result_type(*[x.dtype for x in shapes] or [jnp.float32])
    x_buf = jnp.zeros((mb_size, a_max), act_dtype)
    fs_t, fr_t, bs_t, br_t = tables
    fwd_tables = [fs_t, fr_t]
    loss_sum, metric_sums = jnp.zeros((), jnp.float32), None

    def branch(j):
      def run(params_row, ms_row, x_buf, mb, rng):
        x = mb[pipe.input_key] if j == 0 else _unpad(x_buf, shapes[j - 1])
        y, ms = pipe.stages[j].apply(params_fl.get(j, params_row), ms_fl.get(j, ms_row), x,
                                     train=train, rng=rng)
        if j < s_count - 1:
          return _pad(y, a_max, act_dtype), ms_fl.put(j, ms), jnp.zeros((), jnp.float32), None
        loss, metrics = pipe.loss_fn(y, mb)
        return x_buf, ms_fl.put(j, ms), loss.astype(jnp.float32), metrics
      return run

    def operands(t):
      ic = jnp.clip(t - s, 0, m_count - 1)
      mb = jax.tree.map(lambda a: a[ic], mbs)
      return (params[0], model_state[0], x_buf, mb, pl.stage_key(step_key, ic, s))

    # the metric structure comes from the last stage; other branches return zeros of it
    metric_shape = jax.eval_shape(branch(s_count - 1), *operands(0))[3]
    branches = [_with_metrics(branch(j), metric_shape) for j in range(s_count)]

    for t in range(m_count + s_count - 1):
      valid = (t - s >= 0) & (t - s < m_count)
      y_buf, ms_new, loss, metrics = jax.lax.switch(s, branches, *operands(t))
      model_state = model_state.at[0].set(jnp.where(valid, ms_new, model_state[0]))
      loss_sum += jnp.where(valid, loss, 0.0)
      metrics = jax.tree.map(lambda v: jnp.where(valid, v, 0.0), metrics)
      metric_sums = metrics if metric_sums is None else jax.tree.map(jnp.add, metric_sums, metrics)

      next_x = jnp.zeros_like(x_buf)
      for b in range(s_count - 1):
        m = t - b
        if not 0 <= m < m_count:
          continue  # no microbatch crosses boundary b at this tick: no collective
        send_ok, recv_ok = s == b, s == b + 1
        shape = shapes[b]
        ids = mbs["id"][m] if "id" in mbs else None
        rows_of = lambda scheme: pl.rows(scheme, m, mb_size, ids)
        boundary = dataclasses.replace(pipe.boundary, transport=PPermute(b))
        fwd_rows, bwd_rows = rows_of(boundary.fwd), rows_of(boundary.bwd)  # both ends handle microbatch m
        link = LinkState(_rows(fwd_tables[0], fwd_rows, shape), _rows(fwd_tables[1], fwd_rows, shape),
                         _rows(bs_t, bwd_rows, shape), _rows(br_t, bwd_rows, shape))
        x_b, (fs, fr) = boundary(_unpad(y_buf, shape), link, pl.link_key(step_key, m, b), mode,
                                 send_ok, recv_ok)
        if mode in (Mode.TRAIN, Mode.WARMUP):
          fwd_tables = [_put_rows(fwd_tables[0], fwd_rows, fs), _put_rows(fwd_tables[1], fwd_rows, fr)]
        next_x = jnp.where(recv_ok, _pad(x_b, a_max, act_dtype), next_x)
      x_buf = next_x
    return loss_sum / m_count, jax.tree.map(lambda v: v / m_count, metric_sums), model_state, fwd_tables

  def make_train_step(self, pipe: pl.Pipeline, optimizer: optax.GradientTransformation,
                      mode: Mode = Mode.TRAIN):
    """jit-compiled (state, batch) -> (state, metrics) over the mesh."""
    self._check(pipe, optimizer)
    if mode not in (Mode.TRAIN, Mode.WARMUP):
      raise ValueError(f"train step mode must be TRAIN or WARMUP, got {mode}")
    return self._compile(pipe, optimizer, mode, train=True)

  def make_eval_step(self, pipe: pl.Pipeline, compressed: bool):
    self._check(pipe)
    mode = Mode.EVAL_COMPRESSED if compressed else Mode.EVAL_UNCOMPRESSED
    return self._compile(pipe, None, mode, train=False)

  def _compressed_mean(self, grads_row, grad_state, key):
    """Each replica sends C(g + e) (one [1, P] message); all average the decoded messages.

    (g is the gradient, or QuantizedAdam's local first moment.)"""
    key = jax.random.fold_in(jax.random.fold_in(key, jax.lax.axis_index(STAGE)), jax.lax.axis_index(DATA))
    rows = jax.tree.map(lambda a: a[0], grad_state)  # [1, P]
    payload, rows = self.grad_scheme.send(grads_row[None], rows, key)
    return _gathered_mean(self.grad_scheme, payload)[0], jax.tree.map(lambda a: a[None], rows)

  def wire_bytes_per_step(self, pipe, batch, mode: Mode = Mode.TRAIN) -> dict[str, int]:
    """Executor protocol: every data shard's pipeline bytes each way, plus the gradient (or
    QuantizedAdam momentum) exchange; warm-up steps send everything dense."""
    warm = mode is Mode.WARMUP
    local = pl.wire_bytes_per_step(pl.uncompressed(pipe) if warm else pipe, None, self._local(batch))
    out = {k: v * self.data for k, v in local.items()}
    if self.data > 1:
      out["data"] = self.grad_wire_bytes(pipe, optax.identity(), batch, dense=warm)
    return out

  def grad_wire_bytes(self, pipe, optimizer, batch, dense: bool = False) -> int:
    """Bytes all replicas send per step for the data-parallel gradient exchange (all stages);
    QuantizedAdam's momentum exchange sends the same [1, P] messages."""
    d = self.data
    params = _Flat(_abstract_template(pipe, optimizer, self._local(batch)).params)
    if self.grad_scheme is None or dense:  # ring all-reduce: 2 (D-1)/D of the gradient per device
      return int(2 * (d - 1) * params.size * 4) * self.num_stages
    return self.grad_scheme.wire_bytes((1, params.size), jnp.float32) * (d - 1) * d * self.num_stages

  def compiled_text(self, pipe, optimizer, state, batch, mode: Mode = Mode.TRAIN) -> str:
    """HLO of the compiled train step for this batch shape (for wire accounting)."""
    self._check(pipe, optimizer)
    return self._build(pipe, optimizer, mode, True, state, batch).lower(state, batch).compile().as_text()

  def _compile(self, pipe, optimizer, mode, train):
    cache = {}

    def step(state, batch):
      key = tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(batch))
      if key not in cache:
        if isinstance(optimizer, QuantizedAdam) and mode is Mode.TRAIN and not int(state.opt_state.nu_count[0]):
          raise ValueError("QuantizedAdam freezes Adam's second moment after warm-up, but this state has had "
                           "no warm-up step (v = 0): run Mode.WARMUP steps first")
        cache[key] = self._build(pipe, optimizer, mode, train, state, batch)
      return cache[key](state, batch)

    return step

  def _build(self, pipe, optimizer, mode, train, state, batch):
    """Traces the layout for this batch shape and returns the jitted step."""
    template = _abstract_template(pipe, optimizer, self._local(batch))
    params_fl = _Flat(template.params)
    ms_fl = _Flat(template.model_state)
    qadam = isinstance(optimizer, QuantizedAdam)
    opt_fl = _Flat([optimizer.init(p) for p in template.params]) if optimizer and not qadam else None
    shapes = self._layout(pipe, template, batch)
    layout = (params_fl, ms_fl, shapes)
    s_count = self.num_stages

    def device_step(state, batch):
      step_key = jax.random.fold_in(state.rng, state.step)
      tables = (state.links.fwd_send, state.links.fwd_recv, state.links.bwd_send, state.links.bwd_recv)
      local = lambda tree: jax.tree.map(lambda a: a[0], tree)
      bs_bt = (local(tables[2]), local(tables[3]))

      def loss_of(params_row, bwd):
        loss, metrics, ms, fwd = self._schedule(pipe, layout, mode, params_row[None], state.model_state,
                                                (local(tables[0]), local(tables[1]), *bwd), batch,
                                                step_key, train)
        return loss, (metrics, ms, fwd)

      if not train:
        loss, (metrics, _, _) = loss_of(state.params[0], bs_bt)
        total = lambda v: jax.lax.pmean(jax.lax.psum(v, STAGE), DATA)
        return jax.tree.map(total, {"loss": loss, **metrics})

      (loss, (metrics, ms, fwd)), (grads, bwd) = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)(
          state.params[0], bs_bt)
      grad_state, opt = state.grad_state, local(state.opt_state)
      s, key = jax.lax.axis_index(STAGE), jax.random.fold_in(step_key, 2)
      dense = self.grad_scheme is None or mode is Mode.WARMUP
      if dense:
        grads = jax.lax.pmean(grads, DATA)
      elif not qadam:
        grads, grad_state = self._compressed_mean(grads, grad_state, key)
      grads = _finish_grads(pipe, params_fl, grads, s)
      if qadam and dense:
        params_row, opt = optimizer.dense_update(grads, opt, state.params[0])
      elif qadam:  # the replicas exchange the first moment
        mu, grad_state = self._compressed_mean(optimizer.local_momentum(grads, opt), grad_state, key)
        real = jnp.arange(params_fl.size) < jnp.asarray(params_fl.sizes)[s]  # decoded padding need not be 0
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
      new_state = pl.TrainState(state.step + 1, state.rng, params_row[None], ms, add(opt), links, grad_state)
      total = lambda v: jax.lax.pmean(jax.lax.psum(v, STAGE), DATA)
      return new_state, jax.tree.map(total, {"loss": loss, **metrics})

    state_specs = pl.TrainState(P(), P(), P(STAGE), P(STAGE), P(STAGE),
                                jax.tree.map(lambda _: P(STAGE, DATA), state.links),
                                jax.tree.map(lambda _: P(STAGE, DATA), state.grad_state))
    batch_specs = jax.tree.map(lambda _: P(DATA), batch)
    out_specs = (state_specs, P()) if train else P()
    mapped = jax.shard_map(device_step, mesh=self.mesh, in_specs=(state_specs, batch_specs),
                           out_specs=out_specs, check_vma=False)
    return jax.jit(mapped, donate_argnums=0 if train else ())


def _leaf_span(fl: _Flat, stage, path):
  """(offset, size) of the parameter at `path` inside stage `stage`'s flat row."""
  offset = 0
  tree = jax.tree.unflatten(fl.treedefs[stage], fl.leaves[stage])
  for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    n = int(np.prod(leaf.shape, dtype=np.int64))
    if tuple(getattr(k, "key", getattr(k, "idx", None)) for k in keys) == tuple(path):
      return offset, n
    offset += n
  raise ValueError(f"tied parameter path {path!r} not found in stage {stage}")


def _finish_grads(pipe, params_fl, grads_row, s):
  """Ties (psum of each tied segment over its two stages) and global-norm clipping."""
  for (sa, pa), (sb, pb) in pipe.tied:
    (oa, n), (ob, _) = _leaf_span(params_fl, sa, pa), _leaf_span(params_fl, sb, pb)
    mine = jnp.where(s == sa, grads_row[oa: oa + n], jnp.where(s == sb, grads_row[ob: ob + n], 0.0))
    total = jax.lax.psum(mine, STAGE)
    grads_row = jnp.where(s == sa, grads_row.at[oa: oa + n].set(total),
                          jnp.where(s == sb, grads_row.at[ob: ob + n].set(total), grads_row))
  if pipe.grad_clip_norm is not None:
    grads_row = grads_row * pl.clip_factor(jax.lax.psum(jnp.sum(jnp.square(grads_row)), STAGE),
                                           pipe.grad_clip_norm)
  return grads_row


def _gathered_mean(scheme, payload):
  """Mean over data replicas of the decoded payloads every replica all-gathered."""
  gathered = jax.tree.map(lambda a: jax.lax.all_gather(a, DATA), payload)
  return jax.vmap(scheme.codec.decode)(gathered).mean(axis=0)


def _with_metrics(run, metric_shape):
  """Stage branches other than the last return zero metrics of the last stage's structure."""
  def wrapped(*operands):
    y, ms, loss, metrics = run(*operands)
    if metrics is None:
      metrics = jax.tree.map(lambda m: jnp.zeros(m.shape, jnp.float32), metric_shape)
    return y, ms, loss, jax.tree.map(lambda v: v.astype(jnp.float32), metrics)
  return wrapped


def _abstract_template(pipe, optimizer, local_batch):
  """The simulate-layout TrainState's shapes (no real initialisation)."""
  opt = optimizer or optax.identity()
  return jax.eval_shape(lambda b: pl.init_state(pipe, opt, jax.random.key(0), b), local_batch)


def _pad(x, size, dtype):
  flat = x.reshape(x.shape[0], -1).astype(dtype)
  return jnp.pad(flat, ((0, 0), (0, size - flat.shape[1])))


def _unpad(buf, like):
  return buf[:, : _feature_size(like.shape)].reshape(like.shape).astype(like.dtype)


def _rows(table, rows, like):
  """Gathers message rows from a padded [rows, F] table and reshapes them to [B/M, ...]."""
  return jax.tree.map(lambda t: t[rows, : _feature_size(like.shape)].reshape(like.shape[0], *like.shape[1:]),
                      table)


def _put_rows(table, rows, new):
  def put(t, n):
    return t.at[rows, : n[0].size].set(n.reshape(n.shape[0], -1).astype(t.dtype))
  return jax.tree.map(put, table, new)


_ARRAY = re.compile(r"(pred|[suf]\d+|bf16|f8e4m3fn|f8e5m2)\[([\d,]*)\]")
_BYTES = {"pred": 1, "bf16": 2, "f8e4m3fn": 1, "f8e5m2": 1}


def _array_bytes(text):
  total = 0
  for dtype, dims in _ARRAY.findall(text):
    size = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
    total += size * _BYTES.get(dtype, int(dtype[1:]) // 8 if dtype[0] in "suf" else 0)
  return total


def _group_size_and_count(line):
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
  if iota:
    return int(iota.group(2)), int(iota.group(1))
  groups = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line).group(1)
  members = re.findall(r"\{([\d,]*)\}", groups)
  return len(members[0].split(",")), len(members)


def collective_permute_bytes(hlo_text: str) -> dict[str, int]:
  """Bytes the collectives of a compiled program send, summed over all devices.

  fwd/bwd: each collective-permute moves its operand once per source->target pair; a pair
  (a, a+1) is forward (activations), (a+1, a) backward (gradients). data: each all-gather
  over a group of n sends every member's operand (result / n) to the n-1 others.
  """
  totals = {"fwd": 0, "bwd": 0, "data": 0}
  for line in hlo_text.splitlines():
    if " all-gather(" in line or " all-gather-start(" in line:
      size, count = _group_size_and_count(line)
      result = line.split("=", 1)[1].split("all-gather", 1)[0]
      totals["data"] += _array_bytes(_ARRAY.search(result).group(0)) // size * (size - 1) * size * count
      continue
    if "collective-permute(" not in line and "collective-permute-start(" not in line:
      continue
    result = line.split("=", 1)[1].split("collective-permute", 1)[0]
    if "collective-permute-start(" in line:  # start returns (operand, result, ...): count one
      result = _ARRAY.search(result).group(0)
    pairs = re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=", 1)[1])
    for src, dst in pairs:
      totals["fwd" if int(dst) > int(src) else "bwd"] += _array_bytes(result)
  return totals
