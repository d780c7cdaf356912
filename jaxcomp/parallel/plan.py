"""A timetable compiled once into what the stage runner reads per tick (pure NumPy: no JAX).

The sharded executor traces a step tick by tick (`stage_runner`); everything static about its ticks is read
from the timetable here, once, and the runner only reads it: the messages sent at the end of each tick, the
chunks each op kind runs at each tick (the branches of a tick's stage switch), per tick which op kinds some
device runs and which boundaries send, and with overlapped sends which payloads cross or are decoded
(`TickPlan`); the runs of ticks that repeat period after period (`Plan.segments`, each a `lax.scan`); GPipe's
fill, steady and drain forward ticks (`Plan.phases`); the arrays traced ticks index (`Lookup`) and the rings'
sizes. The network simulator's tick timing reads the same plan's messages.

A device holds V chunks (chunk c on device c mod D); boundary b joins chunk b's device to chunk b+1's
(`link_ends`: a ring). A message waits in its receiver's ring any number of ticks before its op runs, so any
legal table runs whose devices run at most one op of each kind per tick (`check_runnable`).
"""
import dataclasses
import functools
from typing import NamedTuple

import numpy as np

from jaxcomp.parallel import timetable
from jaxcomp.parallel.timetable import Message, Op, Timetable

ORDER = ("F", "BW", "B", "W")  # the order a device runs a tick's ops in (each after its inputs)


class Lookup(NamedTuple):
  """A table read once for traced ticks: `ops[kind][t, d]` the microbatch of the op of `kind` device d runs
  at tick t, `chunks[kind][t, d]` its chunk's slot v on the device (the chunk is v D + d, D devices; 0 where
  it runs none), `sent[forward][t, b]` the microbatch whose activation (`forward`) or gradient crosses
  boundary b from the end of tick t, `received[forward][t, b]` the one its receiver takes in at tick t (the
  end of the sending tick; with overlapped sends the start of the tick `forwarding_delay` later); -1 where
  there is none. The rings a device keeps microbatches in, one ring per chunk it holds (`ring_slot`):
  `stash_slots` (inputs, their model state and TopK positions, from their arrival to their last use),
  `grad_slots` (output cotangents, from their arrival to the last backward op)."""
  ops: dict
  chunks: dict
  sent: dict
  received: dict
  stash_slots: int
  grad_slots: int


class TickPlan(NamedTuple):
  """What a tick holds, read from the table: the boundaries whose activation (gradient) is sent at its end,
  the op kinds some device runs at it (in `ORDER`), and, with overlapped sends (forwarding delay 2), the
  boundaries whose payload crosses its link during it (encoded the tick before) and those whose payload is
  decoded at it (encoded two ticks before)."""
  fwd_sends: tuple[int, ...]
  bwd_sends: tuple[int, ...]
  kinds: tuple[str, ...]
  fwd_crossing: tuple[int, ...] = ()
  bwd_crossing: tuple[int, ...] = ()
  fwd_arriving: tuple[int, ...] = ()
  bwd_arriving: tuple[int, ...] = ()


def ring_slot(slots: int, v, m):
  """Where chunk slot v's microbatch m lies in a device's rings of V x `slots`: ring v, slot m mod slots."""
  return v * slots + m % slots


def link_ends(b: int, devices: int) -> tuple[int, int]:
  """Boundary b's (sender, receiver) devices: chunk b's and chunk b+1's, chunk c on device c mod D (a ring:
  with V chunks per device the last device's chunks send on to device 0)."""
  return b % devices, (b + 1) % devices


def link_perm(b: int, devices: int) -> tuple[tuple[int, int], ...]:
  """Boundary b's messages as a permutation (`permute.Perm`): its sender sends to its receiver (its gradients
  come back)."""
  return (link_ends(b, devices),)


def check_runnable(table: Timetable) -> None:
  """The executor runs a table with the same number V of chunks on every device where a device runs at most
  one op of each kind, and not both a B and a BW, per tick (one message per boundary each way per tick).
  Else a ValueError."""
  if table.num_chunks % table.num_devices:
    raise ValueError(f"the sharded executor runs the same number of chunks on every device; schedule "
                     f"{table.name!r} has {table.num_chunks} chunks on {table.num_devices} devices")
  for d, row in enumerate(table.ops):
    for t, tick in enumerate(row):
      kinds = [op.kind for op in tick]
      if len(set(kinds)) < len(kinds) or {"B", "BW"} <= set(kinds):
        raise ValueError(f"the sharded executor runs at most one op of each kind (and not a B beside a BW) per "
                         f"device per tick; schedule {table.name!r} runs {', '.join(map(str, tick))} on device "
                         f"{d} at tick {t}")


# When, within tick t, the executor touches a microbatch's rings: (t, phase).
DECODE, FORWARD, INPUT_GRAD, WEIGHT_GRAD, SEND_FORWARD, SEND_BACKWARD = range(6)
PHASE = {"F": FORWARD, "B": INPUT_GRAD, "BW": INPUT_GRAD, "W": WEIGHT_GRAD}


def ring_slots(spans) -> int:
  """The fewest slots k of a ring that holds item m in slot m % k over its span: `spans` maps a ring (a
  chunk) to (m, first, last) triples (ordered (tick, phase)); two items a ring holds at once need distinct
  slots."""
  def fits(k):
    return all(m % k != n % k or last < start or end < first
               for items in spans.values() for i, (m, first, last) in enumerate(items)
               for n, start, end in items[:i])
  return next(k for k in range(1, max([len(items) for items in spans.values()] + [1]) + 1) if fits(k))


def lookup_of(table: Timetable, forwards_only: bool = False) -> Lookup:
  """The `Lookup` of a table the executor runs (`check_runnable`); `forwards_only`: of its forward ops alone
  (an eval step: an input is held until its forward, no cotangent at all)."""
  check_runnable(table)
  T, C, delay = table.ticks, table.num_chunks, table.forwarding_delay
  ops = {kind: np.full((T, table.num_devices), -1, np.int32) for kind in timetable.KINDS}
  chunks = {kind: np.zeros((T, table.num_devices), np.int32) for kind in timetable.KINDS}
  no_messages = lambda: {forward: np.full((T, C - 1), -1, np.int32) for forward in (True, False)}
  sent, received = no_messages(), no_messages()
  at = {}  # op -> (tick, phase); ("recv", forward, receiving chunk, m) -> when its message is taken in
  for op, (t, d, _) in timetable.positions(table).items():
    ops[op.kind][t, d], chunks[op.kind][t, d] = op.microbatch, table.slot(op.chunk)
    at[op] = (t, PHASE[op.kind])
  for t in range(T):
    for msg in timetable.messages(table, t):
      arrival = (t, SEND_FORWARD if msg.forward else SEND_BACKWARD) if delay == 1 else (t + delay, DECODE)
      sent[msg.forward][t, msg.boundary] = msg.microbatch
      received[msg.forward][arrival[0], msg.boundary] = msg.microbatch
      at[("recv", msg.forward, msg.boundary + (1 if msg.forward else 0), msg.microbatch)] = arrival
  inputs, grads = {}, {}
  for c in range(C):
    for m in range(table.microbatches):
      first = at.get(("recv", True, c, m), at[Op("F", c, m)])
      if forwards_only:
        inputs.setdefault(c, []).append((m, first, at[Op("F", c, m)]))
        continue
      backward = [at[Op(k, c, m)] for k in ("B", "BW") if Op(k, c, m) in at][0]
      last = max(at[op] for op in (Op(k, c, m) for k in ("B", "W", "BW")) if op in at)
      # an input is held from its arrival (or forward) until its last backward op and the gradient send
      # that reads its TopK positions; an output cotangent from its arrival until the last backward op
      inputs.setdefault(c, []).append((m, first, max(last, (backward[0], SEND_BACKWARD))))
      if c < C - 1:
        grads.setdefault(c, []).append((m, at[("recv", False, c, m)], last))
  return Lookup(ops, chunks, sent, received, ring_slots(inputs), ring_slots(grads))


def runs(ticks: list[TickPlan], period: int) -> list[tuple[range, tuple]]:
  """(period starts, the period's tick plans): the ticks cut into periods of `period` from tick 0, consecutive
  periods with equal plans forming one run."""
  out = []
  for start in range(0, len(ticks), period):
    block = tuple(ticks[start:start + period])
    if out and out[-1][1] == block:
      out[-1] = (range(out[-1][0].start, start + 1, period), block)
    else:
      out.append((range(start, start + 1, period), block))
  return out


@dataclasses.dataclass(frozen=True)
class Plan:
  """`table` compiled for the runner: of a train step, or (`forwards_only`) of an eval step, which runs the
  table's forwards alone. Each part is computed once, when first read."""
  table: Timetable
  forwards_only: bool = False

  @property
  def forwarding_delay(self) -> int:
    return self.table.forwarding_delay

  @property
  def overlapped_sends(self) -> bool:
    return self.table.overlapped_sends

  def compiled(self) -> "Plan":
    """This plan with every part computed now (the runner's: its table checked runnable, and nothing left to
    compute while its ticks are traced)."""
    for part in ("messages", "running", "lookup", "ticks", "segments", "phases"):
      getattr(self, part)
    return self

  @functools.cached_property
  def messages(self) -> tuple[tuple[Message, ...], ...]:
    """Per tick, the messages sent at its end (`timetable.messages`)."""
    return tuple(timetable.messages(self.table, t) for t in range(self.table.ticks))

  @functools.cached_property
  def running(self) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Per op kind and tick, the chunks some device runs an op of that kind of, by device."""
    return {kind: tuple(tuple(op.chunk for op in timetable.running(self.table, t, (kind,)))
                        for t in range(self.table.ticks)) for kind in timetable.KINDS}

  def sends(self, tick: int, forward: bool = True) -> tuple[int, ...]:
    """The boundaries that carry an activation (`forward`) or a gradient sent at the end of `tick`."""
    return tuple(sorted(msg.boundary for msg in self.messages[tick] if msg.forward == forward))

  @functools.cached_property
  def lookup(self) -> Lookup:
    """`lookup_of` the table (`check_runnable` first)."""
    return lookup_of(self.table, self.forwards_only)

  @functools.cached_property
  def ticks(self) -> tuple[TickPlan, ...]:
    """Every tick's `TickPlan`: a train step's ticks, an eval step's through its last forward (of its forwards
    alone)."""
    forwards = [t for t in range(self.table.ticks) if self.running["F"][t]]
    count = forwards[-1] + 1 if self.forwards_only else self.table.ticks
    kinds = ("F",) if self.forwards_only else ORDER
    plans = []
    for t in range(count):
      tick = TickPlan(self.sends(t), () if self.forwards_only else self.sends(t, forward=False),
                      tuple(kind for kind in kinds if self.running[kind][t]))
      if self.overlapped_sends:  # a payload crosses during the tick after its op, is decoded the tick after
        sent = lambda ago, forward: self.sends(t - ago, forward) if t >= ago else ()
        tick = tick._replace(fwd_crossing=sent(1, True), bwd_crossing=sent(1, False),
                             fwd_arriving=sent(2, True), bwd_arriving=sent(2, False))
      plans.append(tick)
    return tuple(plans)

  @functools.cached_property
  def segments(self) -> tuple[tuple[range, tuple[TickPlan, ...]], ...]:
    """`runs` of the period whose program traces the fewest tick bodies (a run of one period unrolled, a
    longer one scanned: one period's bodies), the shortest such period: 1 for GPipe and fused 1F1B, 2 for
    1F1B (a forward tick, then a backward tick), 3 for ZB-H1 (B, W, F)."""
    traced = lambda cut: sum(len(block) for _, block in cut)
    return tuple(min((runs(list(self.ticks), period) for period in range(1, len(self.ticks) + 1)), key=traced))

  @functools.cached_property
  def phases(self) -> tuple[range, range, range]:
    """(fill, steady, drain) forward ticks of GPipe's forward pass (stride 1): in steady ticks every device
    runs a forward (and every boundary sends); fill and drain are the forward ticks before and after."""
    forward = [t for t in range(self.table.ticks) if self.running["F"][t]]
    steady = [t for t in forward if len(self.running["F"][t]) == self.table.num_devices]
    if not steady:
      return range(len(forward)), range(0), range(len(forward), len(forward))
    return range(steady[0]), range(steady[0], steady[-1] + 1), range(steady[-1] + 1, forward[-1] + 1)
