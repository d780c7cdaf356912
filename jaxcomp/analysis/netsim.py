"""Timeline of one pipelined training step over slow links, on the executor's schedule.

No JAX computation (a schedule is its timetable, `jaxcomp.parallel.timetable`). It turns
per-stage compute times and exact per-boundary wire bytes into a step time at a given
link bandwidth and latency: AQ-SGD's Table 2 (throughput vs bandwidth) from single-machine
figures.

Model
-----
``S`` stages in a chain, ``M`` microbatches. Boundary (link) ``b`` joins stage ``b`` and
stage ``b + 1``. Per microbatch, stage ``s`` spends ``fwd_s[s]`` seconds on its forward and
``bwd_s[s]`` on its backward (codec work included by the caller); link ``b`` carries one
message of ``fwd_bytes[b]`` bytes forward (activation) and one of ``bwd_bytes[b]`` backward
(activation gradient).

Two timings of a table (``ticks``):

Dataflow (``ticks=False``, the default): the table fixes each device's order only. Stage ``s`` runs
one op at a time, in the order of device ``s``'s row (`timetable.device_order`: by tick, and within a
tick in the table's order; under ``1f1b-fused`` a tick holds F(s, m) and then BW(s, m')); an op starts
as soon as its stage is free and its input has arrived, and its message leaves as soon as the op
ends. With ``overlap_sends=True`` a stage goes on computing while its message crosses; with ``False``
it waits for its message to leave before its next op. No executor of this project runs so: it is a
bound (for the same order, the tick timing below is never faster).

Ticks (``ticks=True``): the sharded executor's timeline (`jaxcomp.parallel.stage_runner`, reading the table's
`plan.Plan`). Device ``d``
runs its ops of tick ``t`` one after another from ``ready[d][t]`` (``ready[d][0] = 0``); a collective
couples only its two ends. ``overlap_sends`` is the executor's ``--overlap`` and picks the table (by
name: ``schedules.parse(name, overlap=overlap_sends)``; a table's forwarding delay must agree):

- ``overlap_sends=False`` (forwarding delay 1, the executor without ``--overlap``): every tick is compute, then
  send, then wait. A message of tick ``t`` (sender ``p``, receiver ``q``) starts when both ends have
  computed their tick ``t`` (the collective needs both) and ``ready[d][t+1]`` is the end of ``d``'s
  compute at ``t``, of every message it sent at the end of ``t`` (its last byte left) and of every message
  it received there (landed);
- ``overlap_sends=True`` (forwarding delay 2, ``--overlap``): the message an op makes at tick ``t`` crosses during
  tick ``t+1``: it starts at ``max(ready[p][t+1], ready[q][t+1])`` while both ends compute, and
  ``ready[d][t+2]`` is the end of ``d``'s compute at ``t+1`` and of the messages crossing to or from
  ``d`` during ``t+1``.

A device with no op at a tick still waits for its messages there. Encoding and decoding are in the
ops' times (the caller's ``fwd_s``, ``bwd_s``), as the executor runs them inside its ticks.

Split backwards and chunks. A table may split a backward into ``B`` (a ``bwd_input`` event: the
input gradient, which sends the gradient upstream) and ``W`` (a ``bwd_weight`` event: the weight
gradient, after its ``B``, sending nothing); B takes ``input_grad_share`` of the chunk's ``bwd_s`` and
W the rest (half each by default). A table may place several chunks on a device (interleaved: chunk
``c`` on device ``c mod D``): ``fwd_s``/``bwd_s`` then give each chunk's times, the byte lists each
boundary's, and boundary ``b`` crosses device ``b mod D``'s link to the next device on the ring (the
last device's to device 0 included), shared by the boundaries on it; exchanges and updates are per
device. One chunk per device, none of this changes a timeline.

Links, the receiver's meter (``meter``), the protocols (``protocol``) and the collectives (`Collective`): the link
model of `jaxcomp.analysis.wires`.

Data-parallel exchange (`Exchange`). With ``D`` replicas of the pipeline, the replicas of
stage ``s`` exchange its weight gradient (or QuantizedAdam's first moment) once per step.
Stage ``s``'s exchange starts when stage ``s`` has finished its last op and its last
message has left (under ticks: its last tick has ended, its messages included; its gradient is
complete then, and its network is idle: no overlap with pipeline traffic to count), and takes ``messages * latency_s + 8 * sent_bytes[s] /
bandwidth_bps`` (ring collectives: a dense all-reduce is 2(D-1) messages carrying
2(D-1)/D of the fp32 row; an all-gather of compressed messages is D-1 messages, see
`dataparallel.exchange_bytes`). Each stage's exchange involves only that stage's replicas,
so it need not wait for the whole pipeline: later stages finish their backwards earlier
and their exchanges overlap the drain of earlier stages. Stage 0 finishes last under every
schedule, so with equal rows the step ends with stage 0's exchange, the same time as
"after the whole pipeline"; the choice matters only when a later stage's row is larger.

Tied parameters (`Tied`). Each tied pair's two member devices (GPT-2's embedding on device 0, its head on
device S-1) exchange their gradient segments once per step, one message each way, both at once on a link of
their own between the two (full duplex, at the same bandwidth and latency), taking ``compute_s`` (the codec's
encode and decodes, when compressed) plus ``messages * latency_s + 8 * sent_bytes / bandwidth_bps``. As the
executor's step: a pair's exchange starts when both members are ready, after their data-parallel exchanges
(`dataparallel.DenseMean`, `CompressedMean`: ties after the mean), or before them with ``before_exchange``
(QuantizedAdam ties each replica's gradient before its momentum exchange); a device in several pairs runs them
in order.

Updates. With ``update_s``, stage ``s`` then runs its optimizer step for ``update_s[s]`` seconds,
after its exchange and its tied exchanges (or, without either, after its last op and last message).

The makespan is the end of the last op, message, exchange, tied exchange, update or collective. With zero
communication and uniform stages (``t_f``, ``t_b``), GPipe gives the classic ``(M + S - 1) * (t_f + t_b)``. Every
time is built from ``max`` and ``+`` over fixed orders, so the makespan never decreases when a duration grows: more
bandwidth or fewer bytes never slow a step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from jaxcomp.analysis.events import COMPUTE, Events, Kind, Timeline
from jaxcomp.analysis.link import Link
from jaxcomp.analysis.wires import METERS, PROTOCOLS, Collective, Meter, Protocol, Wires, all_reduce
from jaxcomp.arguments import is_integer
from jaxcomp.parallel import schedules, timetable
from jaxcomp.parallel.plan import Plan


# The bandwidths of AQ-SGD's Table 2.
DEFAULT_BANDWIDTHS_BPS = (10e9, 1e9, 500e6, 300e6, 100e6)


class Exchange(NamedTuple):
  """One step's data-parallel exchange: `sent_bytes[s]` leave each device of stage s, in
  `messages` sequential ring steps (each pays the latency once)."""
  sent_bytes: Sequence[float]
  messages: int


class Tied(NamedTuple):
  """One step's tied-parameter exchanges: per tied pair, its member devices `ends[k]` = (a, b), the bytes each
  sends the other `sent_bytes[k]` (in `messages` messages each way) and the seconds of codec work `compute_s[k]`
  (None: none); `before_exchange`: they run before the data-parallel exchange, not after it."""
  ends: Sequence[tuple[int, int]]
  sent_bytes: Sequence[float]
  messages: int = 1
  compute_s: Sequence[float] | None = None
  before_exchange: bool = False


def _check_time(name: str, value: float) -> None:
  if not (math.isfinite(value) and value >= 0):
    raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _check_bandwidth(bandwidth_bps: float) -> None:
  if not bandwidth_bps > 0:  # also rejects NaN; +inf means free transfers
    raise ValueError(f"bandwidth_bps must be > 0, got {bandwidth_bps!r}")


def _check_count(name: str, value: int, least: int) -> None:
  if not is_integer(value) or value < least:
    raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


def _check_stage_times(fwd_s: Sequence[float], bwd_s: Sequence[float]) -> None:
  if len(fwd_s) == 0:
    raise ValueError("fwd_s must list at least one stage, got an empty sequence")
  if len(bwd_s) != len(fwd_s):
    raise ValueError(f"bwd_s has {len(bwd_s)} entries but fwd_s has {len(fwd_s)} (one per stage)")
  for name, values in (("fwd_s", fwd_s), ("bwd_s", bwd_s)):
    for i, v in enumerate(values):
      _check_time(f"{name}[{i}]", v)


def _check_bytes(name: str, values: Sequence[float], count: int, per: str) -> None:
  if len(values) != count:
    raise ValueError(f"{name} has {len(values)} entries but the pipeline has {count} {per} (one entry each)")
  for i, v in enumerate(values):
    if not (math.isfinite(v) and v >= 0):
      raise ValueError(f"{name}[{i}] must be a finite number of bytes >= 0, got {v!r}")


def _check_tied(tied: Tied, num_devices: int) -> None:
  if len(tied.sent_bytes) != len(tied.ends):
    raise ValueError(f"tied.sent_bytes has {len(tied.sent_bytes)} entries but tied.ends has {len(tied.ends)} pairs "
                     "(one entry each)")
  for k, ends in enumerate(tied.ends):
    if len(ends) != 2 or ends[0] == ends[1] or not all(is_integer(d) and 0 <= d < num_devices for d in ends):
      raise ValueError(f"tied.ends[{k}] must be two different devices in 0..{num_devices - 1}, got {ends!r}")
  _check_bytes("tied.sent_bytes", tied.sent_bytes, len(tied.ends), "tied pairs")
  _check_count("tied.messages", tied.messages, 0)
  if tied.compute_s is not None:
    if len(tied.compute_s) != len(tied.ends):
      raise ValueError(f"tied.compute_s has {len(tied.compute_s)} entries but tied.ends has {len(tied.ends)} pairs")
    for k, t in enumerate(tied.compute_s):
      _check_time(f"tied.compute_s[{k}]", t)


def table_of(schedule: str | schedules.Schedule | timetable.Timetable | Plan, num_chunks: int, microbatches: int,
             overlap: bool = False) -> timetable.Timetable:
  """The table netsim runs: `schedule` itself or its plan's (its chunks and microbatches must be the given ones),
  or the train table of the schedule (a name `schedules.parse` reads, with overlapped sends when `overlap`) for
  `num_chunks` chunks (V per device: num_chunks / V devices) and `microbatches`. A ValueError naming the
  mismatch."""
  if isinstance(schedule, str):
    schedule = schedules.parse(schedule, overlap)
  if isinstance(schedule, Plan):
    schedule = schedule.table
  if isinstance(schedule, schedules.Schedule):
    per_device = schedule.chunks_per_device
    if num_chunks % per_device:
      raise ValueError(f"schedule {schedule.name!r} places {per_device} chunks on each device; netsim was given "
                       f"times for {num_chunks} chunks (fwd_s, one entry per chunk), not a multiple of {per_device}")
    table = schedule.train_table(num_chunks // per_device, microbatches)
  else:
    table = schedule
  if (table.num_chunks, table.microbatches) != (num_chunks, microbatches):
    raise ValueError(f"schedule {table.name!r} has {table.num_chunks} chunks on {table.num_devices} "
                     f"devices and {table.microbatches} microbatches; netsim was given times for "
                     f"{num_chunks} chunks (fwd_s, one entry per chunk) and {microbatches} microbatches")
  return table


def transfer_time(nbytes: float, bandwidth_bps: float, latency_s: float, messages: int = 1) -> float:
  """Seconds to send `nbytes` in `messages` back-to-back messages (`Link.seconds`), its arguments checked."""
  _check_time("nbytes", nbytes)
  _check_bandwidth(bandwidth_bps)
  _check_time("latency_s", latency_s)
  _check_count("messages", messages, 0)
  return Link(bandwidth_bps, latency_s).seconds(nbytes, messages)


def _message_key(msg: timetable.Message) -> tuple[Kind, int, int]:
  return ("send_fwd" if msg.forward else "send_bwd", msg.boundary, msg.microbatch)


def _dataflow(ev: Events, table: timetable.Timetable, compute, wires: Wires, overlap_sends: bool) -> list[list]:
  """Each device's ops in its order, each as soon as its stage is free and its input has arrived (module
  docstring, Dataflow); per device, the events it has done when its last op has ended and its last message
  has left."""
  num_chunks, num_devices = table.num_chunks, table.num_devices
  inbound = wires.meter == "inbound"

  def input_key(kind, c, m):
    """The op or message whose end this op waits for (None: its input is there at t = 0)."""
    if kind == "fwd":
      return ("send_fwd", c - 1, m) if c > 0 else None
    if kind == "bwd_weight":
      return ("bwd_input", c, m)
    return ("send_bwd", c, m) if c < num_chunks - 1 else ("fwd", c, m)

  # A device waits (is skipped) until its next op's input has been evaluated. Per direction, messages are
  # evaluated with their producer, so each link direction is FIFO in production order; under the receiver's
  # meter, when their receiver comes to consume them (its wire bills them in its order). Boundary b crosses
  # link b mod D (device b mod D to the next on the ring): one chunk per device, link b.
  orders = [[(COMPUTE[op.kind], op.chunk, op.microbatch) for op in timetable.device_order(table, d)]
            for d in range(num_devices)]
  position, made = [0] * num_devices, {}  # made: message key -> (its producer op, its receiver)
  sent = {("stage", s): [] for s in range(num_devices)}  # per device, what its last messages wait for
  while any(p < len(o) for p, o in zip(position, orders)):
    progressed = False
    for s, order in enumerate(orders):
      while position[s] < len(order):
        kind, c, m = order[position[s]]
        needs = input_key(kind, c, m)
        if needs in made and needs not in ev.evaluated:  # under the meter: billed now, in consumption order
          wires.send(ev, needs, s, [made[needs]])
        if needs is not None and needs not in ev.evaluated:
          break
        ev.run((kind, c, m), ("stage", s), [needs], compute[kind][c])
        boundary = {"fwd": c, "bwd": c - 1, "bwd_input": c - 1}.get(kind, -1)
        if 0 <= boundary < num_chunks - 1:
          message = ("send_fwd" if kind == "fwd" else "send_bwd", boundary, m)
          if inbound:
            made[message] = (kind, c, m)
          else:
            left = wires.send(ev, message, -1, [(kind, c, m)])
            sent[("stage", s)] = [left]
            if not overlap_sends:
              ev.last[("stage", s)] = left
        position[s] += 1
        progressed = True
    if not progressed:
      raise RuntimeError(f"schedule {table.name!r} deadlocks at stage positions {position}")
  # Device s is done when its last op has ended and its last messages (link s-1 mod D backward, link s
  # forward) have left; under the meter, when its last op has ended.
  return [[ev.last[("stage", s)], *([] if inbound else [ev.last.get(("send_bwd", (s - 1) % num_devices)),
                                                        ev.last.get(("send_fwd", s))])]
          for s in range(num_devices)]


def _ticks(ev: Events, plan: Plan, compute, wires: Wires, barrier) -> list[list]:
  """The plan's table tick by tick, as the sharded executor runs it (module docstring, Ticks), with `barrier(t,
  ready)` running the collectives of tick t; per device, the events it has done when its last tick ends."""
  table = plan.table
  num_devices = table.num_devices
  pending = [[] for _ in range(num_devices)]  # what a device waits for, beyond its last op, before its next op
  ready = lambda: [[ev.last.get(("stage", d)), *pending[d]] for d in range(num_devices)]

  def start(messages):
    """Each message once both its ends are ready (their last op, and what they wait for, ended)."""
    now, out = ready(), []
    for msg in messages:
      key = _message_key(msg)
      out.append((msg, key, wires.send(ev, key, msg.receiver, now[msg.sender], now[msg.receiver])))
    return out

  made = ()  # overlapped sends: the messages made at the tick before, crossing during this one
  for t in range(table.ticks):
    crossing = start(made) if table.overlapped_sends else ()
    for d, row in enumerate(table.ops):
      for op in row[t]:
        kind = COMPUTE[op.kind]
        ev.run((kind, op.chunk, op.microbatch), ("stage", d), pending[d], compute[kind][op.chunk])
        pending[d] = []
    pending = barrier(t, ready(), pending)
    made = plan.messages[t]
    if table.forwarding_delay == 1:
      crossing = start(made)
    for msg, key, left in crossing:
      pending[msg.sender].append(left)
      pending[msg.receiver].append(key)
  return ready()


def _check_collectives(collectives: Sequence[Collective], ticks: int | None) -> None:
  for i, c in enumerate(collectives):
    if c.at not in ("before_update", "after_update"):
      if ticks is None:
        raise ValueError(f"collectives[{i}] runs at tick {c.at!r}: a collective at a tick needs ticks=True (the "
                         f"executor's timeline); without ticks, place it 'before_update' or 'after_update'")
      if not is_integer(c.at) or not 0 <= c.at < ticks:
        raise ValueError(f"collectives[{i}].at must be a tick in [0, {ticks}) or 'before_update' or "
                         f"'after_update', got {c.at!r}")
    if c.ranks is not None:
      _check_count(f"collectives[{i}].ranks", c.ranks, 1)
    _check_time(f"collectives[{i}].nbytes", c.nbytes)


def simulate_step(
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
    fwd_bytes: Sequence[float],
    bwd_bytes: Sequence[float],
    microbatches: int,
    bandwidth_bps: float | Link,
    latency_s: float = 0.0,
    exchange: Exchange | None = None,
    schedule: str | schedules.Schedule | timetable.Timetable | Plan = "gpipe",
    update_s: Sequence[float] | None = None,
    overlap_sends: bool | None = None,
    input_grad_share: float = 0.5,
    ticks: bool = False,
    meter: Meter = "per_direction",
    collectives: Sequence[Collective] = (),
    protocol: Protocol = "eager",
    tied: Tied | None = None,
) -> Timeline:
  """Event timeline of one step on `schedule` (a timetable or its `Plan`, a schedule whose train table it runs,
  or its name as `schedules.parse` reads it: gpipe, 1f1b, 1f1b-fused, zb-h1, interleaved:V; rules in the module
  docstring).

  ``fwd_s``/``bwd_s``: per-chunk compute seconds per microbatch (length ``C``: the stages, one chunk
  per device; interleaved tables: chunk c's times).
  ``fwd_bytes``/``bwd_bytes``: per-boundary bytes per microbatch (length ``C - 1``).
  ``bandwidth_bps``: bits per second of each link, or a `Link` (its bandwidth and latency; ``latency_s`` is then
  left at 0). ``latency_s``: the one-way latency of every message.
  ``exchange``: the data-parallel exchange (``sent_bytes`` per device), or None.
  ``tied``: the tied parameters' exchanges (per pair: its two devices and the bytes each sends), or None.
  ``update_s``: per-device seconds of the optimizer step that ends the step, or None.
  ``ticks``: False: the dataflow timing (the table gives each device's order; by name, its table without
  overlapped sends); True: the sharded executor's ticks.
  ``overlap_sends``: dataflow: whether a stage computes while its messages cross (else it waits for each to
  leave; None: True). Ticks: the executor's ``--overlap``: the table of forwarding delay 2 (by name,
  ``schedules.parse(name, overlap=True)``, M >= 2S; a schedule or table given must have that delay) whose
  messages cross during the next tick, else the table of delay 1, each tick compute, then send, then wait;
  None: a schedule or table given, its own (``overlapped_sends``), a name, its table of delay 1.
  ``input_grad_share``: in a table with split backwards, B(c, m) takes ``input_grad_share * bwd_s[c]``
  and W(c, m) the rest (default: half each; B + W = the fused backward).
  ``meter``: ``"per_direction"``: a link per boundary and direction; ``"inbound"``: Protocol NanoGPT's
  receiver-side meter, one inbound wire per device.
  ``collectives``: the step's all-reduces (`Collective`), in the order the executor runs them.
  ``protocol``: ``"eager"``: a message leaves once its sender is ready; ``"rendezvous"`` (ticks only; XLA:CPU's
  gloo): once its receiver has posted its receive too and that notice has crossed the link.
  """
  if isinstance(bandwidth_bps, Link):
    if latency_s:
      raise ValueError(f"give the latency once: bandwidth_bps is {bandwidth_bps} (with its latency), so latency_s "
                       f"must be left at 0, got {latency_s!r}")
    link = bandwidth_bps
  else:
    _check_bandwidth(bandwidth_bps)
    _check_time("latency_s", latency_s)
    link = Link(bandwidth_bps, latency_s)
  _check_stage_times(fwd_s, bwd_s)
  num_chunks = len(fwd_s)
  _check_bytes("fwd_bytes", fwd_bytes, num_chunks - 1, "links")
  _check_bytes("bwd_bytes", bwd_bytes, num_chunks - 1, "links")
  _check_count("microbatches", microbatches, 1)
  if meter not in METERS:
    raise ValueError(f"meter must be one of {list(METERS)}, got {meter!r}")
  if protocol not in PROTOCOLS:
    raise ValueError(f"protocol must be one of {list(PROTOCOLS)}, got {protocol!r}")
  if protocol == "rendezvous" and (not ticks or meter != "per_direction"):
    raise ValueError(f"protocol 'rendezvous' is the executor's (ticks=True, meter='per_direction'), got "
                     f"ticks={ticks}, meter={meter!r}")
  if not 0 <= input_grad_share <= 1:  # also rejects NaN
    raise ValueError(f"input_grad_share must be in [0, 1] (B's share of the backward), got {input_grad_share!r}")
  table = table_of(schedule, num_chunks, microbatches, overlap=ticks and bool(overlap_sends))
  if overlap_sends is None:
    overlap_sends = table.overlapped_sends if ticks else True
  if ticks and overlap_sends != table.overlapped_sends:
    raise ValueError(f"schedule {table.name!r} has forwarding delay {table.forwarding_delay}, so with ticks=True "
                     f"overlap_sends must be {table.overlapped_sends} (the executor's --overlap runs the table "
                     f"of delay 2: schedules.parse(name, overlap=True)), got {overlap_sends}")
  _check_collectives(collectives, table.ticks if ticks else None)
  num_stages = table.num_devices
  if exchange is not None:
    _check_bytes("exchange.sent_bytes", exchange.sent_bytes, num_stages, "stages")
    _check_count("exchange.messages", exchange.messages, 0)
  if tied is not None:
    _check_tied(tied, num_stages)
  if update_s is not None:
    if len(update_s) != num_stages:
      raise ValueError(f"update_s has {len(update_s)} entries but the schedule has {num_stages} devices "
                       f"(one per device)")
    for i, v in enumerate(update_s):
      _check_time(f"update_s[{i}]", v)

  compute = {"fwd": fwd_s, "bwd": bwd_s, "bwd_input": [input_grad_share * t for t in bwd_s],
             "bwd_weight": [(1 - input_grad_share) * t for t in bwd_s]}
  wires = Wires(link, meter, protocol, fwd_bytes, bwd_bytes, num_stages)
  ev = Events()

  def barrier(at, ready, pending):
    """The collectives placed `at` (a tick or a place), one after another from when each device is ready
    (`ready`: per device, what it waits for); then each device waits to leave the last (`pending` replaced)."""
    for i, c in enumerate(collectives):
      if c.at == at:
        ready = pending = all_reduce(ev, i, c.ranks or num_stages, ready, link, protocol, c.nbytes)
    return [list(refs) for refs in pending]

  if ticks:
    done = _ticks(ev, schedule if isinstance(schedule, Plan) else Plan(table), compute, wires, barrier)
  else:
    done = _dataflow(ev, table, compute, wires, overlap_sends)
  events = tuple(ev.evaluated.values())
  ready = [list(d) for d in done]  # what each device's next event after its pipeline waits for

  def tie():
    for k, ((a, b), n) in enumerate(zip(tied.ends, tied.sent_bytes)):
      codec = tied.compute_s[k] if tied.compute_s is not None else 0.0
      ev.run(("tied", k, -1), ("tied", k), ready[a] + ready[b],
             codec + link.seconds(n, tied.messages))
      ready[a] = ready[b] = [("tied", k, -1)]

  if tied is not None and tied.before_exchange:
    tie()
  if exchange is not None:
    for s, n in enumerate(exchange.sent_bytes):
      ev.run(("exchange", s, -1), ("exchange", s), ready[s], link.seconds(n, exchange.messages))
      ready[s] = [("exchange", s, -1)]
  if tied is not None and not tied.before_exchange:
    tie()
  ready = barrier("before_update", ready, ready)
  if update_s is not None:
    for s, t in enumerate(update_s):
      ev.run(("update", s, -1), ("update", s), ready[s], t)
    ready = [[("update", s, -1)] for s in range(num_stages)]
  barrier("after_update", ready, ready)
  by_kind = lambda kind: tuple(e for e in ev.evaluated.values() if e.kind == kind)

  path = [max(ev.evaluated, key=lambda k: ev.evaluated[k].end)]
  while ev.cause[path[-1]] is not None:
    path.append(ev.cause[path[-1]])
  return Timeline(events, by_kind("exchange"), tuple(ev.evaluated[k] for k in reversed(path)), by_kind("update"),
                  by_kind("collective"), by_kind("tied"))


def throughput(samples_per_step: float, timeline: Timeline) -> float:
  """Training throughput in samples per second."""
  if not (math.isfinite(samples_per_step) and samples_per_step > 0):
    raise ValueError(f"samples_per_step must be a finite number > 0, got {samples_per_step!r}")
  if timeline.makespan <= 0:
    raise ValueError(f"throughput is undefined for a makespan of {timeline.makespan!r} s")
  return samples_per_step / timeline.makespan


def format_bandwidth(bandwidth_bps: float) -> str:
  """``10e9 -> '10 Gbps'``, ``300e6 -> '300 Mbps'``."""
  for scale, unit in ((1e9, "Gbps"), (1e6, "Mbps"), (1e3, "kbps")):
    if bandwidth_bps >= scale:
      return f"{bandwidth_bps / scale:g} {unit}"
  return f"{bandwidth_bps:g} bps"
