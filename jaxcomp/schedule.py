"""The GPipe schedule of one stage device, as a few named functions.

Ticks t = 0 .. M+S-2. At tick t device s runs its stage on microbatch t - s (`busy` when
0 <= t - s < M), then every boundary b with a microbatch in flight (0 <= t - b < M) moves
that microbatch's encoded payload from stage b to b+1 with a `ppermute` (`PPermute`).
Autodiff replays the ticks in reverse; each boundary op's backward rule sends the encoded
gradient from b+1 to b.

`phases` splits the ticks in three. In the S-1 fill and S-1 drain ticks some stages idle:
those ticks are unrolled, so the program knows statically which boundaries carry a
microbatch and bubble ticks issue no collective at all. In the M-S+1 steady ticks every
stage and every boundary is busy: they run under one `lax.scan`, so the program's size (and
compile time) does not grow with M. A bubble tick runs the no-op branch of the stage
switch: no stage compute, nothing saved. With `remat="stage"` the stage call is a
`jax.checkpoint`: autodiff saves its inputs (the boundary activation buffer, per
microbatch in flight) and recomputes the stage's internals in the backward pass, instead
of saving the union of every stage branch's residuals.
"""
import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp import boundary as boundary_mod, layout, pipeline as pl
from jaxcomp.boundary import LinkState, Mode, Transport

STAGE = "stage"
REMAT = ("stage", "none")


@dataclasses.dataclass(frozen=True)
class PPermute(Transport):
  """Moves a payload from stage `src` to `src + 1` forward, and back."""
  src: int = 0

  def forward(self, payload):
    return jax.tree.map(lambda a: jax.lax.ppermute(a, STAGE, [(self.src, self.src + 1)]), payload)

  def backward(self, payload):
    return jax.tree.map(lambda a: jax.lax.ppermute(a, STAGE, [(self.src + 1, self.src)]), payload)


def phases(num_stages: int, microbatches: int) -> tuple[range, range, range]:
  """(fill, steady, drain) ticks; in steady ticks every stage and boundary is busy."""
  total = microbatches + num_stages - 1
  if microbatches < num_stages:
    return range(total), range(0), range(total, total)
  return range(num_stages - 1), range(num_stages - 1, microbatches), range(microbatches, total)


def busy(tick, stage, microbatches):
  """Whether `stage` has a microbatch (tick - stage) at `tick`."""
  return (tick - stage >= 0) & (tick - stage < microbatches)


def boundaries_at(tick: int, num_stages: int, microbatches: int) -> list[int]:
  """The boundaries a microbatch crosses at a (static) tick."""
  return [b for b in range(num_stages - 1) if busy(tick, b, microbatches)]


class Program(NamedTuple):
  """What a stage device needs to run the schedule: the pipeline and its padded layout."""
  pipe: pl.Pipeline
  params: layout.FlatRows  # parameter rows
  model_state: layout.FlatRows  # model-state rows
  shapes: list  # activation at each boundary, one microbatch of one data shard
  mode: Mode
  train: bool
  remat: str
  metrics: Any  # the last stage's metric structure (ShapeDtypeStructs)

  @property
  def width(self) -> int:
    return max([layout.feature_size(x.shape) for x in self.shapes] or [1])

  @property
  def act_dtype(self):
    return jnp.result_type(*[x.dtype for x in self.shapes] or [jnp.float32])


def stage_branch(prog: Program, j: int):
  """Stage j's body on one microbatch: (y buffer, model-state row, loss, metrics)."""
  pipe, last = prog.pipe, prog.pipe.num_stages - 1

  def run(params_row, ms_row, x_buf, mb, rng):
    x = mb[pipe.input_key] if j == 0 else layout.unpad(x_buf, prog.shapes[j - 1])
    y, ms = pipe.stages[j].apply(prog.params.get(j, params_row), prog.model_state.get(j, ms_row), x,
                                 train=prog.train, rng=rng)
    ms_row = prog.model_state.put(j, ms)
    if j < last:
      return layout.pad(y, prog.width, prog.act_dtype), ms_row, jnp.zeros((), jnp.float32), zero_metrics(prog)
    loss, metrics = pipe.loss_fn(y, mb)
    return x_buf, ms_row, loss.astype(jnp.float32), jax.tree.map(lambda v: v.astype(jnp.float32), metrics)
  return run


def bubble(prog: Program):
  """The idle tick: no compute, the model state unchanged, zero loss."""
  def run(params_row, ms_row, x_buf, mb, rng):
    return x_buf, ms_row, jnp.zeros((), jnp.float32), zero_metrics(prog)
  return run


def zero_metrics(prog: Program):
  return jax.tree.map(lambda m: jnp.zeros(m.shape, jnp.float32), prog.metrics)


def stage_step(prog: Program, tick, params_row, ms_row, x_buf, mbs, step_key):
  """This device's stage at `tick`: its microbatch, or the bubble branch when idle."""
  s_count, m_count = prog.pipe.num_stages, prog.pipe.microbatches
  branches = [stage_branch(prog, j) for j in range(s_count)] + [bubble(prog)]

  def run(tick, params_row, ms_row, x_buf, mbs, step_key):
    s = jax.lax.axis_index(STAGE)
    m = jnp.clip(tick - s, 0, m_count - 1)
    mb = jax.tree.map(lambda a: a[m], mbs)
    index = jnp.where(busy(tick, s, m_count), s, s_count)
    return jax.lax.switch(index, branches, params_row, ms_row, x_buf, mb, pl.stage_key(step_key, m, s))

  if prog.remat == "stage":
    run = jax.checkpoint(run)
  return run(jnp.asarray(tick, jnp.int32), params_row, ms_row, x_buf, mbs, step_key)


def boundary_step(prog: Program, tick, b: int, y_buf, fwd_tables, bwd_tables, mbs, step_key):
  """Boundary b carries microbatch tick - b: (received activation or None, forward tables)."""
  s = jax.lax.axis_index(STAGE)
  m, shape = tick - b, prog.shapes[b]
  mb_size = jax.tree.leaves(mbs)[0].shape[1]
  ids = mbs["id"][m] if "id" in mbs else None
  boundary = dataclasses.replace(prog.pipe.boundary, transport=PPermute(b))
  fwd_rows, bwd_rows = (pl.rows(scheme, m, mb_size, ids) for scheme in (boundary.fwd, boundary.bwd))
  (fs, fr), (bs, br) = fwd_tables, bwd_tables
  link = LinkState(layout.gather_rows(fs, fwd_rows, shape), layout.gather_rows(fr, fwd_rows, shape),
                   layout.gather_rows(bs, bwd_rows, shape), layout.gather_rows(br, bwd_rows, shape))
  x, (fs_new, fr_new) = boundary(layout.unpad(y_buf, shape), link, pl.link_key(step_key, m, b), prog.mode,
                                 s == b, s == b + 1)
  if prog.mode in (Mode.TRAIN, Mode.WARMUP):
    fwd_tables = (layout.put_rows(fs, fwd_rows, fs_new), layout.put_rows(fr, fwd_rows, fr_new))
  return layout.pad(x, prog.width, prog.act_dtype), fwd_tables


class Carry(NamedTuple):
  """What one tick hands the next."""
  x_buf: jax.Array  # the activation this device received, [B/M, F_max]
  model_state: jax.Array  # this stage's model-state row
  fwd_tables: tuple  # (forward sender, forward receiver) padded tables
  loss_sum: jax.Array
  metric_sums: Any


def tick_step(prog: Program, tick, boundaries, carry: Carry, params_row, bwd_tables, mbs, step_key) -> Carry:
  """One tick: this device's stage, then every boundary in `boundaries`."""
  y_buf, ms_row, loss, metrics = stage_step(prog, tick, params_row, carry.model_state, carry.x_buf, mbs,
                                            step_key)
  s = jax.lax.axis_index(STAGE)
  next_x, fwd_tables = jnp.zeros_like(carry.x_buf), carry.fwd_tables
  for b in boundaries:
    x, fwd_tables = boundary_step(prog, tick, b, y_buf, fwd_tables, bwd_tables, mbs, step_key)
    next_x = jnp.where(s == b + 1, x, next_x)
  return Carry(next_x, ms_row, fwd_tables, carry.loss_sum + loss,
               jax.tree.map(jnp.add, carry.metric_sums, metrics))


def run_gpipe(prog: Program, params_row, ms_row, fwd_tables, bwd_tables, mbs, step_key) -> Carry:
  """All M+S-1 ticks on this device: fill and drain unrolled, the steady ticks scanned."""
  s_count, m_count = prog.pipe.num_stages, prog.pipe.microbatches
  mb_size = jax.tree.leaves(mbs)[0].shape[1]
  carry = Carry(jnp.zeros((mb_size, prog.width), prog.act_dtype), ms_row, tuple(fwd_tables),
                jnp.zeros((), jnp.float32), zero_metrics(prog))
  tick = lambda t, c, bs: tick_step(prog, t, bs, c, params_row, bwd_tables, mbs, step_key)
  fill, steady, drain = phases(s_count, m_count)
  for t in fill:
    carry = tick(t, carry, boundaries_at(t, s_count, m_count))
  if len(steady):
    every = range(s_count - 1)
    carry, _ = jax.lax.scan(lambda c, t: (tick(t, c, every), None), carry,
                            jnp.arange(steady.start, steady.stop, dtype=jnp.int32))
  for t in drain:
    carry = tick(t, carry, boundaries_at(t, s_count, m_count))
  return carry


def make_program(pipe: pl.Pipeline, template: pl.TrainState, local_batch, mode: Mode, train: bool,
                 remat: str) -> Program:
  """The schedule's static layout for one data shard's batch `local_batch` (shapes only)."""
  if remat not in REMAT:
    raise ValueError(f"remat must be one of {REMAT}, got {remat!r}")
  mb = jax.tree.map(lambda x: x[0], pl.split_microbatches(local_batch, pipe.microbatches))
  shapes = pl.boundary_shapes(pipe, template.params, template.model_state, mb[pipe.input_key])
  prog = Program(pipe, layout.FlatRows(template.params), layout.FlatRows(template.model_state), shapes,
                 mode, train, remat, None)
  last = pipe.num_stages - 1
  x_buf = jax.ShapeDtypeStruct((mb[pipe.input_key].shape[0], prog.width), prog.act_dtype)

  def last_metrics(params_row, ms_row, x_buf, mb):
    x = mb[pipe.input_key] if last == 0 else layout.unpad(x_buf, shapes[last - 1])
    y, _ = pipe.stages[last].apply(prog.params.get(last, params_row), prog.model_state.get(last, ms_row), x,
                                   train=train, rng=jax.random.key(0))
    return pipe.loss_fn(y, mb)[1]

  row = lambda fl: jax.ShapeDtypeStruct((fl.size,), fl.dtype)
  metrics = jax.eval_shape(last_metrics, row(prog.params), row(prog.model_state), x_buf, mb)
  return prog._replace(metrics=metrics)


# ---------------------------------------------------------------- 1F1B (PipeDream-flush)
# Stage s runs microbatch m forward at tick m + s and backward at tick m + 2S - 2 - s: each
# tick a stage does at most one forward and one backward, the last stage both on the same
# microbatch. A stage keeps the inputs of the microbatches between its forward and its
# backward, at most 2(S-1-s)+1 <= 2S-1 of them, whatever M. The backward is explicit: the
# stage's vjp on its stashed input (rematerialised), and the boundary's `backward_half`.


def backward_tick(num_stages: int, stage):
  """Offset of a stage's backward: microbatch m's backward runs at tick m + offset."""
  return 2 * num_stages - 2 - stage


def stash_slots(num_stages: int) -> int:
  """Ring-buffer slots a stage needs for inputs awaiting their backward."""
  return 2 * num_stages - 1


def phases_1f1b(num_stages: int, microbatches: int) -> tuple[range, range, range]:
  """(fill, steady, drain) of the M + 2S - 2 ticks; in steady ticks every boundary carries a
  microbatch forward and one backward."""
  total = microbatches + 2 * num_stages - 2
  start = max(2 * num_stages - 3, 0)
  if microbatches <= start:
    return range(total), range(0), range(total, total)
  return range(start), range(start, microbatches), range(microbatches, total)


def backward_boundaries_at(tick: int, num_stages: int, microbatches: int) -> list[int]:
  """Boundaries whose gradient crosses at a (static) tick (boundary b: after stage b+1's backward)."""
  return [b for b in range(num_stages - 1) if busy(tick, backward_tick(num_stages, b + 1), microbatches)]


def stage_grads(prog: Program, j: int):
  """Stage j's vjp on one microbatch: (d params row, d input buffer) given the output's
  cotangent `g_buf` (stages before the last) or the loss weight `scale` (the last)."""
  run, last = stage_branch(prog, j), prog.pipe.num_stages - 1

  def grads(params_row, ms_row, x_buf, mb, rng, g_buf, scale):
    outputs = lambda p, x: (lambda out: (out[0], out[2]))(run(p, ms_row, x, mb, rng))
    _, vjp = jax.vjp(outputs, params_row, x_buf)
    dy = jnp.zeros_like(g_buf) if j == last else g_buf
    return vjp((dy, scale if j == last else jnp.zeros((), jnp.float32)))
  return grads


def no_grads(params_row, ms_row, x_buf, mb, rng, g_buf, scale):
  return jnp.zeros_like(params_row), jnp.zeros_like(x_buf)


def stage_backward(prog: Program, tick, params_row, stash, mbs, step_key, g_buf, scale):
  """This device's stage backward at `tick` (or nothing): (d params row, d input buffer)."""
  s_count, m_count = prog.pipe.num_stages, prog.pipe.microbatches
  s = jax.lax.axis_index(STAGE)
  m = jnp.clip(tick - backward_tick(s_count, s), 0, m_count - 1)
  slot = m % stash_slots(s_count)
  mb = jax.tree.map(lambda a: a[m], mbs)
  index = jnp.where(busy(tick, backward_tick(s_count, s), m_count), s, s_count)
  branches = [stage_grads(prog, j) for j in range(s_count)] + [no_grads]
  return jax.lax.switch(index, branches, params_row, stash.model_state[slot], stash.x_buf[slot], mb,
                        pl.stage_key(step_key, m, s), g_buf, scale)


class Stash(NamedTuple):
  """Per slot: a microbatch's stage input and model state (for its backward), and per
  boundary the TopK positions its forward chose (for index reuse)."""
  x_buf: jax.Array
  model_state: jax.Array
  indices: tuple


class Carry1F1B(NamedTuple):
  x_buf: jax.Array  # activation received for the next forward
  g_buf: jax.Array  # gradient received for the next backward
  stash: Stash
  model_state: jax.Array
  fwd_tables: tuple
  bwd_tables: tuple  # new backward states, written as the gradients pass
  grads: jax.Array  # this stage's weight-gradient row, summed over microbatches
  loss_sum: jax.Array
  metric_sums: Any


def _boundary(prog: Program, b: int):
  return dataclasses.replace(prog.pipe.boundary, transport=PPermute(b))


def _link_rows(prog, m, b, mbs):
  mb_size = jax.tree.leaves(mbs)[0].shape[1]
  ids = mbs["id"][m] if "id" in mbs else None
  boundary = prog.pipe.boundary
  return tuple(pl.rows(scheme, m, mb_size, ids) for scheme in (boundary.fwd, boundary.bwd))


def forward_exchange(prog: Program, tick, b: int, y_buf, carry: Carry1F1B, mbs, step_key):
  """Boundary b's forward half for microbatch tick - b: (received activation, carry)."""
  s = jax.lax.axis_index(STAGE)
  m, shape = tick - b, prog.shapes[b]
  fwd_rows, _ = _link_rows(prog, m, b, mbs)
  fs, fr = carry.fwd_tables
  x, fs_new, fr_new, idx = boundary_mod.forward_half(
      _boundary(prog, b), prog.mode is Mode.WARMUP, layout.unpad(y_buf, shape),
      layout.gather_rows(fs, fwd_rows, shape), layout.gather_rows(fr, fwd_rows, shape),
      pl.link_key(step_key, m, b), s == b, s == b + 1)
  tables = (layout.put_rows(fs, fwd_rows, fs_new), layout.put_rows(fr, fwd_rows, fr_new))
  stash = carry.stash
  if idx is not None:
    slot = m % stash_slots(prog.pipe.num_stages)
    stored = jax.tree.map(lambda buf, new: buf.at[slot].set(new), stash.indices[b], idx)
    stash = stash._replace(indices=stash.indices[:b] + (stored,) + stash.indices[b + 1:])
  return layout.pad(x, prog.width, prog.act_dtype), carry._replace(fwd_tables=tables, stash=stash)


def backward_exchange(prog: Program, tick, b: int, dx_buf, bwd_old, carry: Carry1F1B, mbs, step_key):
  """Boundary b's backward half for the microbatch whose stage b+1 backward ran this tick:
  (gradient received by stage b, carry with the new backward-state rows)."""
  s = jax.lax.axis_index(STAGE)
  m = tick - backward_tick(prog.pipe.num_stages, b + 1)
  shape = prog.shapes[b]
  _, rows = _link_rows(prog, m, b, mbs)
  bs_old, br_old = bwd_old
  idx = None
  if prog.pipe.boundary.reuse and prog.mode is not Mode.WARMUP:
    idx = jax.tree.map(lambda buf: buf[m % stash_slots(prog.pipe.num_stages)], carry.stash.indices[b])
  dx, bs_new, br_new = boundary_mod.backward_half(
      _boundary(prog, b), prog.mode is Mode.WARMUP, layout.unpad(dx_buf, shape),
      layout.gather_rows(bs_old, rows, shape), layout.gather_rows(br_old, rows, shape),
      pl.link_key(step_key, m, b), s == b, s == b + 1, idx)
  bs, br = carry.bwd_tables
  keep = lambda ok, table, new: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new,
                                             layout.gather_rows(table, rows, shape))
  tables = (layout.put_rows(bs, rows, keep(s == b + 1, bs, bs_new)),
            layout.put_rows(br, rows, keep(s == b, br, br_new)))
  return layout.pad(dx, prog.width, prog.act_dtype), carry._replace(bwd_tables=tables)


def tick_1f1b(prog: Program, tick, fwd_bs, bwd_bs, carry: Carry1F1B, params_row, bwd_old, mbs, step_key,
              scale) -> Carry1F1B:
  """One tick: this stage's forward (stashing its input), its backward, then the boundaries."""
  s = jax.lax.axis_index(STAGE)
  s_count, m_count = prog.pipe.num_stages, prog.pipe.microbatches
  slot = jnp.clip(tick - s, 0, m_count - 1) % stash_slots(s_count)
  forward_busy = busy(tick, s, m_count)
  stash = carry.stash
  stash = stash._replace(
      x_buf=stash.x_buf.at[slot].set(jnp.where(forward_busy, carry.x_buf, stash.x_buf[slot])),
      model_state=stash.model_state.at[slot].set(jnp.where(forward_busy, carry.model_state,
                                                           stash.model_state[slot])))
  y_buf, ms_row, loss, metrics = stage_step(prog, tick, params_row, carry.model_state, carry.x_buf, mbs,
                                            step_key)
  dp, dx_buf = stage_backward(prog, tick, params_row, stash, mbs, step_key, carry.g_buf, scale)
  carry = carry._replace(stash=stash, model_state=ms_row, grads=carry.grads + dp, loss_sum=carry.loss_sum + loss,
                         metric_sums=jax.tree.map(jnp.add, carry.metric_sums, metrics))
  next_x, next_g = jnp.zeros_like(carry.x_buf), jnp.zeros_like(carry.g_buf)
  for b in fwd_bs:
    x, carry = forward_exchange(prog, tick, b, y_buf, carry, mbs, step_key)
    next_x = jnp.where(s == b + 1, x, next_x)
  for b in bwd_bs:
    g, carry = backward_exchange(prog, tick, b, dx_buf, bwd_old, carry, mbs, step_key)
    next_g = jnp.where(s == b, g, next_g)
  return carry._replace(x_buf=next_x, g_buf=next_g)


def _index_shapes(prog: Program, b: int, mb_size: int):
  """Shapes of boundary b's (sent, arrived) TopK positions (index reuse), else None."""
  if not prog.pipe.boundary.reuse or prog.mode is Mode.WARMUP:
    return None
  shape = prog.shapes[b]
  local = dataclasses.replace(prog.pipe.boundary, transport=boundary_mod.Transport())
  state = local.init(mb_size, shape.shape[1:], shape.dtype)
  return jax.eval_shape(lambda x: boundary_mod.forward_half(local, False, x, state.fwd_send, state.fwd_recv,
                                                          jax.random.key(0), True, True)[3], shape)


def run_1f1b(prog: Program, params_row, ms_row, fwd_tables, bwd_tables, mbs, step_key, scale) -> Carry1F1B:
  """All M + 2S - 2 ticks of 1F1B on this device, the steady ones scanned. `scale` weighs
  each microbatch's loss (1 / (M D)): the returned `grads` and backward tables are those of
  the weighted sum, as autodiff of GPipe's mean loss gives them."""
  s_count, m_count = prog.pipe.num_stages, prog.pipe.microbatches
  mb_size = jax.tree.leaves(mbs)[0].shape[1]
  k = stash_slots(s_count)
  buf = jnp.zeros((mb_size, prog.width), prog.act_dtype)
  indices = tuple(jax.tree.map(lambda a: jnp.zeros((k, *a.shape), a.dtype), _index_shapes(prog, b, mb_size))
                  for b in range(s_count - 1))
  stash = Stash(jnp.zeros((k, *buf.shape), buf.dtype), jnp.zeros((k, *ms_row.shape), ms_row.dtype), indices)
  carry = Carry1F1B(buf, buf, stash, ms_row, tuple(fwd_tables), jax.tree.map(jnp.zeros_like, tuple(bwd_tables)),
                    jnp.zeros_like(params_row), jnp.zeros((), jnp.float32), zero_metrics(prog))
  tick = lambda t, c, fb, bb: tick_1f1b(prog, t, fb, bb, c, params_row, bwd_tables, mbs, step_key, scale)
  fill, steady, drain = phases_1f1b(s_count, m_count)
  static = lambda t: (boundaries_at(t, s_count, m_count), backward_boundaries_at(t, s_count, m_count))
  for t in fill:
    carry = tick(t, carry, *static(t))
  if len(steady):
    every = range(s_count - 1)
    carry, _ = jax.lax.scan(lambda c, t: (tick(t, c, every, every), None), carry,
                            jnp.arange(steady.start, steady.stop, dtype=jnp.int32))
  for t in drain:
    carry = tick(t, carry, *static(t))
  return carry
