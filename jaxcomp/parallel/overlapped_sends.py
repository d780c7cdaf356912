"""Overlapped sends: a schedule with a forwarding delay of 2 ticks run on one stage device (MaxText's delayed
activation forwarding).

A boundary's message is encoded where it is made (tick t), crosses its link during tick t+1 while both ends
compute (its collective reads only the carry, so nothing of tick t+1 waits for it), and is decoded where it is
used (tick t+2). Each end's compression state moves at its own end: the sender's rows at the encode, the
receiver's at the decode, each by its own microbatch. `OverlappedRunner` is the `StageRunner` with its two hooks
overridden: `start_carry` (the payloads in flight, zero) and `tick`.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp import pipeline
from jaxcomp.compress import boundary as boundary_mod
from jaxcomp.parallel import padded_rows
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

  def encode_forward(self, inp: StepInputs, tick, g: int, boundaries, y_buf, carry: ExplicitCarry) -> ExplicitCarry:
    """This device encodes the activation its forward made at `tick` for the boundary among `boundaries` (of
    shape group g) it sends on (its forward-sender rows, and under index reuse its TopK positions, stashed): the
    payload waits in `in_flight` to cross during the next tick."""
    (b, sends), shape, link = self.own_boundary(boundaries, SENDER), self.shapes[boundaries[0]], self.pipe.boundary
    m = self.message_at(tick, b, forward=True)
    rows, _ = self.link_rows(m, inp.mbs)
    fs, fr = carry.fwd_tables
    payload, fs_new = boundary_mod.forward_send(link, self.mode, padded_rows.unpad(y_buf, shape),
                                                self.end_rows(fs, b, SENDER, rows, shape),
                                                pipeline.link_key(inp.step_key, self.global_microbatch(m), b), sends)
    carry = self.stash_positions(carry, g, b, m, boundary_mod.reuse_positions(link, self.mode, payload), SENDER)
    return carry._replace(fwd_tables=(self.put_end_rows(fs, b, SENDER, rows, fs_new), fr),
                          in_flight=carry.in_flight._replace(fwd_sent=replaced(carry.in_flight.fwd_sent, g, payload)))

  def decode_forward(self, inp: StepInputs, tick, g: int, boundaries, carry: ExplicitCarry) -> ExplicitCarry:
    """This device decodes the payload of shape group g that crossed during the tick before over the boundary
    among `boundaries` it receives on, into its ring (its forward-receiver rows, and under index reuse its copy
    of the TopK positions, stashed)."""
    (b, takes), shape, link = self.own_boundary(boundaries, RECEIVER), self.shapes[boundaries[0]], self.pipe.boundary
    m = self.message_at(tick, b, forward=True, received=True)
    rows, _ = self.link_rows(m, inp.mbs)
    fs, fr = carry.fwd_tables
    arrived = carry.in_flight.fwd_arrived[g]
    x, fr_new = boundary_mod.forward_receive(link, self.mode, arrived, self.end_rows(fr, b, RECEIVER, rows, shape),
                                             takes)
    carry = self.stash_positions(carry, g, b, m, boundary_mod.reuse_positions(link, self.mode, arrived), RECEIVER)
    carry = carry._replace(fwd_tables=(fs, self.put_end_rows(fr, b, RECEIVER, rows, fr_new)))
    return self.deliver(carry, b, m, takes, padded_rows.pad(x, self.width, self.act_dtype), forward=True)

  def encode_backward(self, inp: StepInputs, tick, g: int, boundaries, dx_buf, carry: ExplicitCarry) -> ExplicitCarry:
    """This device encodes the input gradient its backward made at `tick` for the boundary among `boundaries`
    (of shape group g) whose receiver it is (its backward-sender rows): the payload waits in `in_flight` to cross
    back during the next tick."""
    (b, sends), shape, link = self.own_boundary(boundaries, RECEIVER), self.shapes[boundaries[0]], self.pipe.boundary
    m = self.message_at(tick, b, forward=False)
    _, rows = self.link_rows(m, inp.mbs)
    idx = self.stashed_positions(carry, g, b, m)
    payload, bs_new = boundary_mod.backward_send(link, self.mode, padded_rows.unpad(dx_buf, shape),
                                                 self.end_rows(inp.bwd_tables[0], b, RECEIVER, rows, shape),
                                                 pipeline.link_key(inp.step_key, self.global_microbatch(m), b),
                                                 sends, None if idx is None else idx[RECEIVER])
    bs, br = carry.bwd_tables
    return carry._replace(bwd_tables=(self.keep_end_rows(bs, b, RECEIVER, sends, rows, shape, bs_new), br),
                          in_flight=carry.in_flight._replace(bwd_sent=replaced(carry.in_flight.bwd_sent, g, payload)))

  def decode_backward(self, inp: StepInputs, tick, g: int, boundaries, carry: ExplicitCarry) -> ExplicitCarry:
    """This device decodes the gradient payload of shape group g that crossed back during the tick before over
    the boundary among `boundaries` whose sender it is, into its ring (its backward-receiver rows)."""
    (b, takes), shape, link = self.own_boundary(boundaries, SENDER), self.shapes[boundaries[0]], self.pipe.boundary
    m = self.message_at(tick, b, forward=False, received=True)
    _, rows = self.link_rows(m, inp.mbs)
    idx = self.stashed_positions(carry, g, b, m)
    dx, br_new = boundary_mod.backward_receive(link, self.mode, carry.in_flight.bwd_arrived[g],
                                               self.end_rows(inp.bwd_tables[1], b, SENDER, rows, shape), takes,
                                               None if idx is None else idx[SENDER], shape.dtype)
    bs, br = carry.bwd_tables
    tables = (bs, self.keep_end_rows(br, b, SENDER, takes, rows, shape, br_new))
    return self.deliver(carry._replace(bwd_tables=tables), b, m, takes,
                        padded_rows.pad(dx, self.width, self.act_dtype), forward=False)

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
      carry = self.decode_forward(inp, tick, g, boundaries, carry)
    for g, boundaries in self.tick_groups(tick_plan.bwd_arriving):
      carry = self.decode_backward(inp, tick, g, boundaries, carry)
    carry, y_buf, dx_buf = self.stage_ops(inp, tick, tick_plan, carry)
    for g, boundaries in self.tick_groups(tick_plan.fwd_sends):
      carry = self.encode_forward(inp, tick, g, boundaries, y_buf, carry)
    for g, boundaries in self.tick_groups(tick_plan.bwd_sends):
      carry = self.encode_backward(inp, tick, g, boundaries, dx_buf, carry)
    flight = carry.in_flight._replace(fwd_arrived=fwd_arrived, bwd_arrived=bwd_arrived)
    return carry._replace(in_flight=flight)

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
