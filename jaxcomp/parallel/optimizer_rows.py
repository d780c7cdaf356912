"""An optimizer's state as stage rows: each stage's state <-> a row of the sharded state, and its step on a row.

`OptaxRows` flattens an optax optimizer's per-stage state into padded rows (`padded_rows.FlatRows`); `MomentRows`
keeps QuantizedAdam's moments as rows like the parameters; `ChunkRows` runs either on a device that holds V chunks.
`optimizer_rows` picks the rows of an optimizer; `OPTIMIZER_ROWS` names each kind in a checkpoint's description
(`state_layout.StateRows.description`).
"""
from typing import Protocol

import jax
import jax.numpy as jnp
import optax

from jaxcomp.parallel import padded_rows
from jaxcomp.parallel.qadam import QuantizedAdam

class OptimizerRows(Protocol):
  """An optimizer's per-stage states <-> `[S, ...]` rows, and its step on one stage's row."""

  def stack(self, per_stage: tuple):
    """Per-stage states (simulate layout, split by stage) -> stage rows."""

  def unstack(self, rows) -> tuple:
    """Inverse of `stack`."""

  def init_row(self, params_row, s):
    """Stage s's state row, inside the stage's `shard_map` (s traced)."""

  def update(self, grads_row, opt_row, params_row, s):
    """(params row', state row') after one step on the finished gradient row."""

  def check(self, opt_rows, warmup: bool):
    """Refuses a state this step cannot run from (concrete rows)."""


class OptaxRows:
  """An optax optimizer: each stage's state flattened into a padded row (`padded_rows.FlatRows`)."""

  def __init__(self, optimizer: optax.GradientTransformation | None, params_fl: padded_rows.FlatRows, stage_states):
    """`stage_states`: each stage's optimizer state (shapes); `optimizer` None: rows that only stack and unstack."""
    self.optimizer, self.params_fl = optimizer, params_fl
    self.fl = padded_rows.FlatRows(stage_states)

  def stack(self, per_stage):
    return self.fl.stack(per_stage)

  def unstack(self, rows):
    return self.fl.unstack(rows)

  def init_row(self, params_row, s):
    return jax.lax.switch(s, [lambda j=j: self.fl.put(j, self.optimizer.init(self.params_fl.get(j, params_row)))
                              for j in range(len(self.fl.sizes))])

  def update(self, grads_row, opt_row, params_row, s):
    def stage(j):
      def run(params_row, grads_row, opt_row):
        p, g, o = self.params_fl.get(j, params_row), self.params_fl.get(j, grads_row), self.fl.get(j, opt_row)
        updates, o = self.optimizer.update(g, o, p)
        return self.params_fl.put(j, optax.apply_updates(p, updates)), self.fl.put(j, o)
      return run
    return jax.lax.switch(s, [stage(j) for j in range(len(self.fl.sizes))], params_row, grads_row, opt_row)

  def check(self, opt_rows, warmup):
    pass


class MomentRows:
  """QuantizedAdam: its moments are rows like the parameters, its step counts one per stage."""

  def __init__(self, optimizer: QuantizedAdam | None, params_fl: padded_rows.FlatRows):
    """`optimizer` None: rows that only stack and unstack."""
    self.optimizer, self.params_fl = optimizer, params_fl

  def stack(self, per_stage):
    rows = [st._replace(mu=self.params_fl.put(s, st.mu), nu=self.params_fl.put(s, st.nu))
            for s, st in enumerate(per_stage)]
    return jax.tree.map(lambda *r: jnp.stack(r), *rows)

  def unstack(self, rows):
    return tuple(rows._replace(count=rows.count[s], nu_count=rows.nu_count[s], mu=self.params_fl.get(s, rows.mu[s]),
                               nu=self.params_fl.get(s, rows.nu[s])) for s in range(len(self.params_fl.sizes)))

  def init_row(self, params_row, s):
    return self.optimizer.init(jnp.zeros((self.params_fl.size,), self.params_fl.dtype))

  def update(self, grads_row, opt_row, params_row, s):
    """A dense (warm-up) step: Adam on the mean gradient, both moments updated."""
    return self.optimizer.dense_update(grads_row, opt_row, params_row)

  def check(self, opt_rows, warmup):
    if not warmup and not int(opt_rows.nu_count.reshape(-1)[0]):
      raise ValueError("QuantizedAdam freezes Adam's second moment after warm-up, but this state has had "
                       "no warm-up step (v = 0): run Mode.WARMUP steps first")


def optimizer_rows(optimizer, params_fl: padded_rows.FlatRows, stage_params) -> OptimizerRows | None:
  """The rows of `optimizer` (None: no optimizer, an eval step)."""
  if optimizer is None:
    return None
  if isinstance(optimizer, QuantizedAdam):
    return MomentRows(optimizer, params_fl)
  return OptaxRows(optimizer, params_fl, [jax.eval_shape(optimizer.init, p) for p in stage_params])


class ChunkRows:
  """An optimizer's rows on a device that holds V chunks: [V, ...] rows, each chunk's step its own
  (`update`'s s: the chunks' indices [V])."""

  def __init__(self, rows: OptimizerRows):
    self.rows = rows

  def update(self, grads_row, opt_row, params_row, s):
    steps = [self.rows.update(grads_row[v], jax.tree.map(lambda a: a[v], opt_row), params_row[v], s[v])
             for v in range(grads_row.shape[0])]
    return jax.tree.map(lambda *r: jnp.stack(r), *steps)


OPTIMIZER_ROWS = {OptaxRows: "optax", MomentRows: "moments"}
