"""A pipeline schedule is a table: for each device and tick, the ops it runs (the one source).

The model's stages are cut into `num_chunks` chunks in order, chunk c placed on device c % D (D
devices; today one chunk per device, so chunk = stage = device). The ops, on microbatch m:

  F(c, m)   chunk c's forward;
  B(c, m)   its input gradient;   W(c, m)  its weight gradient;
  BW(c, m)  B and W as one op (one vjp of the chunk: the executor's backward).

`Schedule.ops[d][t]` holds the ops device d runs at tick t, in the order it runs them. The messages
are implied: F(c, m) with c < C-1 sends its activation over boundary c to chunk c+1's device; B or
BW(c, m) with c > 0 sends its input gradient over boundary c-1 to chunk c-1's device. A message sent
at the end of tick t is there from tick t + `hop`: 1, or 2 with overlapped sends (it crosses its link
during tick t+1, while both devices compute, and is used at tick t+2; MaxText's delayed activation
forwarding: S-1 more ticks each way). Ticks, messages, stashed inputs and each device's op order are
read from the table by the functions below; `validate` says whether a table is legal.
"""
import dataclasses
from typing import Literal, NamedTuple

Kind = Literal["F", "B", "W", "BW"]
KINDS = ("F", "B", "W", "BW")
BACKWARDS = ("B", "BW")  # the ops that send an input gradient
OP_TIME = {"F": 1.0, "B": 1.0, "W": 1.0, "BW": 2.0}  # a backward costs about two forwards


class Op(NamedTuple):
  """One op of a schedule: `kind` of chunk `chunk` on microbatch `microbatch`."""
  kind: Kind
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
class Schedule:
  """`ops[d][t]`: the ops device d runs at tick t, in order (every device has the same ticks); a message
sent at the end of tick t is used from tick t + `hop` (2: overlapped sends). Checked by `validate` when built."""
  name: str
  num_chunks: int
  microbatches: int
  ops: tuple[tuple[tuple[Op, ...], ...], ...]
  hop: int = 1

  def __post_init__(self):
    validate(self)

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


def at_ticks(name: str, num_devices: int, microbatches: int, ticks: dict[Op, int], hop: int = 1) -> Schedule:
  """The one-chunk-per-device table that runs each op of `ticks` at its tick (F before BW in a tick)."""
  total = max(ticks.values()) + 1
  ops = [[[] for _ in range(total)] for _ in range(num_devices)]
  for op in sorted(ticks, key=lambda op: (ticks[op], KINDS.index(op.kind))):
    ops[op.chunk][ticks[op]].append(op)
  return Schedule(name, num_devices, microbatches, tuple(tuple(map(tuple, row)) for row in ops), hop)


def fused_backward(num_stages: int, microbatches: int, forward_tick, backward_tick) -> dict[Op, int]:
  """F(s, m) at forward_tick(s, m) and BW(s, m) at backward_tick(s, m) for every stage and microbatch."""
  ticks = {}
  for s in range(num_stages):
    for m in range(microbatches):
      ticks[Op("F", s, m)], ticks[Op("BW", s, m)] = forward_tick(s, m), backward_tick(s, m)
  return ticks


def gpipe(num_stages: int, microbatches: int, hop: int = 1) -> Schedule:
  """Every forward, then every backward: F(s, m) at tick m + hs, BW(s, m) at m + M + 2h(S-1) - hs, h = hop
  (2M+2h(S-1) ticks, M inputs stashed per stage)."""
  S, M, h = num_stages, microbatches, hop
  return at_ticks("gpipe", S, M, fused_backward(S, M, lambda s, m: m + h * s,
                                                lambda s, m: m + M + 2 * h * (S - 1) - h * s), h)


def one_f_one_b(num_stages: int, microbatches: int, hop: int = 1) -> Schedule:
  """PipeDream-flush, one op per device per tick: F(s, m) at 2m + hs, BW(s, m) at 2m + 2h(S-1)+1 - hs,
  h = hop (2M+2h(S-1) ticks; min(M, S-s) inputs stashed on stage s for h = 1, about twice that for h = 2)."""
  S, M, h = num_stages, microbatches, hop
  return at_ticks("1f1b", S, M, fused_backward(S, M, lambda s, m: 2 * m + h * s,
                                               lambda s, m: 2 * m + 2 * h * (S - 1) + 1 - h * s), h)


def one_f_one_b_fused(num_stages: int, microbatches: int, hop: int = 1) -> Schedule:
  """1F1B with a forward and a backward per tick: F(s, m) at m + hs, BW(s, m) at m + 2h(S-1) - hs, h = hop
  (M+2h(S-1) ticks; min(M, 2(S-s)-1) inputs stashed on stage s for h = 1)."""
  S, M, h = num_stages, microbatches, hop
  return at_ticks("1f1b-fused", S, M, fused_backward(S, M, lambda s, m: m + h * s,
                                                     lambda s, m: m + 2 * h * (S - 1) - h * s), h)


def as_soon_as_ready(name: str, num_chunks: int, microbatches: int, orders: list[list[Op]], hop: int = 1) -> Schedule:
  """The table that runs each device's `orders[d]` in order, one op per tick, each op at the first tick
  after its `inputs` ran: those of its own chunk the tick after, another chunk's `hop` ticks after (its
  message there then, even from a chunk of the same device; hop 2: overlapped sends). A ValueError if the
  orders wait on each other."""
  ops, placed = set().union(*orders), {}
  rows, position = [[] for _ in orders], [0] * len(orders)
  while any(p < len(order) for p, order in zip(position, orders)):
    tick, ready = len(rows[0]), []
    for d, order in enumerate(orders):
      op = order[position[d]] if position[d] < len(order) else None
      if op is not None and all(need in placed and placed[need] + (1 if need.chunk == op.chunk else hop) <= tick
                                for need in inputs(op, num_chunks) if need in ops):
        ready.append((d, op))
    if not ready and tick - max(placed.values(), default=-hop) >= hop:  # no message in flight: none ever comes
      raise ValueError(f"schedule {name!r}: every device waits at tick {tick}, on "
                       f"{[str(order[p]) for p, order in zip(position, orders) if p < len(order)]}")
    for row in rows:
      row.append(())
    for d, op in ready:
      rows[d][tick] = (op,)
      placed[op] = tick
      position[d] += 1
  return Schedule(name, num_chunks, microbatches, tuple(map(tuple, rows)), hop)


def interleaved(num_stages: int, microbatches: int, chunks_per_device: int, forwards_first: bool = False,
                hop: int = 1) -> Schedule:
  """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): V chunks per device, chunk c on device c mod S
  (its activation goes on to device (c+1) mod S: a ring). Device d's k-th forward is chunk (k mod SV) // S
  of its device on microbatch S (k // SV) + k mod S (backwards take the chunks in reverse): (S-d-1)*2 +
  (V-1)*S forwards first, then one F and one BW in turn, then the remaining BWs; `as_soon_as_ready` places
  them (`hop` 2: overlapped sends). Needs M a multiple of S. Bubble (S-1)/(VM+S-1) (F 1, BW 2).
  `forwards_first`: all V M forwards before any backward (the forward pass in VM+S-1 ticks, the one eval
  steps run)."""
  S, M, V = num_stages, microbatches, chunks_per_device
  if min(S, M, V) < 1:
    raise ValueError(f"interleaved 1F1B needs S, M, V >= 1, got S={S}, M={M}, V={V}")
  _check_microbatches(S, M)

  def order(d):
    def op(kind, k):
      group, r = divmod(k, S * V)
      return Op(kind, (r // S if kind == "F" else V - 1 - r // S) * S + d, group * S + r % S)
    total = V * M
    warmup = total if forwards_first else min(total, (S - d - 1) * 2 + (V - 1) * S)
    steady = [o for k in range(total - warmup) for o in (op("F", warmup + k), op("BW", k))]
    return [op("F", k) for k in range(warmup)] + steady + [op("BW", k) for k in range(total - warmup, total)]
  return as_soon_as_ready(f"interleaved:{V}", S * V, M, [order(d) for d in range(S)], hop)


def zero_bubble_h1(num_stages: int, microbatches: int, hop: int = 1) -> Schedule:
  """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B's order of forwards and input
  gradients, each backward split into B (its input gradient, sent upstream as soon as B ends) and W (its
  weight gradient), stage s deferring its W by hs microbatches to fill the bubbles (h = hop). Device s runs
  F(s, 0..w-1), w = min(M, h(S-s-1)+1) (1F1B's warm-up at that hop); then for j = 0..M-1: B(s, j),
  W(s, j-hs) if j >= hs, F(s, j+w) if any is left; then the W's still owed. `as_soon_as_ready` places
  them, one op per tick, with `hop`: 3M+S-1 ticks for h = 1 and M >= S, 3M+2(S-1) for h = 2 and M >= 2S
  (the deferred W's fill half of the S-1 extra ticks each way that overlapped sends cost 1F1B).

  Memory (h = 1): W(s, m) runs before F(s, m+S), so a device holds at most min(M, S) inputs (from F to W) and
  a ring of 1F1B's `stash_slots` = min(M, S) slots suffices: the peak of 1F1B's first stage, now on
  every stage (stage s holds min(M, S) - min(M, S-s) more inputs than under 1F1B). With F, B and W of
  1 unit and M >= S the bubble is (S-1)/(3M+S-1) (the paper's (S-1)(T_F+T_B-T_W) idle per device),
  against 1F1B's (S-1)/(M+S-1): a third of it as M/S grows (more for M < S, still below 1F1B's)."""
  S, M, h = num_stages, microbatches, hop
  if min(S, M) < 1:
    raise ValueError(f"ZB-H1 needs S, M >= 1, got S={S}, M={M}")

  def order(s):
    warmup = min(M, h * (S - s - 1) + 1)
    ops = [Op("F", s, m) for m in range(warmup)]
    for j in range(M):
      ops += [Op("B", s, j), *([Op("W", s, j - h * s)] if j >= h * s else []),
              *([Op("F", s, j + warmup)] if j + warmup < M else [])]
    return ops + [Op("W", s, m) for m in range(max(0, M - h * s), M)]
  return as_soon_as_ready("zb-h1", S, M, [order(s) for s in range(S)], h)


BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b, "1f1b-fused": one_f_one_b_fused}  # fused BW, any hop
SPLIT_BUILDERS = {"zb-h1": zero_bubble_h1}  # split B and W, any hop
SCHEDULES = (*BUILDERS, *SPLIT_BUILDERS)  # the tables the sharded executor runs
OVERLAP_HOP = 2  # ticks a message takes with overlapped sends: it crosses during the tick after its op


def chunks_per_device(name: str) -> int:
  """V of "interleaved:V" (V chunks per device), 1 for every other schedule; a ValueError for a name that is
  neither one of SCHEDULES nor interleaved:V with V >= 1."""
  kind, _, chunks = name.partition(":")
  if kind == "interleaved" and chunks.isdigit() and int(chunks) >= 1:
    return int(chunks)
  if name not in SCHEDULES:
    raise ValueError(f"schedule must be one of {list(SCHEDULES)} or interleaved:V (V >= 1 chunks per device), "
                     f"got {name!r}")
  return 1


def model_stages(stage_devices: int, name: str) -> int:
  """The stages a model is cut into for `stage_devices` devices under schedule `name`: S, or S·V for interleaved:V."""
  return stage_devices * chunks_per_device(name)


def _check_microbatches(num_stages: int, microbatches: int) -> None:
  """Interleaved 1F1B takes the microbatches S at a time: a ValueError unless S divides M."""
  S, M = num_stages, microbatches
  if M % S:
    raise ValueError(f"interleaved 1F1B needs the microbatches a multiple of the stages, got M={M} for S={S} "
                     f"(use M = {M + S - M % S})")


def check(name: str, num_stages: int, microbatches: int, overlap: bool = False) -> None:
  """The ValueErrors `build` raises for these values, without building the table: an unknown name, M not a
  multiple of S for interleaved:V, M < 2S with overlapped sends."""
  if chunks_per_device(name) > 1:
    _check_microbatches(num_stages, microbatches)
  if overlap:
    check_overlap(name, num_stages, microbatches)


def check_overlap(name: str, num_stages: int, microbatches: int) -> None:
  """Overlapped sends (the executor runs every schedule with them) need M >= 2S: each message then takes two
  ticks, and with fewer microbatches the pipeline never has every stage computing while every link carries a
  message (no steady ticks), so the S-1 extra ticks each way cost more than the overlap can hide. A ValueError
  naming the values and the fix (`chunks_per_device`'s for an unknown name)."""
  chunks_per_device(name)
  if microbatches < 2 * num_stages:
    raise ValueError(f"overlapped sends (--overlap) need at least 2S microbatches per data shard: got M="
                     f"{microbatches} for S={num_stages} stages; use --microbatches {2 * num_stages} (or more), "
                     "or drop --overlap")


def build(name: str, num_stages: int, microbatches: int, overlap: bool = False) -> Schedule:
  """The table of schedule `name` for S stages and M microbatches: one of SCHEDULES (the sharded executor
  runs these), or "interleaved:V" (the sharded executor runs it with V chunks per device: `chunks_per_device`).
  `overlap`: the table with overlapped sends, `OVERLAP_HOP` ticks a message, M >= 2S (`check_overlap`)."""
  check(name, num_stages, microbatches, overlap)
  V, hop = chunks_per_device(name), OVERLAP_HOP if overlap else 1
  if name.startswith("interleaved:"):
    return interleaved(num_stages, microbatches, V, hop=hop)
  return {**BUILDERS, **SPLIT_BUILDERS}[name](num_stages, microbatches, hop)


def positions(schedule: Schedule) -> dict[Op, tuple[int, int, int]]:
  """Every op's (tick, device, index within its tick)."""
  return {op: (t, d, i) for d, row in enumerate(schedule.ops) for t, tick in enumerate(row)
          for i, op in enumerate(tick)}


def device_order(schedule: Schedule, device: int) -> tuple[Op, ...]:
  """The ops of `device` in the order it runs them (by tick, then within the tick)."""
  return tuple(op for tick in schedule.ops[device] for op in tick)


def running(schedule: Schedule, tick: int, kinds: tuple[str, ...]) -> tuple[Op, ...]:
  """The ops of `kinds` any device runs at `tick`, by device."""
  return tuple(op for row in schedule.ops for op in row[tick] if op.kind in kinds)


def messages(schedule: Schedule, tick: int) -> tuple[Message, ...]:
  """The messages sent at the end of `tick`: each F of a chunk before the last, each B or BW after the first."""
  out = []
  for op in running(schedule, tick, ("F", *BACKWARDS)):
    forward = op.kind == "F"
    if (forward and op.chunk < schedule.num_chunks - 1) or (not forward and op.chunk > 0):
      to = op.chunk + 1 if forward else op.chunk - 1
      out.append(Message(forward, min(op.chunk, to), op.microbatch, schedule.device(op.chunk),
                         schedule.device(to), tick))
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


def validate(schedule: Schedule) -> None:
  """A legal table: devices of equal ticks, each op on its chunk's device; every microbatch's ops
  exactly once (F, and BW or B and W, per chunk); each op after its `inputs` (on the same device
  earlier in its order; on another device at least `hop` ticks later, its message then there). Else one
  ValueError naming the schedule and the op."""
  name, C, M = schedule.name, schedule.num_chunks, schedule.microbatches
  if schedule.hop not in (1, OVERLAP_HOP):
    raise ValueError(f"schedule {name!r}: a message takes 1 tick (or {OVERLAP_HOP}: overlapped sends), got hop="
                     f"{schedule.hop}")
  if not schedule.ops or len({len(row) for row in schedule.ops}) != 1:
    raise ValueError(f"schedule {name!r}: every device needs the same number of ticks, got "
                     f"{[len(row) for row in schedule.ops]}")
  seen = {}
  for d, row in enumerate(schedule.ops):
    for t, tick in enumerate(row):
      for i, op in enumerate(tick):
        if op.kind not in KINDS or not (0 <= op.chunk < C and 0 <= op.microbatch < M):
          raise ValueError(f"schedule {name!r}: {op} at device {d} tick {t} is not an op of {C} chunks "
                           f"and {M} microbatches (kinds {KINDS})")
        if schedule.device(op.chunk) != d:
          raise ValueError(f"schedule {name!r}: {op} runs on device {d}, but chunk {op.chunk} lives on "
                           f"device {schedule.device(op.chunk)}")
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
        if (t_in, i_in) >= (t, i) if d_in == d else t_in + schedule.hop > t:
          there = f", there at tick {t_in + schedule.hop}" if schedule.hop > 1 else ""
          sent = f", sent at its end{there}" if d_in != d else ""
          raise ValueError(f"schedule {name!r}: {op} at device {d} tick {t} runs before its input {need} "
                           f"(device {d_in} tick {t_in}{sent})")


def held(schedule: Schedule, device: int) -> list[tuple[int, int]]:
  """(first, last) tick `device` holds each microbatch input of its chunks: from its F to its last backward op."""
  where = positions(schedule)
  return [(where[Op("F", c, m)][0],
           max(where[op][0] for op in (Op("BW", c, m), Op("B", c, m), Op("W", c, m)) if op in where))
          for c in range(device, schedule.num_chunks, schedule.num_devices) for m in range(schedule.microbatches)]


def in_flight(schedule: Schedule, device: int, tick: int) -> int:
  """Microbatch inputs `device` holds at `tick`."""
  return sum(first <= tick <= last for first, last in held(schedule, device))


def peak_in_flight(schedule: Schedule) -> tuple[int, ...]:
  """Per device, the most microbatch inputs it holds at once."""
  def peak(spans):
    starts, ends = sorted(first for first, _ in spans), sorted(last for _, last in spans)
    return max(sum(first <= t for first in starts) - sum(last < t for last in ends) for t in starts)
  return tuple(peak(held(schedule, d)) for d in range(schedule.num_devices))


def stash_slots(schedule: Schedule) -> int:
  """Slots of a ring buffer for inputs awaiting their backward: the most any device holds at once."""
  return max(peak_in_flight(schedule))


def bubble_fraction(schedule: Schedule, op_time: dict[str, float] = OP_TIME) -> float:
  """The fraction of device time idle when an op of kind k takes op_time[k] and messages take none:
  each device runs its ops in its order, each once the device is free and its `inputs` have ended;
  1 - (time in ops) / (D x makespan). GPipe's and 1F1B's is (S-1)/(M+S-1)."""
  end, free = {}, [0.0] * schedule.num_devices
  for op, (_, d, _) in sorted(positions(schedule).items(), key=lambda item: item[1]):
    start = max([free[d], *(end[need] for need in inputs(op, schedule.num_chunks) if need in end)])
    end[op] = free[d] = start + op_time[op.kind]
  return 1.0 - sum(op_time[op.kind] for op in end) / (schedule.num_devices * max(end.values()))
