"""Overlapped sends: a schedule with a forwarding delay of 2 ticks run on one stage device (MaxText's delayed
activation forwarding).

A boundary's message is encoded where it is made (tick t), crosses its link during tick t+1 while both ends
compute (its collective reads only the carry, so nothing of tick t+1 waits for it), and is decoded where it is
used (tick t+2). Each end's compression state moves at its own end: the sender's rows at the encode, the
receiver's at the decode, each by its own microbatch. `OverlappedRunner` is the `StageRunner` with its two hooks
overridden: `start_carry` (the payloads in flight, zero) and `tick`, which runs the runner's send and receive
halves two ticks apart, the collective in the tick between, instead of around it.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp import pipeline
from jaxcomp.compress import boundary as boundary_mod
from jaxcomp.parallel.plan import TickPlan
from jaxcomp.parallel.stage_runner import RECEIVER, SENDER, ExplicitCarry, StageRunner, StepInputs, replaced


class InFlight(NamedTuple):
  """Per group of boundaries of one activation shape (`StageRunner.shape_groups`), the payload this device
  encoded at the tick before (it crosses its link during this tick) and the one it received during the tick
  before (it decodes it at this tick); the activations' and the gradients'. A device sends at most one message
  and receives at most one per tick, direction and shape. Payloads only: no dense tensor waits between ticks."""
  fwd_sent: tuple
  fwd_arrived: tuple
  bwd_sent: tuple
  bwd_arrived: tuple


class OverlappedRunner(StageRunner):
  """`StageRunner` of a plan whose messages are used `forwarding_delay` = 2 ticks after they are sent."""

  def tick(self, inp: StepInputs, tick, tick_plan: TickPlan, carry: ExplicitCarry) -> ExplicitCarry:
    """One tick with overlapped sends: the payloads encoded at the tick before cross their links, reading only
    the carry (so the tick's compute runs while they are in flight); those that crossed during the tick before
    are decoded into their receivers' rings; the stage runs; what it made is encoded to cross during the next
    tick."""
    flight = carry.in_flight

    def cross(sent, arrived, crossing, forward):
      for g, boundaries in self.tick_groups(crossing):
        arrived = replaced(arrived, g, self.carried(boundaries, sent[g], forward))
      return arrived
    fwd_arrived = cross(flight.fwd_sent, flight.fwd_arrived, tick_plan.fwd_crossing, True)
    bwd_arrived = cross(flight.bwd_sent, flight.bwd_arrived, tick_plan.bwd_crossing, False)
    for g, boundaries in self.tick_groups(tick_plan.fwd_arriving):
      carry = self.receive_forward(inp, tick, g, boundaries, flight.fwd_arrived[g], carry, received=True)
    for g, boundaries in self.tick_groups(tick_plan.bwd_arriving):
      carry = self.receive_backward(inp, tick, g, boundaries, flight.bwd_arrived[g], carry, received=True)
    carry, y_buf, dx_buf = self.stage_ops(inp, tick, tick_plan, carry)
    fwd_sent, bwd_sent = flight.fwd_sent, flight.bwd_sent
    for g, boundaries in self.tick_groups(tick_plan.fwd_sends):
      carry, payload = self.send_forward(inp, tick, g, boundaries, y_buf, carry)
      fwd_sent = replaced(fwd_sent, g, payload)
    for g, boundaries in self.tick_groups(tick_plan.bwd_sends):
      carry, payload = self.send_backward(inp, tick, g, boundaries, dx_buf, carry)
      bwd_sent = replaced(bwd_sent, g, payload)
    return carry._replace(in_flight=InFlight(fwd_sent, fwd_arrived, bwd_sent, bwd_arrived))

  def start_carry(self, inp: StepInputs, carry: ExplicitCarry) -> ExplicitCarry:
    """The carry with zero payloads in flight in every shape group, shaped as its codecs encode this program's
    activations."""
    fwd, bwd = [], []
    link, key = self.pipe.boundary, pipeline.link_key(inp.step_key, 0, 0)
    for g, group in enumerate(self.shape_groups):
      b, shape = group[0], self.shapes[group[0]]
      x = jnp.zeros(shape.shape, shape.dtype)
      fwd_rows, bwd_rows = self.link_rows(0, inp.mbs)
      fs = self.end_rows(carry.fwd_tables[0], b, SENDER, fwd_rows, shape)
      bs = self.end_rows(inp.bwd_tables[0], b, RECEIVER, bwd_rows, shape)
      idx = self.stashed_positions(carry, g, b, 0)
      fwd.append(jax.eval_shape(lambda: boundary_mod.forward_send(link, self.mode, x, fs, key, True)[0]))
      bwd.append(jax.eval_shape(lambda: boundary_mod.backward_send(link, self.mode, x, bs, key, True,
                                                                  None if idx is None else idx[RECEIVER])[0]))
    zeros = lambda shapes: tuple(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree) for tree in shapes)
    return carry._replace(in_flight=InFlight(zeros(fwd), zeros(fwd), zeros(bwd), zeros(bwd)))
