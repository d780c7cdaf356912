"""Per-stage pytrees as rows of one zero-padded array, for stage-sharded executors.

Stage s's tree (parameters, model state, optimizer state) is flattened in `tree_flatten`
order, cast to one common dtype and zero-padded to the largest stage: S such rows stacked
are one `[S, size]` array that a mesh shards over its stage axis, whatever the stages'
shapes (`FlatRows`). Activations crossing a boundary are likewise padded to `[rows, F_max]` buffers.

An optimizer's state as such rows, and its step on one stage's row: `OptaxRows` flattens an optax optimizer's
per-stage state (`FlatRows`); `MomentRows` keeps QuantizedAdam's moments as rows like the parameters; `ChunkRows`
runs either on a device that holds V chunks. `optimizer_rows` picks the rows of an optimizer; `OPTIMIZER_ROWS`
names each kind in a checkpoint's description (`state_layout.StateRows.description`).
"""
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp.parallel.qadam import QuantizedAdam


def feature_size(shape) -> int:
  """Elements per row of an array `[rows, ...]`."""
  return int(np.prod(shape[1:], dtype=np.int64))


class FlatRows:
  """Per-stage pytrees <-> rows of one `[S, size]` zero-padded array (tree_flatten order).

  Built from shapes alone (arrays or ShapeDtypeStructs); every leaf is stored in the
  common dtype and cast back on the way out (exact for int counters below 2^24).
  """

  def __init__(self, trees):
    self.leaves = [jax.tree.leaves(t) for t in trees]
    self.treedefs = [jax.tree.structure(t) for t in trees]
    self.sizes = [sum(int(np.prod(l.shape, dtype=np.int64)) for l in ls) for ls in self.leaves]
    self.size = max(1, *self.sizes)
    dtypes = [l.dtype for ls in self.leaves for l in ls]
    self.dtype = jnp.result_type(*dtypes) if dtypes else jnp.float32

  def get(self, s: int, row):
    """Stage s's tree from its row: one split, so that its transpose (the gradient of the
    row) is one concatenation, not a padded copy of the row per leaf."""
    sizes = [int(np.prod(leaf.shape, dtype=np.int64)) for leaf in self.leaves[s]]
    parts = jnp.split(row, np.cumsum(sizes)) if sizes else []
    out = [p.reshape(leaf.shape).astype(leaf.dtype) for p, leaf in zip(parts, self.leaves[s])]
    return jax.tree.unflatten(self.treedefs[s], out)

  def put(self, s: int, tree):
    """Stage s's tree as one padded row."""
    parts = [jnp.ravel(l).astype(self.dtype) for l in jax.tree.leaves(tree)]
    flat = jnp.concatenate(parts) if parts else jnp.zeros((0,), self.dtype)
    return jnp.pad(flat, (0, self.size - flat.shape[0]))

  def stack(self, trees):
    """All stages' trees as the `[S, size]` array."""
    return jnp.stack([self.put(s, t) for s, t in enumerate(trees)])

  def unstack(self, rows) -> tuple:
    """The `[S, size]` array as the tuple of stage trees."""
    return tuple(self.get(s, rows[s]) for s in range(len(self.leaves)))

  def leaf_span(self, s: int, path) -> tuple[int, int]:
    """(offset, size) of the leaf at key path `path` inside stage s's row."""
    offset = 0
    tree = jax.tree.unflatten(self.treedefs[s], self.leaves[s])
    for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      n = int(np.prod(leaf.shape, dtype=np.int64))
      if tuple(getattr(k, "key", getattr(k, "idx", None)) for k in keys) == tuple(path):
        return offset, n
      offset += n
    raise ValueError(f"tied parameter path {path!r} not found in stage {s}")


def pad(x, size: int, dtype):
  """`[rows, ...]` -> `[rows, size]` in `dtype`, zero-padded."""
  flat = x.reshape(x.shape[0], -1).astype(dtype)
  return jnp.pad(flat, ((0, 0), (0, size - flat.shape[1])))


def unpad(buf, like):
  """Inverse of `pad` for an array shaped and typed like `like`."""
  return buf[:, : feature_size(like.shape)].reshape(like.shape).astype(like.dtype)


def _message_rows(rows, features: int, slot: int | None):
  """The index of `rows`' first `features` entries in a `[rows, F]` table, or in slot `slot` of a `[V, rows, F]` one."""
  where = (rows, slice(0, features))
  return where if slot is None else (slot, *where)


def gather_rows(table, rows, like, slot: int | None = None):
  """Message rows of a padded `[rows, F]` table (`slot`: of slot `slot` of a `[V, rows, F]` one, read in place),
  reshaped to `like`'s `[B/M, ...]`."""
  where = _message_rows(rows, feature_size(like.shape), slot)
  return jax.tree.map(lambda t: t[where].reshape(like.shape[0], *like.shape[1:]), table)


def put_rows(table, rows, new, slot: int | None = None):
  """Writes message rows back into a padded `[rows, F]` table (`slot`: into slot `slot` of a `[V, rows, F]` one,
  in place: only those rows are written, never a copy of the slot's table)."""
  def put(t, n):
    return t.at[_message_rows(rows, n[0].size, slot)].set(n.reshape(n.shape[0], -1).astype(t.dtype))
  return jax.tree.map(put, table, new)


def split_by_stage(combined, params: tuple) -> tuple:
  """An optimizer state over the tuple of stage parameters -> one state per stage.

  Subtrees shaped like `params` (the per-parameter slots, e.g. Adam's moments) give stage s
  its member s; other leaves (step counts) are shared by every stage.
  """
  is_slot = _shaped_like(params)
  leaves, treedef = jax.tree.flatten(combined, is_leaf=is_slot)
  return tuple(jax.tree.unflatten(treedef, [l[s] if is_slot(l) else l for l in leaves])
               for s in range(len(params)))


def merge_stages(per_stage: tuple, params: tuple):
  """Inverse of `split_by_stage` (shared leaves are taken from stage 0)."""
  flat = [jax.tree.flatten(st, is_leaf=_shaped_like(p)) for st, p in zip(per_stage, params)]
  treedef, is_slot = flat[0][1], _shaped_like(params[0])
  leaves = [tuple(f[0][i] for f in flat) if is_slot(flat[0][0][i]) else flat[0][0][i]
            for i in range(len(flat[0][0]))]
  return jax.tree.unflatten(treedef, leaves)


def _shaped_like(tree):
  """Predicate: a subtree with `tree`'s structure (and not a bare leaf)."""
  structure = jax.tree.structure(tree)
  return lambda x: jax.tree.structure(x) == structure and structure.num_nodes > 1


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
  """An optax optimizer: each stage's state flattened into a padded row (`FlatRows`)."""

  def __init__(self, optimizer: optax.GradientTransformation | None, params_fl: FlatRows, stage_states):
    """`stage_states`: each stage's optimizer state (shapes); `optimizer` None: rows that only stack and unstack."""
    self.optimizer, self.params_fl = optimizer, params_fl
    self.fl = FlatRows(stage_states)

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

  def __init__(self, optimizer: QuantizedAdam | None, params_fl: FlatRows):
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


def optimizer_rows(optimizer, params_fl: FlatRows, stage_params) -> OptimizerRows | None:
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
