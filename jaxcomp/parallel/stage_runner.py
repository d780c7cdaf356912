"""A schedule's plan run on one stage device: `StageRunner`, whose methods trace a step tick by tick.

Everything static about the ticks is the schedule's `plan.Plan`, compiled once from its timetable: which ticks
run, which boundaries carry a message at a tick, which op kinds and chunks' bodies a tick's switches hold, the
rings' sizes; and so is every traced part: `plan.Lookup` holds, per tick and device, the microbatch of each op
kind it runs and its chunk, and per tick and boundary the microbatch of the message sent and of the one received
(`op_at`, `chunk_at`, `message_at`), so a tick inside a `lax.scan` indexes them with its traced number. The
runner never reads the timetable itself. A device holds V chunks (chunk c on device c mod S: one with GPipe,
1F1B and ZB-H1, V with interleaved 1F1B), each with its rows and rings. At its forward tick a chunk runs on the
input its ring holds for that microbatch (`Stash`: delivered when the message arrived, kept for the backward);
then every boundary b with a message at that tick moves the encoded payload from chunk b's device to chunk
b+1's with the op of `jaxcomp.ppermute` (`permute`, along `plan.link_perm(b)`: a ring); backwards likewise send
gradients from b+1 to b, into the receiver's gradient ring. A device sends at most one message and receives at
most one each way per tick, so it encodes once and decodes once per direction and activation shape
(`exchange_forward`, `exchange_backward`): the tick's boundaries of one shape share that op, and only the
collectives are per boundary. A message may wait in its ring any number of ticks
before its op runs, so any legal table runs (`plan.check_runnable`). Overlapped sends (a forwarding delay of 2
ticks) are `overlapped_sends.OverlappedRunner`, which overrides `tick` and `start_carry`. A bubble tick runs the
no-op branch of the stage switch: no stage compute, nothing saved. The program knows statically which
boundaries carry a message at a tick (idle links issue no collective at all); runs of ticks that repeat the
same plans period after period are one `lax.scan` (`Plan.segments`), so the program's size (and compile time)
does not grow with M.

Two ways to get the backward pass:
- `run_explicit` (every schedule's train table): a stage keeps its input from its forward, and at its backward
  op runs its vjp on it (rematerialised) and the boundary's `backward_half`; the weight gradient is accumulated
  in the loop. A fused BW is one vjp over (parameters, input); a split B is the vjp over the input only (its
  gradient sent at once) and W the vjp over the parameters only, on the stashed input and the stashed output
  cotangent: each recomputes the stage's forward (ZB-H1's W costs a forward more than its share of BW).
- `autodiff_ticks.AutodiffRunner.run_forward`: GPipe's forward ticks only (GPipe with `remat="none"`), whose
  autodiff replays the ticks in reverse.
"""
import contextlib
import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp import pipeline
from jaxcomp.compress import boundary as boundary_mod
from jaxcomp.compress.boundary import Mode
from jaxcomp.parallel import padded_rows, permute, schedules
from jaxcomp.parallel.mesh import DATA, STAGE, WRAPPED
from jaxcomp.parallel.plan import Plan, TickPlan, link_ends, link_perm, ring_slot
from jaxcomp.parallel.timetable import Timetable

REMAT = ("stage", "none")
SENDER, RECEIVER = 0, 1  # boundary b's ends: chunk b (forward sender, backward receiver) and chunk b+1


class StepInputs(NamedTuple):
  """What every tick of one step reads and none changes."""
  params_row: jax.Array  # this device's parameter row ([P], `AutodiffRunner`), or its chunks' ([V, P], `run_explicit`)
  bwd_tables: tuple  # (backward sender, backward receiver) tables as the step found them
  mbs: Any  # this data shard's microbatches, [M, B/M, ...] per batch key
  step_key: jax.Array
  scale: Any = None  # each microbatch's loss weight, 1 / (M D) (`run_explicit`)


class Stash(NamedTuple):
  """This device's rings, one per chunk it holds, chunk slot v's microbatch m in slot `ring_slot(slots, v, m)`
  (`plan.Lookup`): its chunks' inputs (delivered when they arrive) and model states (at their forward), V x
  `stash_slots`; per group g of boundaries of one activation shape (`StageRunner.shape_groups`) the (sender's,
  receiver's) TopK positions their forwards chose (for index reuse), boundary b's microbatch m in slot
  `StageRunner.index_slot(b, m)`; its chunks' output cotangents (delivered when the gradient arrives, for B
  and W or BW), V x `grad_slots`."""
  x_buf: jax.Array
  model_state: jax.Array
  indices: tuple
  g_buf: jax.Array


class ExplicitCarry(NamedTuple):
  """What one tick hands the next (`run_explicit`)."""
  stash: Stash
  model_state: jax.Array  # this device's chunks' model-state rows, [V, Q]
  fwd_tables: tuple
  bwd_tables: tuple  # new backward states, written as the gradients pass
  grads: jax.Array  # its chunks' weight-gradient rows [V, P], summed over microbatches
  loss_sum: jax.Array
  metric_sums: Any
  in_flight: Any = ()  # `overlapped_sends.InFlight` with overlapped sends


def microbatch_size(mbs) -> int:
  """Examples per microbatch of microbatched inputs [M, B/M, ...]."""
  return jax.tree.leaves(mbs)[0].shape[1]


def replaced(items: tuple, i: int, item) -> tuple:
  """`items` with its entry i replaced by `item`."""
  return items[:i] + (item,) + items[i + 1:]


def no_grads(params_row, ms_row, x_buf, mb, rng, g_buf, scale, grad_sum):
  return grad_sum, jnp.zeros_like(x_buf)


class StageRunner:
  """What a stage device needs to run a schedule's plan, and the methods that trace it: the pipeline
  (`pipe`), its parameter and model-state rows (`params`, `model_state`: `padded_rows.FlatRows`), the activation
  at each boundary (`shapes`, one microbatch of one data shard), the step's `mode` and whether it trains
  (`train`: else its forwards alone), the last stage's metric structure (`metrics`) and the `plan` (of
  `table`, GPipe's by default: the forward ticks `run_forward` runs)."""

  def __init__(self, pipe: pipeline.Pipeline, template: pipeline.TrainState, local_batch, mode: Mode, train: bool,
               table: Timetable | None = None):
    table = table or schedules.GPipe().train_table(pipe.num_stages, pipe.microbatches)
    mb = pipeline.microbatch_shapes(local_batch, pipe.microbatches)
    self.pipe, self.mode, self.train = pipe, mode, train
    self.params, self.model_state = padded_rows.FlatRows(template.params), padded_rows.FlatRows(template.model_state)
    self.shapes = pipeline.boundary_shapes(pipe, template.params, template.model_state, mb[pipe.input_key])
    self.width = max([padded_rows.feature_size(x.shape) for x in self.shapes] or [1])
    self.act_dtype = jnp.result_type(*[x.dtype for x in self.shapes] or [jnp.float32])
    self.plan = Plan(table, forwards_only=not train).compiled()
    self.metrics = self._last_metrics(mb)
    by_shape = {}
    for b, x in enumerate(self.shapes):
      by_shape.setdefault((x.shape, x.dtype), []).append(b)
    self.shape_groups = tuple(tuple(group) for group in by_shape.values())
    self.group_place = tuple(next(group.index(b) for group in self.shape_groups if b in group)
                             for b in range(len(self.shapes)))  # each boundary's place in its shape group

  def _last_metrics(self, mb):
    """The last stage's metric structure (ShapeDtypeStructs), traced abstractly."""
    pipe, last = self.pipe, self.pipe.num_stages - 1
    x_buf = jax.ShapeDtypeStruct((mb[pipe.input_key].shape[0], self.width), self.act_dtype)

    def last_metrics(params_row, ms_row, x_buf, mb):
      x = mb[pipe.input_key] if last == 0 else padded_rows.unpad(x_buf, self.shapes[last - 1])
      y, _ = pipe.stages[last].apply(self.params.get(last, params_row), self.model_state.get(last, ms_row), x,
                                     train=self.train, rng=jax.random.key(0))
      return pipe.loss_fn(y, mb)[1]

    row = lambda fl: jax.ShapeDtypeStruct((fl.size,), fl.dtype)
    return jax.eval_shape(last_metrics, row(self.params), row(self.model_state), x_buf, mb)

  # ---------------------------------------------------------------- what the plan says of a tick
  def op_at(self, tick, kind: str, device):
    """(whether `device` runs an op of `kind` at `tick`, its microbatch: 0 when it runs none)."""
    m = jnp.asarray(self.plan.lookup.ops[kind])[tick, device]
    return m >= 0, jnp.maximum(m, 0)

  def chunk_at(self, tick, kind: str, device):
    """(the slot v on `device` of the chunk it runs an op of `kind` of at `tick`, that chunk v D + device, D
    devices): slot 0 when it runs none; with one chunk per device v is the Python int 0 (static indexing: the
    program of a stage per device)."""
    if self.plan.table.num_chunks == self.plan.table.num_devices:
      return 0, device
    v = jnp.asarray(self.plan.lookup.chunks[kind])[tick, device]
    return v, v * self.plan.table.num_devices + device

  def message_at(self, tick, b: int, forward: bool, received: bool = False):
    """The microbatch of boundary b's activation (`forward`) or gradient sent at the end of `tick`, or
    (`received`) taken in by its receiver at `tick` (the plan says there is one)."""
    return jnp.asarray((self.plan.lookup.received if received else self.plan.lookup.sent)[forward])[tick, b]

  def link_scope(self, b: int):
    """The scope of boundary b's collectives: `mesh.WRAPPED` where the ring wraps around (its activations go
    from a device to one of lower index), none elsewhere."""
    sender, receiver = link_ends(b, self.plan.table.num_devices)
    return jax.named_scope(WRAPPED) if receiver < sender else contextlib.nullcontext()

  def at_ends(self, b: int):
    """(whether this device is boundary b's sender, whether it is its receiver), traced."""
    s = jax.lax.axis_index(STAGE)
    sender, receiver = link_ends(b, self.plan.table.num_devices)
    return s == sender, s == receiver

  def own_boundary(self, boundaries, end: int):
    """(b, whether there is one): the boundary among `boundaries` whose `end` (SENDER or RECEIVER) this device
    is, traced; boundaries[0] where there is none. There is at most one: a device runs at most one op of a kind
    per tick, and its ring neighbour sends it at most one message."""
    b, mine = jnp.int32(boundaries[0]), jnp.bool_(False)
    for c in boundaries:
      here = self.at_ends(c)[end]
      b, mine = jnp.where(here, c, b), mine | here
    return b, mine

  def tick_groups(self, boundaries):
    """(g, boundaries of shape group g among `boundaries`) for each group `boundaries` meet, in order."""
    return [(g, tuple(b for b in group if b in boundaries)) for g, group in enumerate(self.shape_groups)
            if any(b in boundaries for b in group)]

  def carried(self, boundaries, payload, forward: bool):
    """What this device receives of the tick's messages over `boundaries` (its own message is `payload`):
    each boundary's collective moves its sender's payload (`forward`) or its receiver's, and the device keeps
    the one whose destination it is (zeros where none)."""
    received = None
    for b in boundaries:
      with self.link_scope(b):
        transport = self.boundary_op(b).transport
        moved = transport.forward(payload) if forward else transport.backward(payload)
      here = self.at_ends(b)[RECEIVER if forward else SENDER]
      received = moved if received is None else jax.tree.map(lambda n, o: jnp.where(here, n, o), moved, received)
    return received

  def global_microbatch(self, m):
    """Index in the global batch of this data shard's microbatch m (keys are drawn by it, so
    stochastic codecs and dropout equal `simulate`'s at the global batch)."""
    return jax.lax.axis_index(DATA) * self.pipe.microbatches + m

  # ---------------------------------------------------------------- a stage's bodies
  def stage_branch(self, j: int):
    """Stage j's body on one microbatch: (y buffer, model-state row, loss, metrics)."""
    pipe, last = self.pipe, self.pipe.num_stages - 1

    def run(params_row, ms_row, x_buf, mb, rng):
      x = mb[pipe.input_key] if j == 0 else padded_rows.unpad(x_buf, self.shapes[j - 1])
      y, ms = pipe.stages[j].apply(self.params.get(j, params_row), self.model_state.get(j, ms_row), x,
                                   train=self.train, rng=rng)
      ms_row = self.model_state.put(j, ms)
      if j < last:
        return padded_rows.pad(y, self.width, self.act_dtype), ms_row, jnp.zeros((), jnp.float32), self.zero_metrics()
      loss, metrics = pipe.loss_fn(y, mb)
      return x_buf, ms_row, loss.astype(jnp.float32), jax.tree.map(lambda v: v.astype(jnp.float32), metrics)
    return run

  def bubble(self):
    """The idle tick: no compute, the model state unchanged, zero loss."""
    def run(params_row, ms_row, x_buf, mb, rng):
      return x_buf, ms_row, jnp.zeros((), jnp.float32), self.zero_metrics()
    return run

  def zero_metrics(self):
    return jax.tree.map(lambda m: jnp.zeros(m.shape, jnp.float32), self.metrics)

  def stage_switch(self, tick, kind: str, branch, idle, *operands):
    """This device runs `branch(c)` when it runs an op of `kind` (F, B, W or BW) of chunk c at `tick`, else
    `idle`. At a static tick only the chunks the table runs then are branches of the program:
    an unrolled tick holds min(M, S) stage bodies, not S (GPipe with M=1 compiles S bodies, as simulate)."""
    s_count, s = self.pipe.num_stages, jax.lax.axis_index(STAGE)
    stages = (list(range(s_count)) if not isinstance(tick, int)
              else list(self.plan.running[kind][tick]))
    position = jnp.asarray([stages.index(j) if j in stages else len(stages) for j in range(s_count)], jnp.int32)
    index = jnp.where(self.op_at(tick, kind, s)[0], position[self.chunk_at(tick, kind, s)[1]], len(stages))
    return jax.lax.switch(index, [branch(j) for j in stages] + [idle], *operands)

  def stage_step(self, inp: StepInputs, tick, params_row, ms_row, x_buf):
    """This device's forward at `tick` of the chunk whose rows are given: its microbatch, or the bubble
    branch when idle."""
    s = jax.lax.axis_index(STAGE)
    _, m = self.op_at(tick, "F", s)
    mb = jax.tree.map(lambda a: a[m], inp.mbs)
    rng = pipeline.stage_key(inp.step_key, self.global_microbatch(m), self.chunk_at(tick, "F", s)[1])
    return self.stage_switch(tick, "F", self.stage_branch, self.bubble(), params_row, ms_row, x_buf, mb, rng)

  def stage_grads(self, j: int, kind: str):
    """Stage j's vjp on one microbatch for a backward op of `kind`, given the output's cotangent `g_buf`
    (stages before the last) or the loss weight `scale` (the last): BW (grads + d params row, d input
    buffer) by one vjp over both; B (grads, d input buffer), W (grads + d params row, zeros), each a vjp
    over its one argument. The sum is taken inside the branch, so a backward tick holds one gradient row,
    not a fresh d params row beside the sum."""
    run, last = self.stage_branch(j), self.pipe.num_stages - 1

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

  def stage_backward(self, inp: StepInputs, tick, kind: str, stash, grad_sum):
    """This device's backward op of `kind` at `tick` (or nothing), on the input and output cotangent its
    rings hold for the op's microbatch: (grad_sum (+ d params row), d input buffer)."""
    s = jax.lax.axis_index(STAGE)
    _, m = self.op_at(tick, kind, s)
    v, c = self.chunk_at(tick, kind, s)
    slot = ring_slot(self.plan.lookup.stash_slots, v, m)
    mb = jax.tree.map(lambda a: a[m], inp.mbs)
    chunk_sum, dx = self.stage_switch(tick, kind, lambda j: self.stage_grads(j, kind), no_grads,
                                      inp.params_row[v], stash.model_state[slot], stash.x_buf[slot], mb,
                                      pipeline.stage_key(inp.step_key, self.global_microbatch(m), c),
                                      stash.g_buf[ring_slot(self.plan.lookup.grad_slots, v, m)], inp.scale,
                                      grad_sum[v])
    return grad_sum.at[v].set(chunk_sum), dx

  # ---------------------------------------------------------------- boundaries' state rows
  def boundary_op(self, b: int):
    """Boundary b's op with its transport: the explicit schedules run its halves."""
    perm = link_perm(b, self.plan.table.num_devices)
    return dataclasses.replace(self.pipe.boundary, transport=permute.Permute(STAGE, perm))

  def end_slot(self, b: int, end: int) -> int | None:
    """Where boundary b's state table at its `end` is among this device's: with V > 1 chunks per device the
    tables are [V, rows, F], the end's chunk (b + end) at slot (b + end) // D; with one chunk (None) the table
    itself."""
    return None if self.plan.table.chunks_per_device == 1 else self.plan.table.slot(b + end)

  def end_rows(self, table, b: int, end: int, rows, like):
    """`padded_rows.gather_rows` of boundary b's rows from its `end`'s table among this device's (`end_slot`)."""
    return padded_rows.gather_rows(table, rows, like, self.end_slot(b, end))

  def put_end_rows(self, table, b: int, end: int, rows, new):
    """`padded_rows.put_rows` of boundary b's new rows into its `end`'s table among this device's (`end_slot`), in
    place."""
    return padded_rows.put_rows(table, rows, new, self.end_slot(b, end))

  def keep_end_rows(self, table, b: int, end: int, ok, rows, like, new):
    """`put_end_rows` of boundary b's `new` rows at its `end` on the device where `ok` (this device is that
    end); elsewhere the rows the table holds stay."""
    old = self.end_rows(table, b, end, rows, like)
    return self.put_end_rows(table, b, end, rows, jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old))

  def link_rows(self, m, mbs):
    """(forward, backward) state rows of microbatch m (its slots, or its examples' ids)."""
    mb_size = microbatch_size(mbs)
    ids = mbs["id"][m] if "id" in mbs else None
    boundary = self.pipe.boundary
    return tuple(pipeline.rows(scheme, m, mb_size, ids) for scheme in (boundary.fwd, boundary.bwd))

  def index_shapes(self, g: int):
    """Shapes of one (sent, arrived) pair of TopK positions of shape group g's boundaries (index reuse in a
    training step whose forward is compressed), else None."""
    if not self.mode.trains or self.mode.dense_forward:
      return None
    return boundary_mod.reuse_index_shapes(self.pipe.boundary, self.shapes[self.shape_groups[g][0]])

  def index_slot(self, b, m):
    """Where boundary b (traced or not) keeps its TopK positions of microbatch m in its shape group's rings:
    b's place in the group (`group_place`) times `stash_slots`, plus m mod `stash_slots`."""
    k = self.plan.lookup.stash_slots
    return jnp.asarray(self.group_place, jnp.int32)[b] * k + m % k

  # ---------------------------------------------------------------- explicit backward
  def deliver(self, carry: ExplicitCarry, b: int, m, ok, value, forward: bool) -> ExplicitCarry:
    """Microbatch m's activation (`forward`) or gradient received over boundary b into the ring of the chunk
    that takes it in (b+1, or b), on the device where `ok` (the boundary's receiver)."""
    field, slots = ("x_buf", self.plan.lookup.stash_slots) if forward else ("g_buf", self.plan.lookup.grad_slots)
    ring, slot = getattr(carry.stash, field), ring_slot(slots, self.plan.table.slot(b + forward), m)
    ring = ring.at[slot].set(jnp.where(ok, value, ring[slot]))
    return carry._replace(stash=carry.stash._replace(**{field: ring}))

  def stash_positions(self, carry: ExplicitCarry, g: int, b, m, positions, end: int):
    """Boundary b's (traced or not, of shape group g) TopK positions of microbatch m (index reuse) at its `end`
    (SENDER or RECEIVER) written to their slot (`index_slot`); none is None."""
    if positions is None:
      return carry
    slot, old = self.index_slot(b, m), carry.stash.indices[g]
    stored = tuple(jax.tree.map(lambda buf, n: buf.at[slot].set(n), part, positions) if i == end else part
                   for i, part in enumerate(old))
    return carry._replace(stash=carry.stash._replace(indices=replaced(carry.stash.indices, g, stored)))

  def stashed_positions(self, carry: ExplicitCarry, g: int, b, m):
    """Boundary b's (traced or not, of shape group g) (sender's, receiver's) TopK positions of microbatch m for
    its backward, or None without index reuse (or in a step whose forward is dense)."""
    if carry.stash.indices[g] is None:
      return None
    return jax.tree.map(lambda buf: buf[self.index_slot(b, m)], carry.stash.indices[g])

  def send_forward(self, inp: StepInputs, tick, g: int, boundaries, y_buf, carry: ExplicitCarry):
    """(carry, payload): this device encodes the activation it made at `tick` for the boundary among
    `boundaries` (of shape group g) it sends on, with its forward-sender rows (written back in a training step)
    and, under index reuse, its TopK positions stashed."""
    (b, sends), shape, link = self.own_boundary(boundaries, SENDER), self.shapes[boundaries[0]], self.pipe.boundary
    m = self.message_at(tick, b, forward=True)
    rows, _ = self.link_rows(m, inp.mbs)
    fs, fr = carry.fwd_tables
    payload, fs_new = boundary_mod.forward_send(link, self.mode, padded_rows.unpad(y_buf, shape),
                                                self.end_rows(fs, b, SENDER, rows, shape),
                                                pipeline.link_key(inp.step_key, self.global_microbatch(m), b), sends)
    if self.mode.trains:
      carry = carry._replace(fwd_tables=(self.put_end_rows(fs, b, SENDER, rows, fs_new), fr))
    return self.stash_positions(carry, g, b, m, boundary_mod.reuse_positions(link, self.mode, payload), SENDER), payload

  def receive_forward(self, inp: StepInputs, tick, g: int, boundaries, arrived, carry: ExplicitCarry,
                      received: bool = False) -> ExplicitCarry:
    """This device decodes `arrived`, the payload of shape group g it receives over its boundary among
    `boundaries` (sent at `tick`, or `received` there), into the ring of the chunk that takes it in, with its
    forward-receiver rows (written back in a training step) and, under index reuse, its copy of the TopK
    positions stashed."""
    (b, takes), shape, link = self.own_boundary(boundaries, RECEIVER), self.shapes[boundaries[0]], self.pipe.boundary
    m = self.message_at(tick, b, forward=True, received=received)
    rows, _ = self.link_rows(m, inp.mbs)
    fs, fr = carry.fwd_tables
    x, fr_new = boundary_mod.forward_receive(link, self.mode, arrived, self.end_rows(fr, b, RECEIVER, rows, shape),
                                             takes)
    if self.mode.trains:
      carry = carry._replace(fwd_tables=(fs, self.put_end_rows(fr, b, RECEIVER, rows, fr_new)))
    carry = self.stash_positions(carry, g, b, m, boundary_mod.reuse_positions(link, self.mode, arrived), RECEIVER)
    return self.deliver(carry, b, m, takes, padded_rows.pad(x, self.width, self.act_dtype), forward=True)

  def send_backward(self, inp: StepInputs, tick, g: int, boundaries, dx_buf, carry: ExplicitCarry):
    """(carry, payload): this device encodes the input gradient it made at `tick` for the boundary among
    `boundaries` (of shape group g) whose receiver it is, with its backward-sender rows (kept where it sends)."""
    (b, sends), shape, link = self.own_boundary(boundaries, RECEIVER), self.shapes[boundaries[0]], self.pipe.boundary
    m = self.message_at(tick, b, forward=False)
    _, rows = self.link_rows(m, inp.mbs)
    idx = self.stashed_positions(carry, g, b, m)
    payload, bs_new = boundary_mod.backward_send(link, self.mode, padded_rows.unpad(dx_buf, shape),
                                                 self.end_rows(inp.bwd_tables[0], b, RECEIVER, rows, shape),
                                                 pipeline.link_key(inp.step_key, self.global_microbatch(m), b),
                                                 sends, None if idx is None else idx[RECEIVER])
    bs, br = carry.bwd_tables
    return carry._replace(bwd_tables=(self.keep_end_rows(bs, b, RECEIVER, sends, rows, shape, bs_new), br)), payload

  def receive_backward(self, inp: StepInputs, tick, g: int, boundaries, arrived, carry: ExplicitCarry,
                       received: bool = False) -> ExplicitCarry:
    """This device decodes `arrived`, the gradient payload of shape group g it receives back over the boundary
    among `boundaries` whose sender it is (sent at `tick`, or `received` there), into the ring of the chunk that
    takes it in, with its backward-receiver rows (kept where it receives)."""
    (b, takes), shape, link = self.own_boundary(boundaries, SENDER), self.shapes[boundaries[0]], self.pipe.boundary
    m = self.message_at(tick, b, forward=False, received=received)
    _, rows = self.link_rows(m, inp.mbs)
    idx = self.stashed_positions(carry, g, b, m)
    dx, br_new = boundary_mod.backward_receive(link, self.mode, arrived,
                                               self.end_rows(inp.bwd_tables[1], b, SENDER, rows, shape), takes,
                                               None if idx is None else idx[SENDER], shape.dtype)
    bs, br = carry.bwd_tables
    carry = carry._replace(bwd_tables=(bs, self.keep_end_rows(br, b, SENDER, takes, rows, shape, br_new)))
    return self.deliver(carry, b, m, takes, padded_rows.pad(dx, self.width, self.act_dtype), forward=False)

  def exchange_forward(self, inp: StepInputs, tick, g: int, boundaries, y_buf, carry: ExplicitCarry) -> ExplicitCarry:
    """The tick's forward messages over `boundaries` (all of shape group g): this device encodes the one it
    sends (`send_forward`), the collectives carry each boundary's payload, and it decodes the one it receives
    (`receive_forward`)."""
    carry, payload = self.send_forward(inp, tick, g, boundaries, y_buf, carry)
    return self.receive_forward(inp, tick, g, boundaries, self.carried(boundaries, payload, forward=True), carry)

  def exchange_backward(self, inp: StepInputs, tick, g: int, boundaries, dx_buf, carry: ExplicitCarry) -> ExplicitCarry:
    """The tick's gradients over `boundaries` (all of shape group g): this device encodes the one it sends
    (`send_backward`), the collectives carry each back, and it decodes the one it receives (`receive_backward`)."""
    carry, payload = self.send_backward(inp, tick, g, boundaries, dx_buf, carry)
    return self.receive_backward(inp, tick, g, boundaries, self.carried(boundaries, payload, forward=False), carry)

  def stage_ops(self, inp: StepInputs, tick, tick_plan: TickPlan, carry: ExplicitCarry):
    """This device's ops at `tick`, in `ORDER`: its forward on the input its ring holds (stashing its model
    state), then its backward ops: (carry, activation made, input gradient made). Kinds that no stage runs
    at this tick (by `tick_plan`) are left out of the program."""
    s = jax.lax.axis_index(STAGE)
    y_buf = dx_buf = jnp.zeros(carry.stash.x_buf.shape[1:], carry.stash.x_buf.dtype)
    if "F" in tick_plan.kinds:
      forward_busy, m = self.op_at(tick, "F", s)
      v, _ = self.chunk_at(tick, "F", s)
      slot = ring_slot(self.plan.lookup.stash_slots, v, m)
      stash = carry.stash._replace(model_state=carry.stash.model_state.at[slot].set(
          jnp.where(forward_busy, carry.model_state[v], carry.stash.model_state[slot])))
      y_buf, ms_row, loss, metrics = self.stage_step(inp, tick, inp.params_row[v], carry.model_state[v],
                                                     carry.stash.x_buf[slot])
      carry = carry._replace(stash=stash, model_state=carry.model_state.at[v].set(ms_row),
                             loss_sum=carry.loss_sum + loss,
                             metric_sums=jax.tree.map(jnp.add, carry.metric_sums, metrics))
    for kind in (kind for kind in tick_plan.kinds if kind != "F"):
      grads, dx = self.stage_backward(inp, tick, kind, carry.stash, carry.grads)
      carry = carry._replace(grads=grads)
      if kind != "W":
        dx_buf = jnp.where(self.op_at(tick, kind, s)[0], dx, dx_buf)
    return carry, y_buf, dx_buf

  def start_carry(self, inp: StepInputs, carry: ExplicitCarry) -> ExplicitCarry:
    """The carry the first tick takes (a hook: `OverlappedRunner` adds the payloads in flight)."""
    return carry

  def tick(self, inp: StepInputs, tick, tick_plan: TickPlan, carry: ExplicitCarry) -> ExplicitCarry:
    """One tick: this stage's ops, then the boundaries (each message delivered into its receiver's ring)."""
    carry, y_buf, dx_buf = self.stage_ops(inp, tick, tick_plan, carry)
    for g, boundaries in self.tick_groups(tick_plan.fwd_sends):
      carry = self.exchange_forward(inp, tick, g, boundaries, y_buf, carry)
    for g, boundaries in self.tick_groups(tick_plan.bwd_sends):
      carry = self.exchange_backward(inp, tick, g, boundaries, dx_buf, carry)
    return carry

  def run_explicit(self, params_row, ms_row, fwd_tables, bwd_tables, mbs, step_key, scale) -> ExplicitCarry:
    """Every tick of the explicit schedule on this device, whose V chunks' rows are `params_row` [V, P] and
    `ms_row` [V, Q]. `scale` weighs each microbatch's loss (1 / (M D)): the returned `grads` [V, P] and
    backward tables are those of the weighted sum, as autodiff of the mean loss gives them. An eval step
    (`train` False) runs the table's forwards alone: its loss and metrics."""
    chunks = self.plan.table.chunks_per_device
    k, buf = self.plan.lookup.stash_slots, (microbatch_size(mbs), self.width)
    indices = tuple(jax.tree.map(lambda a: jnp.zeros((len(group) * k, *a.shape), a.dtype), self.index_shapes(g))
                    for g, group in enumerate(self.shape_groups))
    stash = Stash(jnp.zeros((chunks * k, *buf), self.act_dtype),
                  jnp.zeros((chunks * k, *ms_row.shape[1:]), ms_row.dtype), indices,
                  jnp.zeros((chunks * self.plan.lookup.grad_slots, *buf), self.act_dtype))
    carry = ExplicitCarry(stash, ms_row, tuple(fwd_tables), jax.tree.map(jnp.zeros_like, tuple(bwd_tables)),
                          jnp.zeros_like(params_row), jnp.zeros((), jnp.float32), self.zero_metrics())
    inp = StepInputs(params_row, tuple(bwd_tables), mbs, step_key, scale)
    carry = self.start_carry(inp, carry)

    def period(carry, start, tick_plans):
      for j, tick_plan in enumerate(tick_plans):
        carry = self.tick(inp, start + j, tick_plan, carry)
      return carry

    for starts, tick_plans in self.plan.segments:
      if len(starts) == 1:
        carry = period(carry, starts.start, tick_plans)
      else:
        carry, _ = jax.lax.scan(lambda c, t: (period(c, t, tick_plans), None), carry,
                                jnp.arange(starts.start, starts.stop, starts.step, dtype=jnp.int32))
    return carry
