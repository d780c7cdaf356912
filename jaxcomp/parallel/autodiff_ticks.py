"""GPipe's forward ticks differentiated by autodiff (`remat="none"`): `AutodiffRunner`, the `StageRunner` whose
`run_forward` traces the M+S-1 forward ticks alone. Autodiff replays them in reverse: each boundary's op is
`jaxcomp.ppermute`'s custom_vjp (one per boundary: its rule sends the encoded gradient from b+1 to b), and every
stage's internals are saved.
"""
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp import pipeline
from jaxcomp.compress.boundary import LinkState
from jaxcomp.parallel import padded_rows, permute
from jaxcomp.parallel.mesh import STAGE
from jaxcomp.parallel.plan import link_perm
from jaxcomp.parallel.stage_runner import RECEIVER, SENDER, StageRunner, StepInputs, microbatch_size


class Carry(NamedTuple):
  """What one forward tick hands the next (`run_forward`)."""
  x_buf: jax.Array  # the activation this device received, [B/M, F_max]
  model_state: jax.Array  # this stage's model-state row
  fwd_tables: tuple  # (forward sender, forward receiver) padded tables
  loss_sum: jax.Array
  metric_sums: Any


class AutodiffRunner(StageRunner):
  """`StageRunner` of GPipe's forward ticks, differentiable (its backward is their autodiff)."""

  def forward_exchange(self, inp: StepInputs, tick, b: int, y_buf, fwd_tables):
    """Boundary b's whole op for its microbatch at `tick`, whose custom_vjp sends the gradient back under
    autodiff: (received activation buffer, forward tables)."""
    m, shape = self.message_at(tick, b, forward=True), self.shapes[b]
    fwd_rows, bwd_rows = self.link_rows(m, inp.mbs)
    (fs, fr), (bs, br) = fwd_tables, inp.bwd_tables
    y, key = padded_rows.unpad(y_buf, shape), pipeline.link_key(inp.step_key, self.global_microbatch(m), b)
    link = LinkState(self.end_rows(fs, b, SENDER, fwd_rows, shape), self.end_rows(fr, b, RECEIVER, fwd_rows, shape),
                     self.end_rows(bs, b, RECEIVER, bwd_rows, shape), self.end_rows(br, b, SENDER, bwd_rows, shape))
    perm = link_perm(b, self.plan.table.num_devices)
    x, new = permute.CompressedLink(self.pipe.boundary).ppermute(y, link, STAGE, perm, key, mode=self.mode)
    if self.mode.trains:
      fwd_tables = (self.put_end_rows(fs, b, SENDER, fwd_rows, new.fwd_send),
                    self.put_end_rows(fr, b, RECEIVER, fwd_rows, new.fwd_recv))
    return padded_rows.pad(x, self.width, self.act_dtype), fwd_tables

  def forward_tick(self, inp: StepInputs, tick, boundaries, carry: Carry) -> Carry:
    """One tick: this device's stage, then every boundary in `boundaries`."""
    y_buf, ms_row, loss, metrics = self.stage_step(inp, tick, inp.params_row, carry.model_state, carry.x_buf)
    next_x, fwd_tables = jnp.zeros_like(carry.x_buf), carry.fwd_tables
    for b in boundaries:
      x, fwd_tables = self.forward_exchange(inp, tick, b, y_buf, fwd_tables)
      next_x = jnp.where(self.at_ends(b)[1], x, next_x)
    return Carry(next_x, ms_row, fwd_tables, carry.loss_sum + loss,
                 jax.tree.map(jnp.add, carry.metric_sums, metrics))

  def run_forward(self, params_row, ms_row, fwd_tables, bwd_tables, mbs, step_key) -> Carry:
    """The M+S-1 forward ticks (GPipe's table: F(s, m) at tick m + s) on this device: fill and drain unrolled,
    the steady ticks scanned (differentiable: its autodiff is GPipe's backward)."""
    s_count = self.pipe.num_stages
    mb_size = microbatch_size(mbs)
    carry = Carry(jnp.zeros((mb_size, self.width), self.act_dtype), ms_row, tuple(fwd_tables),
                  jnp.zeros((), jnp.float32), self.zero_metrics())
    inp = StepInputs(params_row, tuple(bwd_tables), mbs, step_key)
    tick = lambda t, c, bs: self.forward_tick(inp, t, bs, c)
    fill, steady, drain = self.plan.phases
    for t in fill:
      carry = tick(t, carry, self.plan.ticks[t].fwd_sends)
    if len(steady):
      every = range(s_count - 1)
      carry, _ = jax.lax.scan(lambda c, t: (tick(t, c, every), None), carry,
                              jnp.arange(steady.start, steady.stop, dtype=jnp.int32))
    for t in drain:
      carry = tick(t, carry, self.plan.ticks[t].fwd_sends)
    return carry
