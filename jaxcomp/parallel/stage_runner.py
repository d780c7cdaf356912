"""A schedule's timetable (`jaxcomp.parallel.timetable`) run on one stage device.

The table says what runs when: every static part of the program (the ticks, which boundaries carry a
message at a tick, which op kinds and stages' bodies a tick's switches hold, the stash slots) is read
from it, and so is every traced one: `Lookup` holds, per tick and device, the microbatch of each op
kind it runs and its chunk, and per tick and boundary the microbatch of the message sent and of the one
received (`op_at`, `chunk_at`, `message_at`), so a tick inside a `lax.scan` indexes them with its traced
number. A device holds V chunks (chunk c on device c mod S: one with GPipe and 1F1B, V with interleaved
1F1B), each with its rows and rings. At its forward tick a chunk runs on the input its ring holds for that
microbatch (`Stash`: delivered when the message arrived, kept for the backward); then every boundary b
with a message at that tick moves the encoded payload from chunk b's device to chunk b+1's with the op of
`jaxcomp.ppermute` (`permute`, along `link_perm(b)`: a ring); backwards likewise send gradients from
b+1 to b, into the receiver's gradient ring. A message may wait in its ring any number of ticks before
its op runs, so any legal table runs (`check_runnable`). With overlapped sends (the table's forwarding delay 2,
`overlapped_tick`) the payload is encoded at that tick, crosses during the next one while the stages
compute, and is decoded at the tick after. A bubble tick runs the no-op branch of the stage switch: no
stage compute, nothing saved. The program knows statically which boundaries carry a message at a tick
(idle links issue no collective at all); runs of ticks that repeat the same plans period after period
are one `lax.scan` (`segments`), so the program's size (and compile time) does not grow with M.

Two ways to get the backward pass:
- `run_explicit` (every schedule of `jaxcomp.parallel.schedules`, below): a stage keeps its input
  from its forward, and at its backward op runs its vjp on it (rematerialised) and the boundary's
  `backward_half` (its halves apart with overlapped sends); the weight gradient is accumulated in the
  loop. A fused BW is one vjp over (parameters, input); a split B is the vjp over the input only (its
  gradient sent at once) and W the vjp over the parameters only, on the stashed input and the stashed
  output cotangent: each recomputes the stage's forward (ZB-H1's W costs a forward more than its share of BW).
- `run_gpipe`: the forward ticks only (eval steps, and GPipe with `remat="none"`), whose
  autodiff replays the ticks in reverse: each boundary op's custom_vjp rule sends the
  encoded gradient from b+1 to b, and every stage's internals are saved.
"""
import contextlib
import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp import pipeline
from jaxcomp.compress import boundary as boundary_mod
from jaxcomp.compress.boundary import LinkState, Mode
from jaxcomp.parallel import layout, permute, schedules
from jaxcomp.parallel.mesh import DATA, STAGE, WRAPPED
from jaxcomp.parallel.plan import Plan, TickPlan, link_ends, link_perm, ring_slot
from jaxcomp.parallel.timetable import Timetable

REMAT = ("stage", "none")


def op_at(prog, tick, kind: str, device):
  """(whether `device` runs an op of `kind` at `tick`, its microbatch: 0 when it runs none)."""
  m = jnp.asarray(prog.plan.lookup.ops[kind])[tick, device]
  return m >= 0, jnp.maximum(m, 0)


def chunk_at(prog, tick, kind: str, device):
  """(the slot v on `device` of the chunk it runs an op of `kind` of at `tick`, that chunk v D + device, D
  devices): slot 0 when it runs none; with one chunk per device v is the Python int 0 (static indexing: the
  program of a stage per device)."""
  if prog.plan.table.num_chunks == prog.plan.table.num_devices:
    return 0, device
  v = jnp.asarray(prog.plan.lookup.chunks[kind])[tick, device]
  return v, v * prog.plan.table.num_devices + device


def message_at(prog, tick, b: int, forward: bool, received: bool = False):
  """The microbatch of boundary b's activation (`forward`) or gradient sent at the end of `tick`, or
  (`received`) taken in by its receiver at `tick` (the plan says there is one)."""
  return jnp.asarray((prog.plan.lookup.received if received else prog.plan.lookup.sent)[forward])[tick, b]


def link_scope(prog, b: int):
  """The scope of boundary b's collectives: `mesh.WRAPPED` where the ring wraps around (its activations go
  from a device to one of lower index), none elsewhere."""
  sender, receiver = link_ends(b, prog.plan.table.num_devices)
  return jax.named_scope(WRAPPED) if receiver < sender else contextlib.nullcontext()


def at_ends(prog, b: int):
  """(whether this device is boundary b's sender, whether it is its receiver), traced."""
  s = jax.lax.axis_index(STAGE)
  sender, receiver = link_ends(b, prog.plan.table.num_devices)
  return s == sender, s == receiver


def global_microbatch(prog, m):
  """Index in the global batch of this data shard's microbatch m (keys are drawn by it, so
  stochastic codecs and dropout equal `simulate`'s at the global batch)."""
  return jax.lax.axis_index(DATA) * prog.pipe.microbatches + m


class StepInputs(NamedTuple):
  """What every tick of one step reads and none changes."""
  params_row: jax.Array  # this device's parameter row ([P], `run_gpipe`), or its chunks' ([V, P], `run_explicit`)
  bwd_tables: tuple  # (backward sender, backward receiver) tables as the step found them
  mbs: Any  # this data shard's microbatches, [M, B/M, ...] per batch key
  step_key: jax.Array
  scale: Any = None  # each microbatch's loss weight, 1 / (M D) (`run_explicit`)


class Program(NamedTuple):
  """What a stage device needs to run the schedule: the pipeline and its padded layout."""
  pipe: pipeline.Pipeline
  params: layout.FlatRows  # parameter rows
  model_state: layout.FlatRows  # model-state rows
  shapes: list  # activation at each boundary, one microbatch of one data shard
  mode: Mode
  train: bool
  metrics: Any  # the last stage's metric structure (ShapeDtypeStructs)
  plan: Plan  # the schedule's table compiled: what every tick reads (`run_gpipe` runs its forward ticks)

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


def stage_switch(prog: Program, tick, kind: str, branch, idle, *operands):
  """This device runs `branch(c)` when it runs an op of `kind` (F, B, W or BW) of chunk c at `tick`, else
  `idle`. At a static tick only the chunks the table runs then are branches of the program:
  an unrolled tick holds min(M, S) stage bodies, not S (GPipe with M=1 compiles S bodies, as simulate)."""
  s_count, s = prog.pipe.num_stages, jax.lax.axis_index(STAGE)
  stages = (list(range(s_count)) if not isinstance(tick, int)
            else list(prog.plan.running[kind][tick]))
  position = jnp.asarray([stages.index(j) if j in stages else len(stages) for j in range(s_count)], jnp.int32)
  index = jnp.where(op_at(prog, tick, kind, s)[0], position[chunk_at(prog, tick, kind, s)[1]], len(stages))
  return jax.lax.switch(index, [branch(j) for j in stages] + [idle], *operands)


def stage_step(prog: Program, inp: StepInputs, tick, params_row, ms_row, x_buf):
  """This device's forward at `tick` of the chunk whose rows are given: its microbatch, or the bubble
  branch when idle."""
  s = jax.lax.axis_index(STAGE)
  _, m = op_at(prog, tick, "F", s)
  mb = jax.tree.map(lambda a: a[m], inp.mbs)
  rng = pipeline.stage_key(inp.step_key, global_microbatch(prog, m), chunk_at(prog, tick, "F", s)[1])
  return stage_switch(prog, tick, "F", lambda j: stage_branch(prog, j), bubble(prog),
                      params_row, ms_row, x_buf, mb, rng)


def _boundary(prog: Program, b: int):
  """Boundary b's op with its transport: the explicit schedules run its halves."""
  perm = link_perm(b, prog.plan.table.num_devices)
  return dataclasses.replace(prog.pipe.boundary, transport=permute.Permute(STAGE, perm))


SENDER, RECEIVER = 0, 1  # boundary b's ends: chunk b (forward sender, backward receiver) and chunk b+1


def end_slot(prog: Program, b: int, end: int) -> int | None:
  """Where boundary b's state table at its `end` is among this device's: with V > 1 chunks per device the
  tables are [V, rows, F], the end's chunk (b + end) at slot (b + end) // D; with one chunk (None) the table
  itself."""
  return None if prog.plan.table.chunks_per_device == 1 else prog.plan.table.slot(b + end)


def end_rows(prog: Program, table, b: int, end: int, rows, like):
  """`layout.gather_rows` of boundary b's rows from its `end`'s table among this device's (`end_slot`)."""
  return layout.gather_rows(table, rows, like, end_slot(prog, b, end))


def put_end_rows(prog: Program, table, b: int, end: int, rows, new):
  """`layout.put_rows` of boundary b's new rows into its `end`'s table among this device's (`end_slot`), in
  place."""
  return layout.put_rows(table, rows, new, end_slot(prog, b, end))


def microbatch_size(mbs) -> int:
  """Examples per microbatch of microbatched inputs [M, B/M, ...]."""
  return jax.tree.leaves(mbs)[0].shape[1]


def _link_rows(prog, m, mbs):
  """(forward, backward) state rows of microbatch m (its slots, or its examples' ids)."""
  mb_size = microbatch_size(mbs)
  ids = mbs["id"][m] if "id" in mbs else None
  boundary = prog.pipe.boundary
  return tuple(pipeline.rows(scheme, m, mb_size, ids) for scheme in (boundary.fwd, boundary.bwd))


def forward_exchange(prog: Program, inp: StepInputs, tick, b: int, y_buf, fwd_tables, differentiable: bool):
  """Boundary b's forward for its microbatch at `tick`: (received activation buffer, forward tables,
  TopK positions sent or None). `differentiable`: the whole boundary op, whose custom_vjp sends
  the gradient back under autodiff (`run_gpipe`; in an eval step its stateless path); else its forward
  half (`run_explicit`)."""
  sender, receiver = at_ends(prog, b)
  m, shape = message_at(prog, tick, b, forward=True), prog.shapes[b]
  fwd_rows, bwd_rows = _link_rows(prog, m, inp.mbs)
  (fs, fr), (bs, br) = fwd_tables, inp.bwd_tables
  y, key = layout.unpad(y_buf, shape), pipeline.link_key(inp.step_key, global_microbatch(prog, m), b)
  sent, arrived = end_rows(prog, fs, b, SENDER, fwd_rows, shape), end_rows(prog, fr, b, RECEIVER, fwd_rows, shape)
  if differentiable:
    link = LinkState(sent, arrived, end_rows(prog, bs, b, RECEIVER, bwd_rows, shape),
                     end_rows(prog, br, b, SENDER, bwd_rows, shape))
    x, new = permute.CompressedLink(prog.pipe.boundary).ppermute(y, link, STAGE, link_perm(b, prog.plan.table.num_devices),
                                                                 key, mode=prog.mode)
    fs_new, fr_new, idx = new.fwd_send, new.fwd_recv, None
  else:
    x, fs_new, fr_new, idx = boundary_mod.forward_half(_boundary(prog, b), prog.mode, y, sent, arrived, key,
                                                       sender, receiver)
  if prog.mode.trains:
    fwd_tables = (put_end_rows(prog, fs, b, SENDER, fwd_rows, fs_new),
                  put_end_rows(prog, fr, b, RECEIVER, fwd_rows, fr_new))
  return layout.pad(x, prog.width, prog.act_dtype), fwd_tables, idx


class Carry(NamedTuple):
  """What one tick hands the next."""
  x_buf: jax.Array  # the activation this device received, [B/M, F_max]
  model_state: jax.Array  # this stage's model-state row
  fwd_tables: tuple  # (forward sender, forward receiver) padded tables
  loss_sum: jax.Array
  metric_sums: Any


def tick_step(prog: Program, inp: StepInputs, tick, boundaries, carry: Carry) -> Carry:
  """One tick: this device's stage, then every boundary in `boundaries`."""
  y_buf, ms_row, loss, metrics = stage_step(prog, inp, tick, inp.params_row, carry.model_state, carry.x_buf)
  next_x, fwd_tables = jnp.zeros_like(carry.x_buf), carry.fwd_tables
  for b in boundaries:
    x, fwd_tables, _ = forward_exchange(prog, inp, tick, b, y_buf, fwd_tables, differentiable=True)
    next_x = jnp.where(at_ends(prog, b)[1], x, next_x)
  return Carry(next_x, ms_row, fwd_tables, carry.loss_sum + loss,
               jax.tree.map(jnp.add, carry.metric_sums, metrics))


def run_gpipe(prog: Program, params_row, ms_row, fwd_tables, bwd_tables, mbs, step_key) -> Carry:
  """The M+S-1 forward ticks (GPipe's table: F(s, m) at tick m + s) on this device: fill and drain unrolled,
  the steady ticks scanned (differentiable: its autodiff is GPipe's backward)."""
  s_count = prog.pipe.num_stages
  mb_size = microbatch_size(mbs)
  carry = Carry(jnp.zeros((mb_size, prog.width), prog.act_dtype), ms_row, tuple(fwd_tables),
                jnp.zeros((), jnp.float32), zero_metrics(prog))
  inp = StepInputs(params_row, tuple(bwd_tables), mbs, step_key)
  tick = lambda t, c, bs: tick_step(prog, inp, t, bs, c)
  fill, steady, drain = prog.plan.phases
  for t in fill:
    carry = tick(t, carry, prog.plan.sends(t))
  if len(steady):
    every = range(s_count - 1)
    carry, _ = jax.lax.scan(lambda c, t: (tick(t, c, every), None), carry,
                            jnp.arange(steady.start, steady.stop, dtype=jnp.int32))
  for t in drain:
    carry = tick(t, carry, prog.plan.sends(t))
  return carry


def make_program(pipe: pipeline.Pipeline, template: pipeline.TrainState, local_batch, mode: Mode, train: bool,
                 table: Timetable | None = None) -> Program:
  """The schedule's static layout for one data shard's batch `local_batch` (shapes only); `table`
  defaults to GPipe's (the forward ticks `run_gpipe` runs)."""
  table = table or schedules.GPipe().train_table(pipe.num_stages, pipe.microbatches)
  mb = pipeline.microbatch_shapes(local_batch, pipe.microbatches)
  shapes = pipeline.boundary_shapes(pipe, template.params, template.model_state, mb[pipe.input_key])
  prog = Program(pipe, layout.FlatRows(template.params), layout.FlatRows(template.model_state), shapes,
                 mode, train, None, Plan(table, forwards_only=not train))
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


# ---------------------------------------------------------------- explicit backward
# A backward runs the stage's vjp on the input it stashed (rematerialised), then the boundary's
# `backward_half` sends the gradient on. The ticks are cut into periods (`segments`); a run of periods
# with the same plans runs under one `lax.scan` (the same collectives every period), the other periods
# are unrolled.


def stage_grads(prog: Program, j: int, kind: str):
  """Stage j's vjp on one microbatch for a backward op of `kind`, given the output's cotangent `g_buf`
  (stages before the last) or the loss weight `scale` (the last): BW (grads + d params row, d input
  buffer) by one vjp over both; B (grads, d input buffer), W (grads + d params row, zeros), each a vjp
  over its one argument. The sum is taken inside the branch, so a backward tick holds one gradient row,
  not a fresh d params row beside the sum."""
  run, last = stage_branch(prog, j), prog.pipe.num_stages - 1

  def grads(params_row, ms_row, x_buf, mb, rng, g_buf, scale, grad_sum):
    outputs = lambda p, x: (lambda out: (out[0], out[2]))(run(p, ms_row, x, mb, rng))
    dy = jnp.zeros_like(g_buf) if j == last else g_buf
    cotangent = (dy, scale if j == last else jnp.zeros((), jnp.float32))
    if kind == "B":
      return grad_sum, jax.vjp(lambda x: outputs(params_row, x), x_buf)[1](cotangent)[0]
    if kind == "W":
      return grad_sum + jax.vjp(lambda p: outputs(p, x_buf), params_row)[1](cotangent)[0], jnp.zeros_like(x_buf)
    _, vjp = jax.vjp(outputs, params_row, x_buf)
    dp, dx = vjp(cotangent)
    return grad_sum + dp, dx
  return grads


def no_grads(params_row, ms_row, x_buf, mb, rng, g_buf, scale, grad_sum):
  return grad_sum, jnp.zeros_like(x_buf)


def stage_backward(prog: Program, inp: StepInputs, tick, kind: str, stash, grad_sum):
  """This device's backward op of `kind` at `tick` (or nothing), on the input and output cotangent its
  rings hold for the op's microbatch: (grad_sum (+ d params row), d input buffer)."""
  s = jax.lax.axis_index(STAGE)
  _, m = op_at(prog, tick, kind, s)
  v, c = chunk_at(prog, tick, kind, s)
  slot = ring_slot(prog.plan.lookup.stash_slots, v, m)
  mb = jax.tree.map(lambda a: a[m], inp.mbs)
  chunk_sum, dx = stage_switch(prog, tick, kind, lambda j: stage_grads(prog, j, kind), no_grads,
                               inp.params_row[v], stash.model_state[slot], stash.x_buf[slot], mb,
                               pipeline.stage_key(inp.step_key, global_microbatch(prog, m), c),
                               stash.g_buf[ring_slot(prog.plan.lookup.grad_slots, v, m)], inp.scale, grad_sum[v])
  return grad_sum.at[v].set(chunk_sum), dx


class Stash(NamedTuple):
  """This device's rings, one per chunk it holds, chunk slot v's microbatch m in slot `ring_slot(slots, v, m)`
  (`Lookup`): its chunks' inputs (delivered when they arrive) and model states (at their forward), V x
  `stash_slots`; per boundary the TopK positions its forward chose (for index reuse), `stash_slots`, slot
  m % slots; its chunks' output cotangents (delivered when the gradient arrives, for B and W or BW), V x
  `grad_slots`."""
  x_buf: jax.Array
  model_state: jax.Array
  indices: tuple
  g_buf: jax.Array


class InFlight(NamedTuple):
  """Overlapped sends: per boundary, the payload its sender encoded at the tick before (it crosses the link
  during this tick) and the one that crossed during the tick before (its receiver decodes it at this
  tick); the activations' and the gradients'. Payloads only: no dense tensor waits between ticks."""
  fwd_sent: tuple
  fwd_arrived: tuple
  bwd_sent: tuple
  bwd_arrived: tuple


class ExplicitCarry(NamedTuple):
  stash: Stash
  model_state: jax.Array  # this device's chunks' model-state rows, [V, Q]
  fwd_tables: tuple
  bwd_tables: tuple  # new backward states, written as the gradients pass
  grads: jax.Array  # its chunks' weight-gradient rows [V, P], summed over microbatches
  loss_sum: jax.Array
  metric_sums: Any
  in_flight: Any = ()  # `InFlight` with overlapped sends


def deliver(prog: Program, carry: ExplicitCarry, b: int, m, ok, value, forward: bool) -> ExplicitCarry:
  """Microbatch m's activation (`forward`) or gradient received over boundary b into the ring of the chunk
  that takes it in (b+1, or b), on the device where `ok` (the boundary's receiver)."""
  field, slots = ("x_buf", prog.plan.lookup.stash_slots) if forward else ("g_buf", prog.plan.lookup.grad_slots)
  ring, slot = getattr(carry.stash, field), ring_slot(slots, prog.plan.table.slot(b + forward), m)
  ring = ring.at[slot].set(jnp.where(ok, value, ring[slot]))
  return carry._replace(stash=carry.stash._replace(**{field: ring}))


def stash_positions(prog: Program, carry: ExplicitCarry, b: int, m, positions, end: int | None = None):
  """Boundary b's TopK positions of microbatch m (index reuse) written to its stash slot: the (sender's,
  receiver's) pair, or the one `end` (0 sender, 1 receiver) given; none is None."""
  if positions is None:
    return carry
  slot, old = m % prog.plan.lookup.stash_slots, carry.stash.indices[b]
  put = lambda bufs, new: jax.tree.map(lambda buf, n: buf.at[slot].set(n), bufs, new)
  stored = put(old, positions) if end is None else tuple(put(part, positions) if i == end else part
                                                         for i, part in enumerate(old))
  indices = carry.stash.indices[:b] + (stored,) + carry.stash.indices[b + 1:]
  return carry._replace(stash=carry.stash._replace(indices=indices))


def stashed_positions(prog: Program, carry: ExplicitCarry, b: int, m):
  """Boundary b's (sender's, receiver's) TopK positions of microbatch m for its backward, or None without
  index reuse (or in a step whose forward is dense)."""
  if not prog.pipe.boundary.reuse or prog.mode.dense_forward:
    return None
  return jax.tree.map(lambda buf: buf[m % prog.plan.lookup.stash_slots], carry.stash.indices[b])


def stash_exchange(prog: Program, inp: StepInputs, tick, b: int, y_buf, carry: ExplicitCarry) -> ExplicitCarry:
  """`forward_exchange` (its forward half) of the explicit schedule: the activation delivered to stage
  b+1's ring, its TopK positions stashed for index reuse; an eval step's the whole stateless op."""
  sender, receiver = at_ends(prog, b)
  x, tables, idx = forward_exchange(prog, inp, tick, b, y_buf, carry.fwd_tables, differentiable=not prog.mode.trains)
  m = message_at(prog, tick, b, forward=True)
  carry = stash_positions(prog, carry, b, m, idx)
  return deliver(prog, carry._replace(fwd_tables=tables), b, m, receiver, x, forward=True)


def keep_end_rows(prog: Program, table, b: int, end: int, ok, rows, like, new):
  """`put_end_rows` of boundary b's `new` rows at its `end` on the device where `ok` (this device is that
  end); elsewhere the rows the table holds stay."""
  old = end_rows(prog, table, b, end, rows, like)
  return put_end_rows(prog, table, b, end, rows, jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old))


def backward_exchange(prog: Program, inp: StepInputs, tick, b: int, dx_buf, carry: ExplicitCarry) -> ExplicitCarry:
  """Boundary b's backward half for the microbatch whose stage b+1 input gradient was made this tick: the
  gradient delivered to stage b's ring, the carry with the new backward-state rows."""
  sender, receiver = at_ends(prog, b)
  m = message_at(prog, tick, b, forward=False)
  shape = prog.shapes[b]
  _, rows = _link_rows(prog, m, inp.mbs)
  bs_old, br_old = inp.bwd_tables
  dx, bs_new, br_new = boundary_mod.backward_half(
      _boundary(prog, b), prog.mode, layout.unpad(dx_buf, shape),
      end_rows(prog, bs_old, b, RECEIVER, rows, shape), end_rows(prog, br_old, b, SENDER, rows, shape),
      pipeline.link_key(inp.step_key, global_microbatch(prog, m), b), sender, receiver,
      stashed_positions(prog, carry, b, m))
  bs, br = carry.bwd_tables
  tables = (keep_end_rows(prog, bs, b, RECEIVER, receiver, rows, shape, bs_new),
            keep_end_rows(prog, br, b, SENDER, sender, rows, shape, br_new))
  return deliver(prog, carry._replace(bwd_tables=tables), b, m, sender,
                 layout.pad(dx, prog.width, prog.act_dtype), forward=False)


def stage_ops(prog: Program, inp: StepInputs, tick, plan: TickPlan, carry: ExplicitCarry):
  """This device's ops at `tick`, in `ORDER`: its forward on the input its ring holds (stashing its model
  state), then its backward ops: (carry, activation made, input gradient made). Kinds that no stage runs
  at this tick (by `plan`) are left out of the program."""
  s = jax.lax.axis_index(STAGE)
  y_buf = dx_buf = jnp.zeros(carry.stash.x_buf.shape[1:], carry.stash.x_buf.dtype)
  if "F" in plan.kinds:
    forward_busy, m = op_at(prog, tick, "F", s)
    v, _ = chunk_at(prog, tick, "F", s)
    slot = ring_slot(prog.plan.lookup.stash_slots, v, m)
    stash = carry.stash._replace(model_state=carry.stash.model_state.at[slot].set(
        jnp.where(forward_busy, carry.model_state[v], carry.stash.model_state[slot])))
    y_buf, ms_row, loss, metrics = stage_step(prog, inp, tick, inp.params_row[v], carry.model_state[v],
                                              carry.stash.x_buf[slot])
    carry = carry._replace(stash=stash, model_state=carry.model_state.at[v].set(ms_row), loss_sum=carry.loss_sum + loss,
                           metric_sums=jax.tree.map(jnp.add, carry.metric_sums, metrics))
  for kind in (kind for kind in plan.kinds if kind != "F"):
    grads, dx = stage_backward(prog, inp, tick, kind, carry.stash, carry.grads)
    carry = carry._replace(grads=grads)
    if kind != "W":
      dx_buf = jnp.where(op_at(prog, tick, kind, s)[0], dx, dx_buf)
  return carry, y_buf, dx_buf


def explicit_tick(prog: Program, inp: StepInputs, tick, plan: TickPlan, carry: ExplicitCarry) -> ExplicitCarry:
  """One tick: this stage's ops, then the boundaries (each message delivered into its receiver's ring)."""
  carry, y_buf, dx_buf = stage_ops(prog, inp, tick, plan, carry)
  for b in plan.fwd_sends:
    with link_scope(prog, b):
      carry = stash_exchange(prog, inp, tick, b, y_buf, carry)
  for b in plan.bwd_sends:
    with link_scope(prog, b):
      carry = backward_exchange(prog, inp, tick, b, dx_buf, carry)
  return carry


# ---------------------------------------------------------------- overlapped sends
# With the table's forwarding delay 2 a boundary's message is encoded where it is made (tick t), crosses its link during
# tick t+1 while both ends compute (its collective reads only the carry, so nothing of tick t+1 waits for
# it), and is decoded where it is used (tick t+2). Each end's compression state moves at its own end:
# the sender's rows at the encode, the receiver's at the decode, each by its own microbatch.


def encode_forward(prog: Program, inp: StepInputs, tick, b: int, y_buf, carry: ExplicitCarry) -> ExplicitCarry:
  """Stage b encodes the activation its forward made at `tick` (its forward-sender rows, and under index
  reuse its TopK positions, stashed): the payload waits in `in_flight` to cross during the next tick."""
  (sender, receiver), shape, link = at_ends(prog, b), prog.shapes[b], _boundary(prog, b)
  m = message_at(prog, tick, b, forward=True)
  rows, _ = _link_rows(prog, m, inp.mbs)
  fs, fr = carry.fwd_tables
  payload, fs_new = boundary_mod.forward_send(link, prog.mode, layout.unpad(y_buf, shape),
                                              end_rows(prog, fs, b, SENDER, rows, shape),
                                              pipeline.link_key(inp.step_key, global_microbatch(prog, m), b), sender)
  carry = stash_positions(prog, carry, b, m, boundary_mod.reuse_positions(link, prog.mode, payload), end=0)
  sent = carry.in_flight.fwd_sent[:b] + (payload,) + carry.in_flight.fwd_sent[b + 1:]
  return carry._replace(fwd_tables=(put_end_rows(prog, fs, b, SENDER, rows, fs_new), fr),
                        in_flight=carry.in_flight._replace(fwd_sent=sent))


def decode_forward(prog: Program, inp: StepInputs, tick, b: int, carry: ExplicitCarry) -> ExplicitCarry:
  """Stage b+1 decodes boundary b's payload that crossed during the tick before into its ring (its
  forward-receiver rows, and under index reuse its copy of the TopK positions, stashed)."""
  (sender, receiver), shape, link = at_ends(prog, b), prog.shapes[b], _boundary(prog, b)
  m = message_at(prog, tick, b, forward=True, received=True)
  rows, _ = _link_rows(prog, m, inp.mbs)
  fs, fr = carry.fwd_tables
  arrived = carry.in_flight.fwd_arrived[b]
  x, fr_new = boundary_mod.forward_receive(link, prog.mode, arrived, end_rows(prog, fr, b, RECEIVER, rows, shape),
                                           receiver)
  carry = stash_positions(prog, carry, b, m, boundary_mod.reuse_positions(link, prog.mode, arrived), end=1)
  carry = carry._replace(fwd_tables=(fs, put_end_rows(prog, fr, b, RECEIVER, rows, fr_new)))
  return deliver(prog, carry, b, m, receiver, layout.pad(x, prog.width, prog.act_dtype), forward=True)


def encode_backward(prog: Program, inp: StepInputs, tick, b: int, dx_buf, carry: ExplicitCarry) -> ExplicitCarry:
  """Stage b+1 encodes the input gradient its backward made at `tick` (its backward-sender rows): the
  payload waits in `in_flight` to cross back during the next tick."""
  (sender, receiver), shape, link = at_ends(prog, b), prog.shapes[b], _boundary(prog, b)
  m = message_at(prog, tick, b, forward=False)
  _, rows = _link_rows(prog, m, inp.mbs)
  idx = stashed_positions(prog, carry, b, m)
  payload, bs_new = boundary_mod.backward_send(link, prog.mode, layout.unpad(dx_buf, shape),
                                               end_rows(prog, inp.bwd_tables[0], b, RECEIVER, rows, shape),
                                               pipeline.link_key(inp.step_key, global_microbatch(prog, m), b),
                                               receiver, None if idx is None else idx[1])
  bs, br = carry.bwd_tables
  sent = carry.in_flight.bwd_sent[:b] + (payload,) + carry.in_flight.bwd_sent[b + 1:]
  return carry._replace(bwd_tables=(keep_end_rows(prog, bs, b, RECEIVER, receiver, rows, shape, bs_new), br),
                        in_flight=carry.in_flight._replace(bwd_sent=sent))


def decode_backward(prog: Program, inp: StepInputs, tick, b: int, carry: ExplicitCarry) -> ExplicitCarry:
  """Stage b decodes boundary b's gradient payload that crossed back during the tick before into its ring
  (its backward-receiver rows)."""
  (sender, receiver), shape, link = at_ends(prog, b), prog.shapes[b], _boundary(prog, b)
  m = message_at(prog, tick, b, forward=False, received=True)
  _, rows = _link_rows(prog, m, inp.mbs)
  idx = stashed_positions(prog, carry, b, m)
  dx, br_new = boundary_mod.backward_receive(link, prog.mode, carry.in_flight.bwd_arrived[b],
                                             end_rows(prog, inp.bwd_tables[1], b, SENDER, rows, shape), sender,
                                             None if idx is None else idx[0], shape.dtype)
  bs, br = carry.bwd_tables
  tables = (bs, keep_end_rows(prog, br, b, SENDER, sender, rows, shape, br_new))
  return deliver(prog, carry._replace(bwd_tables=tables), b, m, sender, layout.pad(dx, prog.width, prog.act_dtype),
                 forward=False)


def overlapped_tick(prog: Program, inp: StepInputs, tick, plan: TickPlan, carry: ExplicitCarry) -> ExplicitCarry:
  """One tick with overlapped sends: the payloads encoded at the tick before cross their links, reading only
  the carry (so the tick's compute runs while they are in flight); those that crossed during the tick before
  are decoded into their receivers' rings; the stage runs; what it made is encoded to cross during the next tick."""
  flight = carry.in_flight
  def cross(sent, arrived, crossing, move):
    def moved(b):
      with link_scope(prog, b):
        return move(_boundary(prog, b).transport)(sent[b])
    return tuple(moved(b) if b in crossing else arrived[b] for b in range(len(sent)))
  fwd_arrived = cross(flight.fwd_sent, flight.fwd_arrived, plan.fwd_crossing, lambda t: t.forward)
  bwd_arrived = cross(flight.bwd_sent, flight.bwd_arrived, plan.bwd_crossing, lambda t: t.backward)
  for b in plan.fwd_arriving:
    carry = decode_forward(prog, inp, tick, b, carry)
  for b in plan.bwd_arriving:
    carry = decode_backward(prog, inp, tick, b, carry)
  carry, y_buf, dx_buf = stage_ops(prog, inp, tick, plan, carry)
  for b in plan.fwd_sends:
    carry = encode_forward(prog, inp, tick, b, y_buf, carry)
  for b in plan.bwd_sends:
    carry = encode_backward(prog, inp, tick, b, dx_buf, carry)
  flight = carry.in_flight._replace(fwd_arrived=fwd_arrived, bwd_arrived=bwd_arrived)
  return carry._replace(in_flight=flight)


def empty_in_flight(prog: Program, inp: StepInputs, carry: ExplicitCarry) -> InFlight:
  """Zero payloads of every boundary, shaped as its codecs encode this program's activations."""
  fwd, bwd = [], []
  for b, shape in enumerate(prog.shapes):
    link, key, x = _boundary(prog, b), pipeline.link_key(inp.step_key, 0, b), jnp.zeros(shape.shape, shape.dtype)
    fwd_rows, bwd_rows = _link_rows(prog, 0, inp.mbs)
    fs = end_rows(prog, carry.fwd_tables[0], b, SENDER, fwd_rows, shape)
    bs = end_rows(prog, inp.bwd_tables[0], b, RECEIVER, bwd_rows, shape)
    idx = stashed_positions(prog, carry, b, 0)
    fwd.append(jax.eval_shape(lambda: boundary_mod.forward_send(link, prog.mode, x, fs, key, True)[0]))
    bwd.append(jax.eval_shape(lambda: boundary_mod.backward_send(link, prog.mode, x, bs, key, True,
                                                                None if idx is None else idx[1])[0]))
  zeros = lambda shapes: tuple(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree) for tree in shapes)
  return InFlight(zeros(fwd), zeros(fwd), zeros(bwd), zeros(bwd))


def _index_shapes(prog: Program, b: int):
  """Shapes of boundary b's (sent, arrived) TopK positions (index reuse), else None."""
  return None if prog.mode.dense_forward else boundary_mod.reuse_index_shapes(prog.pipe.boundary, prog.shapes[b])


def run_explicit(prog: Program, params_row, ms_row, fwd_tables, bwd_tables, mbs, step_key, scale) -> ExplicitCarry:
  """Every tick of the explicit schedule on this device, whose V chunks' rows are `params_row` [V, P] and
  `ms_row` [V, Q]. `scale` weighs each microbatch's loss (1 / (M D)): the returned `grads` [V, P] and
  backward tables are those of the weighted sum, as autodiff of the mean loss gives them. An eval step
  (`prog.train` False) runs the table's forwards alone: its loss and metrics."""
  chunks = prog.plan.table.chunks_per_device
  k, buf = prog.plan.lookup.stash_slots, (microbatch_size(mbs), prog.width)
  indices = tuple(jax.tree.map(lambda a: jnp.zeros((k, *a.shape), a.dtype), _index_shapes(prog, b))
                  for b in range(prog.pipe.num_stages - 1))
  stash = Stash(jnp.zeros((chunks * k, *buf), prog.act_dtype), jnp.zeros((chunks * k, *ms_row.shape[1:]), ms_row.dtype),
                indices, jnp.zeros((chunks * prog.plan.lookup.grad_slots, *buf), prog.act_dtype))
  carry = ExplicitCarry(stash, ms_row, tuple(fwd_tables), jax.tree.map(jnp.zeros_like, tuple(bwd_tables)),
                        jnp.zeros_like(params_row), jnp.zeros((), jnp.float32), zero_metrics(prog))
  inp = StepInputs(params_row, tuple(bwd_tables), mbs, step_key, scale)
  tick_fn = explicit_tick
  if prog.plan.table.forwarding_delay > 1:
    carry, tick_fn = carry._replace(in_flight=empty_in_flight(prog, inp, carry)), overlapped_tick

  def period(carry, start, plans):
    for j, plan in enumerate(plans):
      carry = tick_fn(prog, inp, start + j, plan, carry)
    return carry

  for starts, plans in prog.plan.segments:
    if len(starts) == 1:
      carry = period(carry, starts.start, plans)
    else:
      carry, _ = jax.lax.scan(lambda c, t: (period(c, t, plans), None), carry,
                              jnp.arange(starts.start, starts.stop, starts.step, dtype=jnp.int32))
  return carry
