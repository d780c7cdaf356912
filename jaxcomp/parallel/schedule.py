"""A schedule's table (`jaxcomp.parallel.schedules`) run on one stage device.

The table says what runs when: every static part of the program (the ticks, which boundaries carry a
message at a tick, which stages' bodies a tick's switch holds, the stash slots) is read from it. A
traced tick (inside a `lax.scan`) computes which microbatch this device runs with the table's
`Timing`, read off the table and checked against it (`timing_of`): stage s runs microbatch m forward
at tick stride*m + hop*s and backward at tick stride*m + lag - hop*s (`busy`, `microbatch`). At its forward tick a
stage runs on the input it received, then every boundary b with a microbatch at that tick moves the
encoded payload from stage b to b+1 with the op of `jaxcomp.ppermute` (`permute`, along
`link_perm(b)`); backwards likewise send gradients from b+1 to b. With overlapped sends (the table's hop 2,
`overlapped_tick`) the payload is encoded at that tick, crosses during the next one while the stages compute,
and is decoded at the tick after, where it is used. A bubble tick runs the no-op
branch of the stage switch: no stage compute, nothing saved. The program knows statically
which boundaries carry a microbatch at a tick (idle links issue no collective at all); runs of
ticks that repeat the same plan period after period are one `lax.scan`, so the program's size
(and compile time) does not grow with M.

Two ways to get the backward pass:
- `run_explicit` (every schedule of `schedules.SCHEDULES`, below): a stage stashes its input at its forward, and at
  its backward tick runs its vjp on it (rematerialised) and the boundary's
  `backward_half` (its halves apart with overlapped sends); the weight gradient is accumulated in the loop.
- `run_gpipe`: the forward ticks only (eval steps, and GPipe with `remat="none"`), whose
  autodiff replays the ticks in reverse: each boundary op's custom_vjp rule sends the
  encoded gradient from b+1 to b, and every stage's internals are saved.
"""
import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp import pipeline
from jaxcomp.compress import boundary as boundary_mod
from jaxcomp.compress.boundary import LinkState, Mode
from jaxcomp.parallel import layout, permute, schedules
from jaxcomp.parallel.mesh import DATA, STAGE

REMAT = ("stage", "none")
SCHEDULES = schedules.SCHEDULES  # the tables this executor runs (those `timing_of` fits)


class Timing(NamedTuple):
  """Stage s runs microbatch m forward at tick stride*m + hop*s and backward at tick stride*m + lag - hop*s
  (`hop`: the ticks a message takes, the table's; 2 with overlapped sends)."""
  stride: int
  lag: int
  hop: int = 1


def timing_of(table: schedules.Schedule) -> Timing:
  """The `Timing` of a table the executor runs: stride = the ticks between stage 0's first two
  forwards (1 with one microbatch), lag = its first backward's tick. Every op of the table must be
  where the timing puts it (one chunk per device, fused BW backwards, a tick's F before its BW;
  each message is then used the tick after it is sent): else a ValueError naming the first op that
  is not."""
  S, M = table.num_devices, table.microbatches
  if table.num_chunks != S:
    raise ValueError(f"the sharded executor runs one chunk per device; schedule {table.name!r} has "
                     f"{table.num_chunks} chunks on {S} devices")
  where = schedules.positions(table)
  split = [op for op in where if op.kind not in ("F", "BW")]
  if split:
    raise ValueError(f"the sharded executor runs F and fused BW ops; schedule {table.name!r} runs {min(split)}")
  f, bw = lambda s, m: schedules.Op("F", s, m), lambda s, m: schedules.Op("BW", s, m)
  stride = where[f(0, 1)][0] - where[f(0, 0)][0] if M > 1 else 1
  rule = Timing(stride, where[bw(0, 0)][0], table.hop)
  placed = {**{f(s, m): stride * m + rule.hop * s for s in range(S) for m in range(M)},
            **{bw(s, m): stride * m + rule.lag - rule.hop * s for s in range(S) for m in range(M)}}
  for op, (t, d, i) in sorted(where.items(), key=lambda item: item[1]):
    if placed.get(op) != t or (op.kind == "F" and i > 0):
      raise ValueError(f"the sharded executor runs F(s, m) at tick stride*m + hop*s and BW(s, m) at "
                       f"stride*m + lag - hop*s ({rule}), a tick's F first; schedule {table.name!r} runs {op} "
                       f"at tick {t}, position {i}")
  return rule


def link_perm(b: int) -> permute.Perm:
  """Boundary b's messages: stage b sends to stage b+1 (its gradients come back)."""
  return ((b, b + 1),)


def phases(prog) -> tuple[range, range, range]:
  """(fill, steady, drain) forward ticks of `run_gpipe` (stride 1), read from the table: in steady
  ticks every stage runs a forward (and every boundary sends); fill and drain are the forward ticks
  before and after."""
  table = prog.table
  forward = [t for t in range(table.ticks) if schedules.running(table, t, ("F",))]
  steady = [t for t in forward if len(schedules.running(table, t, ("F",))) == table.num_devices]
  if not steady:
    return range(len(forward)), range(0), range(len(forward), len(forward))
  return range(steady[0]), range(steady[0], steady[-1] + 1), range(steady[-1] + 1, forward[-1] + 1)


def busy(prog, tick, offset):
  """Whether an op that runs microbatch m at tick stride*m + offset has one at `tick`."""
  since, stride = tick - offset, prog.timing.stride
  return (since >= 0) & (since % stride == 0) & (since < stride * prog.pipe.microbatches)


def microbatch(prog, tick, offset):
  """The microbatch of that op at `tick` (when it is `busy`)."""
  return (tick - offset) // prog.timing.stride


def clipped_microbatch(prog, tick, offset):
  """`microbatch`, kept in range for the idle devices of a tick."""
  return jnp.clip(microbatch(prog, tick, offset), 0, prog.pipe.microbatches - 1)


def global_microbatch(prog, m):
  """Index in the global batch of this data shard's microbatch m (keys are drawn by it, so
  stochastic codecs and dropout equal `simulate`'s at the global batch)."""
  return jax.lax.axis_index(DATA) * prog.pipe.microbatches + m


def boundaries_at(prog, tick: int, forward: bool = True) -> tuple[int, ...]:
  """The boundaries that carry an activation (`forward`) or a gradient at a (static) tick, by the table."""
  return tuple(sorted(msg.boundary for msg in schedules.messages(prog.table, tick) if msg.forward == forward))


class StepInputs(NamedTuple):
  """What every tick of one step reads and none changes."""
  params_row: jax.Array  # this stage's parameter row
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
  table: schedules.Schedule  # the schedule (`run_gpipe` runs its forward ticks)
  timing: Timing  # `timing_of(table)`: the traced ticks' rule

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
  """This device's stage s runs `branch(s)` when it runs an op of `kind` ("F" or "BW") at `tick`, else
  `idle`. At a static tick only the stages the table runs then are branches of the program:
  an unrolled tick holds min(M, S) stage bodies, not S (GPipe with M=1 compiles S bodies, as simulate)."""
  s_count, s = prog.pipe.num_stages, jax.lax.axis_index(STAGE)
  offset = (lambda j: forward_tick(prog, j)) if kind == "F" else (lambda j: backward_tick(prog, j))
  stages = (list(range(s_count)) if not isinstance(tick, int)
            else [op.chunk for op in schedules.running(prog.table, tick, (kind,))])
  position = jnp.asarray([stages.index(j) if j in stages else len(stages) for j in range(s_count)], jnp.int32)
  index = jnp.where(busy(prog, tick, offset(s)), position[s], len(stages))
  return jax.lax.switch(index, [branch(j) for j in stages] + [idle], *operands)


def stage_step(prog: Program, inp: StepInputs, tick, ms_row, x_buf):
  """This device's stage at `tick`: its microbatch, or the bubble branch when idle."""
  s = jax.lax.axis_index(STAGE)
  m = clipped_microbatch(prog, jnp.asarray(tick, jnp.int32), forward_tick(prog, s))
  mb = jax.tree.map(lambda a: a[m], inp.mbs)
  rng = pipeline.stage_key(inp.step_key, global_microbatch(prog, m), s)
  return stage_switch(prog, tick, "F", lambda j: stage_branch(prog, j), bubble(prog),
                      inp.params_row, ms_row, x_buf, mb, rng)


def _boundary(prog: Program, b: int):
  """Boundary b's op with its transport: the explicit schedules run its halves."""
  return dataclasses.replace(prog.pipe.boundary, transport=permute.Permute(STAGE, link_perm(b)))


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
  the gradient back under autodiff (`run_gpipe`); else its forward half (`run_explicit`)."""
  s = jax.lax.axis_index(STAGE)
  m, shape = microbatch(prog, tick, forward_tick(prog, b)), prog.shapes[b]
  fwd_rows, bwd_rows = _link_rows(prog, m, inp.mbs)
  (fs, fr), (bs, br) = fwd_tables, inp.bwd_tables
  y, key = layout.unpad(y_buf, shape), pipeline.link_key(inp.step_key, global_microbatch(prog, m), b)
  sent, arrived = layout.gather_rows(fs, fwd_rows, shape), layout.gather_rows(fr, fwd_rows, shape)
  if differentiable:
    link = LinkState(sent, arrived, layout.gather_rows(bs, bwd_rows, shape), layout.gather_rows(br, bwd_rows, shape))
    x, new = permute.CompressedLink(prog.pipe.boundary).ppermute(y, link, STAGE, link_perm(b), key, mode=prog.mode)
    fs_new, fr_new, idx = new.fwd_send, new.fwd_recv, None
  else:
    x, fs_new, fr_new, idx = boundary_mod.forward_half(_boundary(prog, b), prog.mode, y, sent, arrived, key,
                                                       s == b, s == b + 1)
  if prog.mode.trains:
    fwd_tables = (layout.put_rows(fs, fwd_rows, fs_new), layout.put_rows(fr, fwd_rows, fr_new))
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
  y_buf, ms_row, loss, metrics = stage_step(prog, inp, tick, carry.model_state, carry.x_buf)
  s = jax.lax.axis_index(STAGE)
  next_x, fwd_tables = jnp.zeros_like(carry.x_buf), carry.fwd_tables
  for b in boundaries:
    x, fwd_tables, _ = forward_exchange(prog, inp, tick, b, y_buf, fwd_tables, differentiable=True)
    next_x = jnp.where(s == b + 1, x, next_x)
  return Carry(next_x, ms_row, fwd_tables, carry.loss_sum + loss,
               jax.tree.map(jnp.add, carry.metric_sums, metrics))


def run_gpipe(prog: Program, params_row, ms_row, fwd_tables, bwd_tables, mbs, step_key) -> Carry:
  """The M+S-1 forward ticks (stride 1) on this device: fill and drain unrolled, the steady
  ticks scanned (differentiable: its autodiff is GPipe's backward)."""
  assert prog.timing.stride == 1, prog.timing
  s_count = prog.pipe.num_stages
  mb_size = microbatch_size(mbs)
  carry = Carry(jnp.zeros((mb_size, prog.width), prog.act_dtype), ms_row, tuple(fwd_tables),
                jnp.zeros((), jnp.float32), zero_metrics(prog))
  inp = StepInputs(params_row, tuple(bwd_tables), mbs, step_key)
  tick = lambda t, c, bs: tick_step(prog, inp, t, bs, c)
  fill, steady, drain = phases(prog)
  for t in fill:
    carry = tick(t, carry, boundaries_at(prog, t))
  if len(steady):
    every = range(s_count - 1)
    carry, _ = jax.lax.scan(lambda c, t: (tick(t, c, every), None), carry,
                            jnp.arange(steady.start, steady.stop, dtype=jnp.int32))
  for t in drain:
    carry = tick(t, carry, boundaries_at(prog, t))
  return carry


def make_program(pipe: pipeline.Pipeline, template: pipeline.TrainState, local_batch, mode: Mode, train: bool,
                 table: schedules.Schedule | None = None) -> Program:
  """The schedule's static layout for one data shard's batch `local_batch` (shapes only); `table`
  defaults to GPipe's (the forward ticks `run_gpipe` runs)."""
  table = table or schedules.gpipe(pipe.num_stages, pipe.microbatches)
  mb = pipeline.microbatch_shapes(local_batch, pipe.microbatches)
  shapes = pipeline.boundary_shapes(pipe, template.params, template.model_state, mb[pipe.input_key])
  prog = Program(pipe, layout.FlatRows(template.params), layout.FlatRows(template.model_state), shapes,
                 mode, train, None, table, timing_of(table))
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
# A backward runs the stage's vjp on the input it stashed at its forward (rematerialised),
# then the boundary's `backward_half` sends the gradient on. The ticks are cut into periods
# of `stride` ticks; a run of periods with the same plan runs under one `lax.scan` (the same
# collectives every period), the other periods are unrolled.


def forward_tick(prog: Program, stage):
  """Offset of a stage's forward: microbatch m's forward runs at tick stride*m + offset."""
  return prog.timing.hop * stage


def backward_tick(prog: Program, stage):
  """Offset of a stage's backward: microbatch m's backward runs at tick stride*m + offset."""
  return prog.timing.lag - prog.timing.hop * stage


def stash_slots(prog: Program) -> int:
  """Ring-buffer slots for inputs awaiting their backward (`schedules.stash_slots`; microbatch m uses
  slot m % slots: a stage holds consecutive microbatches)."""
  return schedules.stash_slots(prog.table)


class Plan(NamedTuple):
  """What a tick holds, read from the table: the boundaries whose activation (gradient) is sent at its end,
  whether any stage runs a forward (backward) at it, and, with overlapped sends (`Timing.hop` 2), the
  boundaries whose payload crosses its link during it (encoded the tick before) and those whose payload is
  decoded at it (encoded two ticks before)."""
  fwd_sends: tuple[int, ...]
  bwd_sends: tuple[int, ...]
  any_forward: bool
  any_backward: bool
  fwd_crossing: tuple[int, ...] = ()
  bwd_crossing: tuple[int, ...] = ()
  fwd_arriving: tuple[int, ...] = ()
  bwd_arriving: tuple[int, ...] = ()


def tick_plan(prog: Program, tick: int) -> Plan:
  """The `Plan` of a (static) tick, by the table."""
  plan = Plan(boundaries_at(prog, tick), boundaries_at(prog, tick, forward=False),
              bool(schedules.running(prog.table, tick, ("F",))), bool(schedules.running(prog.table, tick, ("BW",))))
  if prog.timing.hop == 1:  # a message crosses and is decoded at the end of the tick that sends it
    return plan
  sent = lambda ago, forward: boundaries_at(prog, tick - ago, forward) if tick >= ago else ()
  return plan._replace(fwd_crossing=sent(1, True), bwd_crossing=sent(1, False),
                       fwd_arriving=sent(2, True), bwd_arriving=sent(2, False))


def segments(prog: Program) -> list[tuple[range, tuple]]:
  """(period starts, the period's plans): consecutive periods with equal plans form one run."""
  stride = prog.timing.stride
  runs = []
  for start in range(0, prog.table.ticks, stride):
    plans = tuple(tick_plan(prog, t) for t in range(start, min(start + stride, prog.table.ticks)))
    if runs and runs[-1][1] == plans:
      runs[-1] = (range(runs[-1][0].start, start + 1, stride), plans)
    else:
      runs.append((range(start, start + 1, stride), plans))
  return runs


def stage_grads(prog: Program, j: int):
  """Stage j's vjp on one microbatch, added to the weight-gradient sum: (grads + d params
  row, d input buffer) given the output's cotangent `g_buf` (stages before the last) or the
  loss weight `scale` (the last). The sum is taken inside the branch, so a backward tick
  holds one gradient row, not a fresh d params row beside the sum."""
  run, last = stage_branch(prog, j), prog.pipe.num_stages - 1

  def grads(params_row, ms_row, x_buf, mb, rng, g_buf, scale, grad_sum):
    outputs = lambda p, x: (lambda out: (out[0], out[2]))(run(p, ms_row, x, mb, rng))
    _, vjp = jax.vjp(outputs, params_row, x_buf)
    dy = jnp.zeros_like(g_buf) if j == last else g_buf
    dp, dx = vjp((dy, scale if j == last else jnp.zeros((), jnp.float32)))
    return grad_sum + dp, dx
  return grads


def no_grads(params_row, ms_row, x_buf, mb, rng, g_buf, scale, grad_sum):
  return grad_sum, jnp.zeros_like(x_buf)


def stage_backward(prog: Program, inp: StepInputs, tick, stash, g_buf, grad_sum):
  """This device's stage backward at `tick` (or nothing): (grad_sum + d params row, d input buffer)."""
  s = jax.lax.axis_index(STAGE)
  m = clipped_microbatch(prog, tick, backward_tick(prog, s))
  slot = m % stash_slots(prog)
  mb = jax.tree.map(lambda a: a[m], inp.mbs)
  return stage_switch(prog, tick, "BW", lambda j: stage_grads(prog, j), no_grads,
                      inp.params_row, stash.model_state[slot], stash.x_buf[slot], mb,
                      pipeline.stage_key(inp.step_key, global_microbatch(prog, m), s), g_buf, inp.scale, grad_sum)


class Stash(NamedTuple):
  """Per slot: a microbatch's stage input and model state (for its backward), and per
  boundary the TopK positions its forward chose (for index reuse)."""
  x_buf: jax.Array
  model_state: jax.Array
  indices: tuple


class InFlight(NamedTuple):
  """Overlapped sends: per boundary, the payload its sender encoded at the tick before (it crosses the link
  during this tick) and the one that crossed during the tick before (its receiver decodes it at this
  tick); the activations' and the gradients'. Payloads only: no dense tensor waits between ticks."""
  fwd_sent: tuple
  fwd_arrived: tuple
  bwd_sent: tuple
  bwd_arrived: tuple


class ExplicitCarry(NamedTuple):
  x_buf: jax.Array  # activation received for the next forward
  g_buf: jax.Array  # gradient received for the next backward
  stash: Stash
  model_state: jax.Array
  fwd_tables: tuple
  bwd_tables: tuple  # new backward states, written as the gradients pass
  grads: jax.Array  # this stage's weight-gradient row, summed over microbatches
  loss_sum: jax.Array
  metric_sums: Any
  in_flight: Any = ()  # `InFlight` with overlapped sends


def stash_positions(prog: Program, carry: ExplicitCarry, b: int, m, positions, end: int | None = None):
  """Boundary b's TopK positions of microbatch m (index reuse) written to its stash slot: the (sender's,
  receiver's) pair, or the one `end` (0 sender, 1 receiver) given; none is None."""
  if positions is None:
    return carry
  slot, old = m % stash_slots(prog), carry.stash.indices[b]
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
  return jax.tree.map(lambda buf: buf[m % stash_slots(prog)], carry.stash.indices[b])


def stash_exchange(prog: Program, inp: StepInputs, tick, b: int, y_buf, carry: ExplicitCarry):
  """`forward_exchange` (its forward half) of the explicit schedule, its TopK positions stashed for
  index reuse: (received activation, carry)."""
  x, tables, idx = forward_exchange(prog, inp, tick, b, y_buf, carry.fwd_tables, differentiable=False)
  carry = stash_positions(prog, carry, b, microbatch(prog, tick, forward_tick(prog, b)), idx)
  return x, carry._replace(fwd_tables=tables)


def kept_rows(ok, table, rows, shape, new):
  """The new state rows where `ok` (this device is their end), the table's rows elsewhere."""
  return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, layout.gather_rows(table, rows, shape))


def backward_exchange(prog: Program, inp: StepInputs, tick, b: int, dx_buf, carry: ExplicitCarry):
  """Boundary b's backward half for the microbatch whose stage b+1 backward ran this tick:
  (gradient received by stage b, carry with the new backward-state rows)."""
  s = jax.lax.axis_index(STAGE)
  m = microbatch(prog, tick, backward_tick(prog, b + 1))
  shape = prog.shapes[b]
  _, rows = _link_rows(prog, m, inp.mbs)
  bs_old, br_old = inp.bwd_tables
  dx, bs_new, br_new = boundary_mod.backward_half(
      _boundary(prog, b), prog.mode, layout.unpad(dx_buf, shape),
      layout.gather_rows(bs_old, rows, shape), layout.gather_rows(br_old, rows, shape),
      pipeline.link_key(inp.step_key, global_microbatch(prog, m), b), s == b, s == b + 1,
      stashed_positions(prog, carry, b, m))
  bs, br = carry.bwd_tables
  tables = (layout.put_rows(bs, rows, kept_rows(s == b + 1, bs, rows, shape, bs_new)),
            layout.put_rows(br, rows, kept_rows(s == b, br, rows, shape, br_new)))
  return layout.pad(dx, prog.width, prog.act_dtype), carry._replace(bwd_tables=tables)


def stage_ops(prog: Program, inp: StepInputs, tick, plan: Plan, carry: ExplicitCarry):
  """This device's stage at `tick`: its forward on `carry.x_buf` (stashing that input), then its backward on
  `carry.g_buf`: (carry, activation made, input gradient made). Work that no stage has at this tick (by
  `plan`) is left out of the program."""
  s = jax.lax.axis_index(STAGE)
  y_buf = dx_buf = jnp.zeros_like(carry.x_buf)
  if plan.any_forward:
    slot = clipped_microbatch(prog, tick, forward_tick(prog, s)) % stash_slots(prog)
    forward_busy = busy(prog, tick, forward_tick(prog, s))
    keep = lambda buf, new: buf.at[slot].set(jnp.where(forward_busy, new, buf[slot]))
    stash = carry.stash._replace(x_buf=keep(carry.stash.x_buf, carry.x_buf),
                                 model_state=keep(carry.stash.model_state, carry.model_state))
    y_buf, ms_row, loss, metrics = stage_step(prog, inp, tick, carry.model_state, carry.x_buf)
    carry = carry._replace(stash=stash, model_state=ms_row, loss_sum=carry.loss_sum + loss,
                           metric_sums=jax.tree.map(jnp.add, carry.metric_sums, metrics))
  if plan.any_backward:
    grads, dx_buf = stage_backward(prog, inp, tick, carry.stash, carry.g_buf, carry.grads)
    carry = carry._replace(grads=grads)
  return carry, y_buf, dx_buf


def explicit_tick(prog: Program, inp: StepInputs, tick, plan: Plan, carry: ExplicitCarry) -> ExplicitCarry:
  """One tick: this stage's forward (stashing its input), its backward, then the boundaries."""
  s = jax.lax.axis_index(STAGE)
  carry, y_buf, dx_buf = stage_ops(prog, inp, tick, plan, carry)
  next_x, next_g = jnp.zeros_like(carry.x_buf), jnp.zeros_like(carry.g_buf)
  for b in plan.fwd_sends:
    x, carry = stash_exchange(prog, inp, tick, b, y_buf, carry)
    next_x = jnp.where(s == b + 1, x, next_x)
  for b in plan.bwd_sends:
    g, carry = backward_exchange(prog, inp, tick, b, dx_buf, carry)
    next_g = jnp.where(s == b, g, next_g)
  return carry._replace(x_buf=next_x, g_buf=next_g)


# ---------------------------------------------------------------- overlapped sends
# With `Timing.hop` 2 a boundary's message is encoded where it is made (tick t), crosses its link during
# tick t+1 while both ends compute (its collective reads only the carry, so nothing of tick t+1 waits for
# it), and is decoded where it is used (tick t+2). Each end's compression state moves at its own end:
# the sender's rows at the encode, the receiver's at the decode, each by its own microbatch.


def encode_forward(prog: Program, inp: StepInputs, tick, b: int, y_buf, carry: ExplicitCarry) -> ExplicitCarry:
  """Stage b encodes the activation its forward made at `tick` (its forward-sender rows, and under index
  reuse its TopK positions, stashed): the payload waits in `in_flight` to cross during the next tick."""
  s, shape, link = jax.lax.axis_index(STAGE), prog.shapes[b], _boundary(prog, b)
  m = microbatch(prog, tick, forward_tick(prog, b))
  rows, _ = _link_rows(prog, m, inp.mbs)
  fs, fr = carry.fwd_tables
  payload, fs_new = boundary_mod.forward_send(link, prog.mode, layout.unpad(y_buf, shape),
                                              layout.gather_rows(fs, rows, shape),
                                              pipeline.link_key(inp.step_key, global_microbatch(prog, m), b), s == b)
  carry = stash_positions(prog, carry, b, m, boundary_mod.reuse_positions(link, prog.mode, payload), end=0)
  sent = carry.in_flight.fwd_sent[:b] + (payload,) + carry.in_flight.fwd_sent[b + 1:]
  return carry._replace(fwd_tables=(layout.put_rows(fs, rows, fs_new), fr),
                        in_flight=carry.in_flight._replace(fwd_sent=sent))


def decode_forward(prog: Program, inp: StepInputs, tick, b: int, carry: ExplicitCarry):
  """Stage b+1 decodes boundary b's payload that crossed during the tick before, for its forward at `tick`
  (its forward-receiver rows, and under index reuse its copy of the TopK positions, stashed): (input, carry)."""
  s, shape, link = jax.lax.axis_index(STAGE), prog.shapes[b], _boundary(prog, b)
  m = microbatch(prog, tick, forward_tick(prog, b + 1))
  rows, _ = _link_rows(prog, m, inp.mbs)
  fs, fr = carry.fwd_tables
  arrived = carry.in_flight.fwd_arrived[b]
  x, fr_new = boundary_mod.forward_receive(link, prog.mode, arrived, layout.gather_rows(fr, rows, shape), s == b + 1)
  carry = stash_positions(prog, carry, b, m, boundary_mod.reuse_positions(link, prog.mode, arrived), end=1)
  return layout.pad(x, prog.width, prog.act_dtype), carry._replace(fwd_tables=(fs, layout.put_rows(fr, rows, fr_new)))


def encode_backward(prog: Program, inp: StepInputs, tick, b: int, dx_buf, carry: ExplicitCarry) -> ExplicitCarry:
  """Stage b+1 encodes the input gradient its backward made at `tick` (its backward-sender rows): the
  payload waits in `in_flight` to cross back during the next tick."""
  s, shape, link = jax.lax.axis_index(STAGE), prog.shapes[b], _boundary(prog, b)
  m = microbatch(prog, tick, backward_tick(prog, b + 1))
  _, rows = _link_rows(prog, m, inp.mbs)
  idx = stashed_positions(prog, carry, b, m)
  payload, bs_new = boundary_mod.backward_send(link, prog.mode, layout.unpad(dx_buf, shape),
                                               layout.gather_rows(inp.bwd_tables[0], rows, shape),
                                               pipeline.link_key(inp.step_key, global_microbatch(prog, m), b),
                                               s == b + 1, None if idx is None else idx[1])
  bs, br = carry.bwd_tables
  sent = carry.in_flight.bwd_sent[:b] + (payload,) + carry.in_flight.bwd_sent[b + 1:]
  return carry._replace(bwd_tables=(layout.put_rows(bs, rows, kept_rows(s == b + 1, bs, rows, shape, bs_new)), br),
                        in_flight=carry.in_flight._replace(bwd_sent=sent))


def decode_backward(prog: Program, inp: StepInputs, tick, b: int, carry: ExplicitCarry):
  """Stage b decodes boundary b's gradient payload that crossed back during the tick before, for its
  backward at `tick` (its backward-receiver rows): (gradient, carry)."""
  s, shape, link = jax.lax.axis_index(STAGE), prog.shapes[b], _boundary(prog, b)
  m = microbatch(prog, tick, backward_tick(prog, b))
  _, rows = _link_rows(prog, m, inp.mbs)
  idx = stashed_positions(prog, carry, b, m)
  dx, br_new = boundary_mod.backward_receive(link, prog.mode, carry.in_flight.bwd_arrived[b],
                                             layout.gather_rows(inp.bwd_tables[1], rows, shape), s == b,
                                             None if idx is None else idx[0], shape.dtype)
  bs, br = carry.bwd_tables
  tables = (bs, layout.put_rows(br, rows, kept_rows(s == b, br, rows, shape, br_new)))
  return layout.pad(dx, prog.width, prog.act_dtype), carry._replace(bwd_tables=tables)


def overlapped_tick(prog: Program, inp: StepInputs, tick, plan: Plan, carry: ExplicitCarry) -> ExplicitCarry:
  """One tick with overlapped sends: the payloads encoded at the tick before cross their links, reading only
  the carry (so the tick's compute runs while they are in flight); those that crossed during the tick before
  are decoded for this tick's stage; the stage runs; what it made is encoded to cross during the next tick."""
  s, flight = jax.lax.axis_index(STAGE), carry.in_flight
  cross = lambda sent, arrived, crossing, move: tuple(
      move(_boundary(prog, b).transport)(sent[b]) if b in crossing else arrived[b] for b in range(len(sent)))
  fwd_arrived = cross(flight.fwd_sent, flight.fwd_arrived, plan.fwd_crossing, lambda t: t.forward)
  bwd_arrived = cross(flight.bwd_sent, flight.bwd_arrived, plan.bwd_crossing, lambda t: t.backward)
  x_buf, g_buf = jnp.zeros_like(carry.x_buf), jnp.zeros_like(carry.g_buf)
  for b in plan.fwd_arriving:
    x, carry = decode_forward(prog, inp, tick, b, carry)
    x_buf = jnp.where(s == b + 1, x, x_buf)
  for b in plan.bwd_arriving:
    g, carry = decode_backward(prog, inp, tick, b, carry)
    g_buf = jnp.where(s == b, g, g_buf)
  carry, y_buf, dx_buf = stage_ops(prog, inp, tick, plan, carry._replace(x_buf=x_buf, g_buf=g_buf))
  for b in plan.fwd_sends:
    carry = encode_forward(prog, inp, tick, b, y_buf, carry)
  for b in plan.bwd_sends:
    carry = encode_backward(prog, inp, tick, b, dx_buf, carry)
  flight = carry.in_flight._replace(fwd_arrived=fwd_arrived, bwd_arrived=bwd_arrived)
  return carry._replace(x_buf=jnp.zeros_like(x_buf), g_buf=jnp.zeros_like(g_buf), in_flight=flight)


def empty_in_flight(prog: Program, inp: StepInputs, carry: ExplicitCarry) -> InFlight:
  """Zero payloads of every boundary, shaped as its codecs encode this program's activations."""
  fwd, bwd = [], []
  for b, shape in enumerate(prog.shapes):
    link, key, x = _boundary(prog, b), pipeline.link_key(inp.step_key, 0, b), jnp.zeros(shape.shape, shape.dtype)
    fwd_rows, bwd_rows = _link_rows(prog, 0, inp.mbs)
    fs, bs = layout.gather_rows(carry.fwd_tables[0], fwd_rows, shape), layout.gather_rows(inp.bwd_tables[0], bwd_rows, shape)
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
  """Every tick of the explicit schedule on this device. `scale` weighs each microbatch's
  loss (1 / (M D)): the returned `grads` and backward tables are those of the weighted sum,
  as autodiff of the mean loss gives them."""
  mb_size = microbatch_size(mbs)
  k = stash_slots(prog)
  buf = jnp.zeros((mb_size, prog.width), prog.act_dtype)
  indices = tuple(jax.tree.map(lambda a: jnp.zeros((k, *a.shape), a.dtype), _index_shapes(prog, b))
                  for b in range(prog.pipe.num_stages - 1))
  stash = Stash(jnp.zeros((k, *buf.shape), buf.dtype), jnp.zeros((k, *ms_row.shape), ms_row.dtype), indices)
  carry = ExplicitCarry(buf, buf, stash, ms_row, tuple(fwd_tables), jax.tree.map(jnp.zeros_like, tuple(bwd_tables)),
                        jnp.zeros_like(params_row), jnp.zeros((), jnp.float32), zero_metrics(prog))
  inp = StepInputs(params_row, tuple(bwd_tables), mbs, step_key, scale)
  tick_fn = explicit_tick
  if prog.timing.hop > 1:
    carry, tick_fn = carry._replace(in_flight=empty_in_flight(prog, inp, carry)), overlapped_tick

  def period(carry, start, plans):
    for j, plan in enumerate(plans):
      carry = tick_fn(prog, inp, start + j, plan, carry)
    return carry

  for starts, plans in segments(prog):
    if len(starts) == 1:
      carry = period(carry, starts.start, plans)
    else:
      carry, _ = jax.lax.scan(lambda c, t: (period(c, t, plans), None), carry,
                              jnp.arange(starts.start, starts.stop, starts.step, dtype=jnp.int32))
  return carry
