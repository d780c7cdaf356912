"""How a step's messages and collectives cross the links in `jaxcomp.analysis.netsim`: the link model.

Links (``meter="per_direction"``, the default). One link per direction per boundary (full duplex: the two
directions are independent), ``link.bandwidth_bps`` and ``link.latency_s`` each. A message's bytes hold its
link direction for ``8 * bytes / bandwidth_bps`` seconds and land ``latency_s`` after its last byte left (the
propagation delay holds no sender: the next message may leave behind it, as on a wire); each direction sends its
messages one at a time, FIFO in production order, and a message starts when its producer op has ended and the
link direction is free::

    fwd(s, m).start      = max(stage s free, send_fwd(s-1, m).end)  # s = 0: input at t = 0
    send_fwd(b, m).start = max(link b fwd free, fwd(b, m).end)
    bwd(s, m).start      = max(stage s free, send_bwd(s, m).end)    # s = S-1: after fwd(S-1, m)
    send_bwd(b, m).start = max(link b bwd free, bwd(b+1, m).end)
    send(b, m).end       = start + 8 * bytes / bandwidth_bps + latency_s   # it has landed
    link b free          = its last message's start + 8 * bytes / bandwidth_bps   # its last byte left
    stage s free = its last op's end (its last message's last byte sent, without overlap_sends)

(dataflow timing; the tick timing adds the waits above: a sender's tick ends when its message's last byte has
left, the receiver's when it has landed).

Receiver's meter (``meter="inbound"``: Protocol NanoGPT's `SimPipelineStage.add_delay`). Instead of one link
per direction, each device has one inbound wire shared by everything it receives (activations from the stage
before, gradients from the stage after), billed in the order the device consumes its messages (dataflow: its
ops' order; ticks: the table's order), latency included::

    send(b, m).end = max(wire of the receiver free, producer end) + 8 * bytes / bandwidth_bps + latency_s
    wire of the receiver free = its last message's end

A sender never waits for the meter (its sends are asynchronous; the receiver waits for the landing).

Protocols (``protocol``, ticks only). ``"eager"``: a message leaves once its sender is ready. ``"rendezvous"``
(XLA:CPU's collectives over gloo's TCP transport): the receiver posts its receive when it reaches the collective
and sends a notice of it; the bytes leave only once the notice has crossed, ``max(sender ready, receiver ready +
latency_s)``, and the sender is done with the message as they leave (its socket takes them), the receiver when
they land. A message whose receiver was waiting costs one latency, one whose receiver comes last two.

Collectives (`Collective`). Besides its boundary messages a step runs all-reduces of scalars: the loss and
metrics, the clipping norm, the driver's finiteness check between steps. ``at`` says where the executor runs
one: at tick ``t`` (ticks only; after each device's compute of that tick, before the tick's messages),
``"before_update"`` (after each device's exchange: the clipping norm) or ``"after_update"`` (after every
update: the driver's check). Each is a ring all-reduce over ``N`` ranks: ``2 (N - 1)`` hops one after another,
each ``latency_s + 8 * nbytes / bandwidth_bps``. Eager: a barrier (it starts when the last device reaches it)
then the hops, every device leaving at the end. Rendezvous: gloo's ring of a scalar, rank ``r`` the device
``r``: the reduce-scatter hops ``N-1 -> N-2 -> ... -> 0`` (every receive posted on entry), the allgather ``0 ->
N-1 -> ... -> 1`` (a rank posts its receive once its reduce-scatter send has left, before the value can come
round to it: each allgather hop waits for the value alone), each hop a rendezvous message; a rank leaves when
its last send has left or its last receive landed. (With ``ranks`` beyond the pipeline's devices, the replicas'
ring: the eager barrier.) On the critical path collectives and the notices' crossings count as link time.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from jaxcomp.analysis.events import At, Events, later
from jaxcomp.analysis.link import Link

Meter = Literal["per_direction", "inbound"]
METERS = ("per_direction", "inbound")
Protocol = Literal["eager", "rendezvous"]
PROTOCOLS = ("eager", "rendezvous")
Place = Literal["before_update", "after_update"]


class Collective(NamedTuple):
  """A ring all-reduce of `nbytes` over `ranks` ranks (None: the pipeline's devices; more: its replicas too) at
  `at`: a tick (ticks only), ``"before_update"`` or ``"after_update"`` (module docstring, Collectives)."""
  at: int | Place
  ranks: int | None = None
  nbytes: float = 4.0


class Wires:
  """How a message crosses (module docstring, Links, Receiver's meter and Protocols): `send` evaluates it and
  returns what its sender waits for (None under the receiver's meter)."""

  def __init__(self, link: Link, meter: Meter, protocol: Protocol, fwd_bytes, bwd_bytes, num_devices: int):
    self.link, self.meter, self.protocol, self.num_devices = link, meter, protocol, num_devices
    self.serial = {"send_fwd": [8.0 * n / link.bandwidth_bps for n in fwd_bytes],
                   "send_bwd": [8.0 * n / link.bandwidth_bps for n in bwd_bytes]}

  def send(self, ev: Events, key: tuple, receiver: int, sender_ready, receiver_ready=()) -> At | None:
    """Evaluate message `key` once its sender is ready (`sender_ready`) and, per its protocol, its receiver
    (`receiver_ready`: eager, ready; rendezvous, ready and its notice across the link)."""
    kind, boundary, _ = key
    serial = self.serial[kind][boundary]
    if self.protocol == "rendezvous":
      receiver_ready = [later(r, self.link.latency_s) for r in receiver_ready]
    inputs = [*sender_ready, *receiver_ready]
    if self.meter == "inbound":
      ev.run(key, ("inbound", receiver), inputs, serial + self.link.latency_s)
      return None
    ev.run(key, (kind, boundary % self.num_devices), inputs, serial + self.link.latency_s, holds=serial,
           sent=0.0 if self.protocol == "rendezvous" else serial)
    return At(key, "sent")


def all_reduce(ev: Events, i: int, ranks: int, ready: list[list], link: Link, protocol: Protocol,
                nbytes: float) -> list[list]:
  """Collective `i`, a ring all-reduce of `nbytes` over `ranks` ranks, once each device is ready (`ready`: per
  device, what it waits for): per device, what it waits for to leave it (module docstring, Collectives)."""
  hop = 8.0 * nbytes / link.bandwidth_bps + link.latency_s
  n = len(ready)
  if protocol == "eager" or ranks != n:  # a barrier, then the ring's hops one after another
    ev.run(("collective", i, -1), ("collective", i), [r for refs in ready for r in refs], 2 * (ranks - 1) * hop)
    return [[("collective", i, -1)] for _ in range(n)]
  if n == 1:
    return ready
  notice = lambda refs: [later(r, link.latency_s) for r in refs]
  hops = iter(range(2 * (n - 1)))

  def send(have, receiver_posted=()):
    key = ("collective", i, next(hops))
    ev.run(key, key, [*have, *notice(receiver_posted)], hop, holds=0.0)
    return key
  # reduce-scatter: rank n-1 -> n-2 -> ... -> 0, every receive posted on entry
  arrived = None
  for r in range(n - 1, 0, -1):
    arrived = send(ready[r] + ([arrived] if arrived else []), ready[r - 1])
  # allgather: rank 0 -> n-1 -> ... -> 1; a rank posts its receive once its reduce-scatter send has left, before
  # the value can come round to it, so each hop waits for the value alone
  arrived = send([arrived, *ready[0]])
  exits = [[At(arrived, "sent")]] + [None] * (n - 1)
  for r in range(n - 1, 1, -1):
    arrived = send([arrived])
    exits[r] = [At(arrived, "sent")]
  exits[1] = [arrived]
  return exits
