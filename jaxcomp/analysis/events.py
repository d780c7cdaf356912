"""A step's events as the network simulator (`jaxcomp.analysis.netsim`) evaluates them, and its timeline.

Each `Event` runs on a resource (a stage, a link direction, a device's inbound wire, a collective) and starts at the
latest of what frees that resource and its inputs: an earlier event's end, or a moment of one (`At`: a message's
last byte leaving, its link direction free again), possibly later by a notice's crossing (`later`). `Events`
records each event's start and end and the one it waited for last; a `Timeline` holds a step's events and its
critical path, read back from those causes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

Kind = Literal["fwd", "bwd", "bwd_input", "bwd_weight", "send_fwd", "send_bwd", "exchange", "tied", "update",
               "collective"]
COMPUTE = {"F": "fwd", "BW": "bwd", "B": "bwd_input", "W": "bwd_weight"}  # a table's op kind -> its event kind


@dataclass(frozen=True)
class Event:
  """One compute op, one message, one stage's data-parallel exchange or its optimizer update.

  ``index`` is the chunk (the stage where a device holds one chunk) for ``fwd``/``bwd``/``bwd_input``/
  ``bwd_weight``, the device for ``exchange``/``update``, the boundary ``b`` (chunk ``b`` to ``b + 1``) for
  ``send_fwd``/``send_bwd``, the pair for ``tied`` and the position in `netsim.simulate_step`'s ``collectives`` for
  ``collective``; ``microbatch`` is -1 for an ``exchange``, ``tied``, ``update`` or ``collective``. Times are
  seconds from the start of the step; a message's are its first byte leaving and its landing.
  """
  kind: Kind
  index: int
  microbatch: int
  start: float
  end: float


@dataclass(frozen=True)
class Timeline:
  """All events of one step: `events` (compute ops and messages, in evaluation order, not by
  time), one `exchanges` event per stage (none without data parallelism), one `updates` event per
  stage (none without `update_s`), one `tied` event per tied pair (none without `tied`), one `collectives` event
  per collective, and the `critical_path`: from t = 0 to the makespan, each event the one the next waited for last
  (on a tie, the previous event on the same resource). An event on the path counts until the next one starts, at
  most to its end (a message that held up the next message on its link direction, or its sender, until its last
  byte left); a gap before the next one is a receive's notice crossing the link (the rendezvous protocol; also
  before the first event)."""
  events: tuple[Event, ...]
  exchanges: tuple[Event, ...] = ()
  critical_path: tuple[Event, ...] = ()
  updates: tuple[Event, ...] = ()
  collectives: tuple[Event, ...] = ()
  tied: tuple[Event, ...] = ()

  @property
  def pipeline_end(self) -> float:
    """End of the last compute op or message."""
    return max(e.end for e in self.events)

  @property
  def makespan(self) -> float:
    """Step time in seconds: the end of the last op, message, exchange, tied exchange, update or collective."""
    return max(e.end for e in self.events + self.exchanges + self.updates + self.collectives + self.tied)

  def critical_seconds(self) -> dict[str, float]:
    """Seconds of the critical path spent in ``compute`` (forwards, backwards, updates), on a ``link`` (messages
    and collectives), in an ``exchange`` and, when the step has tied exchanges, in a ``tied`` one: they sum to the
    makespan, and say which term dominates the step."""
    terms = {**dict.fromkeys(COMPUTE.values(), "compute"), "send_fwd": "link", "send_bwd": "link",
             "exchange": "exchange", "tied": "tied", "update": "compute", "collective": "link"}
    seconds = dict.fromkeys(("compute", "link", "exchange") + (("tied",) if self.tied else ()), 0.0)
    path = self.critical_path
    seconds["link"] += path[0].start if path else 0.0  # a notice crossing before the first event
    for e, after in zip(path, path[1:]):
      seconds[terms[e.kind]] += min(after.start, e.end) - e.start
      seconds["link"] += max(0.0, after.start - e.end)
    if path:
      seconds[terms[path[-1].kind]] += path[-1].end - path[-1].start
    return seconds


class At(NamedTuple):
  """A moment of an evaluated event to wait for: its ``"end"``, or for a message ``"sent"`` (its sender done with
  it) or ``"free"`` (its link direction free again); ``after`` seconds later (a receive's notice crossing)."""
  key: tuple
  what: str = "end"
  after: float = 0.0


def later(ref, seconds: float):
  """`ref` (an event key, `At`, or None: t = 0) `seconds` later."""
  if ref is None:
    return At(None, "end", seconds)
  return ref._replace(after=ref.after + seconds) if isinstance(ref, At) else At(ref, "end", seconds)


class Events:
  """Events evaluated so far, each with what it waited for last, and what frees each resource."""

  def __init__(self):
    self.evaluated: dict[tuple, Event] = {}  # (kind, index, microbatch) -> its event
    self.cause: dict[tuple, tuple | None] = {}  # the event an event waited for last (None: started at t = 0)
    self.last: dict[tuple, tuple] = {}  # resource -> what frees it: an event's key (its end) or an `At`
    self.moments: dict[tuple, dict[str, float]] = {}  # message key -> {"sent": ..., "free": ...}

  def time(self, ref) -> float:
    if not isinstance(ref, At):
      return self.evaluated[ref].end
    if ref.key is None:
      return ref.after
    return (self.evaluated[ref.key].end if ref.what == "end" else self.moments[ref.key][ref.what]) + ref.after

  def run(self, key, resource, inputs, duration, holds=None, sent=None):
    """Evaluate event `key` on `resource`: it starts when what frees the resource and its inputs (event keys: their
    ends; `At`: a moment; None: nothing) are done, and frees the resource at its end, or `holds` seconds after its
    start; its sender is done with it `sent` seconds after its start (default: `holds`)."""
    waits = [r for r in (self.last.get(resource), *inputs) if r is not None]
    cause = max(waits, key=self.time, default=None)
    self.cause[key] = cause.key if isinstance(cause, At) else cause
    start = self.time(cause) if cause is not None else 0.0
    self.evaluated[key] = Event(*key, start, start + duration)
    if holds is None:
      self.last[resource] = key
    else:
      self.moments[key] = {"free": start + holds, "sent": start + (holds if sent is None else sent)}
      self.last[resource] = At(key, "free")
