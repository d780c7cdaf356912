"""A schedule's timetable: for each device and tick, the ops it runs (the one source of what runs when).

The model's stages are cut into `num_chunks` chunks in order, chunk c placed on device c % D (D devices:
one chunk per device for GPipe, 1F1B and ZB-H1, V for interleaved 1F1B). The ops, on microbatch m:

  F(c, m)   chunk c's forward;
  B(c, m)   its input gradient;   W(c, m)  its weight gradient;
  BW(c, m)  B and W as one op (one vjp of the chunk: the executor's backward).

`Timetable.ops[d][t]` holds the ops device d runs at tick t, in the order it runs them. The messages
are implied: F(c, m) with c < C-1 sends its activation over boundary c to chunk c+1's device; B or
BW(c, m) with c > 0 sends its input gradient over boundary c-1 to chunk c-1's device. A message sent
at the end of tick t is there from tick t + `forwarding_delay`: 1, or 2 with overlapped sends (it crosses
its link during tick t+1, while both devices compute, and is used at tick t+2; MaxText's delayed
activation forwarding: S-1 more ticks each way). Ticks, messages, held inputs and each device's op order
are read from the table by the functions below; `validate` says whether a table is legal. Which tables
there are (GPipe, 1F1B, ZB-H1, interleaved 1F1B) is `jaxcomp.parallel.schedules`.
"""
import dataclasses
from typing import Literal, NamedTuple

OpKind = Literal["F", "B", "W", "BW"]
KINDS = ("F", "B", "W", "BW")
BACKWARDS = ("B", "BW")  # the ops that send an input gradient
OP_TIME = {"F": 1.0, "B": 1.0, "W": 1.0, "BW": 2.0}  # a backward costs about two forwards
# Ticks from the end of the tick a message is sent to the tick it is used: 1, or 2 with overlapped sends
# (`OVERLAPPED_SENDS`: it crosses its link during the tick between, while both ends compute).
FORWARDING_DELAYS = (1, 2)
OVERLAPPED_SENDS = 2


class Op(NamedTuple):
  """One op of a schedule: `kind` of chunk `chunk` on microbatch `microbatch`."""
  kind: OpKind
  chunk: int
  microbatch: int

  def __str__(self) -> str:
    return f"{self.kind}({self.chunk}, {self.microbatch})"


class Message(NamedTuple):
  """What an op sends: an activation (`forward`, chunk b to b+1) or an input gradient (b+1 to b) over
  boundary `boundary`, for `microbatch`, from device `sender` to `receiver`, at the end of `tick`."""
  forward: bool
  boundary: int
  microbatch: int
  sender: int
  receiver: int
  tick: int


@dataclasses.dataclass(frozen=True)
class Timetable:
  """`ops[d][t]`: the ops device d runs at tick t, in order (every device has the same ticks); a message
  sent at the end of tick t is used from tick t + `forwarding_delay` (2: overlapped sends). Checked by
  `validate` when built."""
  name: str
  num_chunks: int
  microbatches: int
  ops: tuple[tuple[tuple[Op, ...], ...], ...]
  forwarding_delay: int = 1

  def __post_init__(self):
    validate(self)

  @property
  def overlapped_sends(self) -> bool:
    """Whether each message crosses its link during the tick after it is sent, while both ends compute."""
    return self.forwarding_delay == OVERLAPPED_SENDS

  @property
  def num_devices(self) -> int:
    return len(self.ops)

  @property
  def ticks(self) -> int:
    return len(self.ops[0])

  def device(self, chunk: int) -> int:
    """The device chunk `chunk` runs on: chunk mod D."""
    return chunk % self.num_devices

  def slot(self, chunk: int) -> int:
    """Which of its device's chunks `chunk` is: chunk // D, its index in the device's [V, ...] stash rings and
    state tables."""
    return chunk // self.num_devices

  @property
  def chunks_per_device(self) -> int:
    """V: the chunks each device runs (C = V D)."""
    return self.num_chunks // self.num_devices


def at_ticks(name: str, num_devices: int, microbatches: int, ticks: dict[Op, int],
             forwarding_delay: int = 1) -> Timetable:
  """The one-chunk-per-device table that runs each op of `ticks` at its tick (F before BW in a tick)."""
  total = max(ticks.values()) + 1
  ops = [[[] for _ in range(total)] for _ in range(num_devices)]
  for op in sorted(ticks, key=lambda op: (ticks[op], KINDS.index(op.kind))):
    ops[op.chunk][ticks[op]].append(op)
  return Timetable(name, num_devices, microbatches, tuple(tuple(map(tuple, row)) for row in ops), forwarding_delay)


def as_soon_as_ready(name: str, num_chunks: int, microbatches: int, orders: list[list[Op]],
                     forwarding_delay: int = 1) -> Timetable:
  """The table that runs each device's `orders[d]` in order, one op per tick, each op at the first tick
  after its `inputs` ran: those of its own chunk the tick after, another chunk's `forwarding_delay` ticks after
  (its message there then, even from a chunk of the same device; 2: overlapped sends). A ValueError if the
  orders wait on each other."""
  delay = forwarding_delay
  ops, placed = set().union(*orders), {}
  rows, position = [[] for _ in orders], [0] * len(orders)
  while any(p < len(order) for p, order in zip(position, orders)):
    tick, ready = len(rows[0]), []
    for d, order in enumerate(orders):
      op = order[position[d]] if position[d] < len(order) else None
      if op is not None and all(need in placed and placed[need] + (1 if need.chunk == op.chunk else delay) <= tick
                                for need in inputs(op, num_chunks) if need in ops):
        ready.append((d, op))
    if not ready and tick - max(placed.values(), default=-delay) >= delay:  # no message in flight: none ever comes
      raise ValueError(f"schedule {name!r}: every device waits at tick {tick}, on "
                       f"{[str(order[p]) for p, order in zip(position, orders) if p < len(order)]}")
    for row in rows:
      row.append(())
    for d, op in ready:
      rows[d][tick] = (op,)
      placed[op] = tick
      position[d] += 1
  return Timetable(name, num_chunks, microbatches, tuple(map(tuple, rows)), delay)


def positions(table: Timetable) -> dict[Op, tuple[int, int, int]]:
  """Every op's (tick, device, index within its tick)."""
  return {op: (t, d, i) for d, row in enumerate(table.ops) for t, tick in enumerate(row)
          for i, op in enumerate(tick)}


def device_order(table: Timetable, device: int) -> tuple[Op, ...]:
  """The ops of `device` in the order it runs them (by tick, then within the tick)."""
  return tuple(op for tick in table.ops[device] for op in tick)


def running(table: Timetable, tick: int, kinds: tuple[str, ...]) -> tuple[Op, ...]:
  """The ops of `kinds` any device runs at `tick`, by device."""
  return tuple(op for row in table.ops for op in row[tick] if op.kind in kinds)


def messages(table: Timetable, tick: int) -> tuple[Message, ...]:
  """The messages sent at the end of `tick`: each F of a chunk before the last, each B or BW after the first."""
  out = []
  for op in running(table, tick, ("F", *BACKWARDS)):
    forward = op.kind == "F"
    if (forward and op.chunk < table.num_chunks - 1) or (not forward and op.chunk > 0):
      to = op.chunk + 1 if forward else op.chunk - 1
      out.append(Message(forward, min(op.chunk, to), op.microbatch, table.device(op.chunk),
                         table.device(to), tick))
  return tuple(out)


def inputs(op: Op, num_chunks: int) -> tuple[Op, ...]:
  """What `op` needs to have run: F(c, m) the activation of F(c-1, m); a backward its own F(c, m) and
  the gradient of chunk c+1's B or BW (the last chunk: its loss, in F(c, m)); W(c, m) its B(c, m)."""
  c, m = op.chunk, op.microbatch
  if op.kind == "F":
    return (Op("F", c - 1, m),) if c > 0 else ()
  if op.kind == "W":
    return (Op("B", c, m),)
  return (Op("F", c, m),) + ((Op("B", c + 1, m), Op("BW", c + 1, m)) if c < num_chunks - 1 else ())


def validate(table: Timetable) -> None:
  """A legal table: devices of equal ticks, each op on its chunk's device; every microbatch's ops
  exactly once (F, and BW or B and W, per chunk); each op after its `inputs` (on the same device
  earlier in its order; on another device at least `forwarding_delay` ticks later, its message then
  there). Else one ValueError naming the schedule and the op."""
  name, C, M, delay = table.name, table.num_chunks, table.microbatches, table.forwarding_delay
  if delay not in FORWARDING_DELAYS:
    raise ValueError(f"schedule {name!r}: a message takes 1 tick (or {OVERLAPPED_SENDS}: overlapped sends), got "
                     f"forwarding_delay={delay}")
  if not table.ops or len({len(row) for row in table.ops}) != 1:
    raise ValueError(f"schedule {name!r}: every device needs the same number of ticks, got "
                     f"{[len(row) for row in table.ops]}")
  seen = {}
  for d, row in enumerate(table.ops):
    for t, tick in enumerate(row):
      for i, op in enumerate(tick):
        if op.kind not in KINDS or not (0 <= op.chunk < C and 0 <= op.microbatch < M):
          raise ValueError(f"schedule {name!r}: {op} at device {d} tick {t} is not an op of {C} chunks "
                           f"and {M} microbatches (kinds {KINDS})")
        if table.device(op.chunk) != d:
          raise ValueError(f"schedule {name!r}: {op} runs on device {d}, but chunk {op.chunk} lives on "
                           f"device {table.device(op.chunk)}")
        if op in seen:
          raise ValueError(f"schedule {name!r}: {op} runs twice (ticks {seen[op][0]} and {t})")
        seen[op] = (t, d, i)
  for c in range(C):
    for m in range(M):
      split = Op("B", c, m) in seen or Op("W", c, m) in seen
      for kind in ("F", *(("B", "W") if split else ("BW",))):
        if Op(kind, c, m) not in seen:
          raise ValueError(f"schedule {name!r}: {Op(kind, c, m)} never runs")
      if split and Op("BW", c, m) in seen:
        raise ValueError(f"schedule {name!r}: {Op('BW', c, m)} runs beside its split B and W")
  for op, (t, d, i) in seen.items():
    for need in inputs(op, C):
      if need in seen:
        t_in, d_in, i_in = seen[need]
        if (t_in, i_in) >= (t, i) if d_in == d else t_in + delay > t:
          there = f", there at tick {t_in + delay}" if delay > 1 else ""
          sent = f", sent at its end{there}" if d_in != d else ""
          raise ValueError(f"schedule {name!r}: {op} at device {d} tick {t} runs before its input {need} "
                           f"(device {d_in} tick {t_in}{sent})")


def held(table: Timetable, device: int) -> list[tuple[int, int]]:
  """(first, last) tick `device` holds each microbatch input of its chunks: from its F to its last backward op."""
  where = positions(table)
  return [(where[Op("F", c, m)][0],
           max(where[op][0] for op in (Op("BW", c, m), Op("B", c, m), Op("W", c, m)) if op in where))
          for c in range(device, table.num_chunks, table.num_devices) for m in range(table.microbatches)]


def inputs_held(table: Timetable, device: int, tick: int) -> int:
  """Microbatch inputs `device` holds at `tick`."""
  return sum(first <= tick <= last for first, last in held(table, device))


def peak_inputs_held(table: Timetable) -> tuple[int, ...]:
  """Per device, the most microbatch inputs it holds at once."""
  def peak(spans):
    starts, ends = sorted(first for first, _ in spans), sorted(last for _, last in spans)
    return max(sum(first <= t for first in starts) - sum(last < t for last in ends) for t in starts)
  return tuple(peak(held(table, d)) for d in range(table.num_devices))


def most_inputs_held(table: Timetable) -> int:
  """The most microbatch inputs any device holds at once (from F to its last backward op; the executor's input
  ring also holds an input from its arrival: `plan.Lookup.stash_slots`)."""
  return max(peak_inputs_held(table))


def bubble_fraction(table: Timetable, op_time: dict[str, float] = OP_TIME) -> float:
  """The fraction of device time idle when an op of kind k takes op_time[k] and messages take none:
  each device runs its ops in its order, each once the device is free and its `inputs` have ended;
  1 - (time in ops) / (D x makespan). GPipe's and 1F1B's is (S-1)/(M+S-1)."""
  end, free = {}, [0.0] * table.num_devices
  for op, (_, d, _) in sorted(positions(table).items(), key=lambda item: item[1]):
    start = max([free[d], *(end[need] for need in inputs(op, table.num_chunks) if need in end)])
    end[op] = free[d] = start + op_time[op.kind]
  return 1.0 - sum(op_time[op.kind] for op in end) / (table.num_devices * max(end.values()))
