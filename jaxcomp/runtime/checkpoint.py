"""Orbax checkpoints of a whole run: each process writes its own shards; any layout restores them, verified.

A checkpoint holds the executor's state as the executor holds it (`Checkpointer.save`): the
simulate layout (`pipeline.TrainState` of the global batch) or a sharded executor's stage rows
and link tables (`state_layout.StateRows`, whose `description` the meta records). Orbax writes
global arrays shard by shard, each process the shards its own devices hold (one copy of each):
no state crosses between processes, AQ-SGD tables included. `restore` reads every array back
(each process from the files) and gives the simulate layout (`StateRows.from_description`
converts rows), so any executor, mesh shape or process count resumes or warm-starts from any
other; `executor_layout` places it as an executor's state. Slot-row tables of D data shards are
their rows concatenated in shard order; a per-example (AQ-SGD) table takes example i's row from
the shard that owns it (`pipeline.example_shard`).

Items per saved epoch: `model` (step, PRNG key data, params, model state, optimizer state),
`compression` (every link table; a warm start ("baseN") takes only `model`), `meta` (JSON:
epoch, history, `layout` for rows, and per item `arrays`: the dtype, shape and, per shard
written, its bounds and SHA-256), `host` when an executor keeps state outside the TrainState
(host-memory AQ-SGD tables), `executor` for the `grad_state` leaves (gpipe: the data-parallel
exchange's error rows) and `tied` for the `tied_state` leaves (the compressed tied exchange's
errors), each restored when the resuming executor's have the same shapes (same stages and data
width). A checkpoint whose files do not read back or whose arrays do not match
their checksums is corrupt: `restore_latest` then falls back to the newest intact one, with a
warning.
"""
import hashlib
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxcomp import pipeline
from jaxcomp.parallel.state_layout import StateRows


class CorruptCheckpointError(RuntimeError):
  """A checkpoint's files are unreadable or its arrays do not match their checksums."""


def to_host(tree):
  """numpy values of every array in `tree`, gathered from every process (PRNG keys as key data).
  For tests and tools: checkpoints gather nothing."""
  def value(x):
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
  return jax.tree.map(value, tree)


def _key_data(x):
  """A typed PRNG key (array or shape) as its key data; anything else as it is."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return jax.eval_shape(jax.random.key_data, x) if isinstance(x, jax.ShapeDtypeStruct) else jax.random.key_data(x)
  return x


def _digest(a) -> str:
  return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()  # C order


def _bounds(index, shape) -> list[list[int]]:
  return [list(part.indices(n)[:2]) for part, n in zip(index, shape)]


def describe(tree) -> list[list]:
  """[dtype, shape, [[bounds, SHA-256], ...]] of each array, in tree-flatten order: one entry per
  distinct shard ([start, stop] per dimension; one for the whole array of a numpy or one-process
  array), hashed by the process that writes it. A collective when arrays span processes: the
  32-byte digests are gathered, so every process returns the same list."""
  leaves = [a if isinstance(a, jax.Array) else np.asarray(a) for a in jax.tree.leaves(tree)]
  shards, mine = [], {}  # shards: (leaf, bounds) in a global order; mine: position -> digest hashed here
  for k, a in enumerate(leaves):
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
      distinct = []
      for index in a.sharding.devices_indices_map(a.shape).values():
        if _bounds(index, a.shape) not in distinct:
          distinct.append(_bounds(index, a.shape))
      for shard in a.addressable_shards:
        if shard.replica_id == 0:
          mine[len(shards) + distinct.index(_bounds(shard.index, a.shape))] = _digest(np.asarray(shard.data))
      shards += [(k, bounds) for bounds in distinct]
    else:
      mine[len(shards)] = _digest(np.asarray(a))
      shards.append((k, [[0, n] for n in np.shape(a)]))
  if any(isinstance(a, jax.Array) and not a.is_fully_addressable for a in leaves):  # every process decides alike
    table = np.zeros((len(shards), 32), np.uint8)  # the digests hashed here; zeros where another process hashes
    for i, d in mine.items():
      table[i] = np.frombuffer(bytes.fromhex(d), np.uint8)
    digests = [bytes(row).hex() for row in np.asarray(multihost_utils.process_allgather(table)).max(axis=0)]
  else:
    digests = [mine[i] for i in range(len(shards))]
  entries = [[np.dtype(a.dtype).str, list(np.shape(a)), []] for a in leaves]
  for (k, bounds), d in zip(shards, digests):
    entries[k][2].append([bounds, d])
  return entries


def matches(a, sums) -> bool:
  """Whether the numpy array `a` has the checksums `describe` gave (or one SHA-256 string, as written
  before checkpoints were sharded)."""
  if isinstance(sums, str):
    return _digest(a) == sums
  return all(_digest(a[tuple(slice(*b) for b in bounds)]) == d for bounds, d in sums)


def shapes(tree) -> list[list]:
  """[dtype, shape] of each array (the first two fields of `describe`)."""
  return [[np.dtype(a.dtype).str, list(np.shape(a))] for a in jax.tree.leaves(tree)]


# ------------------------------------------------------------------ layouts
def simulate_layout(executor, pipe, optimizer, state, batch) -> pipeline.TrainState:
  """The executor's train state in the simulate layout of the global `batch`: numpy values,
  PRNG key as key data (`Executor.unstack`), gathered to every process (tests and tools; a
  checkpoint saves the executor's own state); the sharded executor's `grad_state` per stage."""
  return to_host(executor.unstack(pipe, optimizer, state, batch))


def _abstract(tree) -> bool:
  return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def executor_layout(executor, pipe, optimizer, saved: pipeline.TrainState, batch, like):
  """Inverse of `simulate_layout` (`like`: the executor's fresh state, whose PRNG implementation it
  takes). Link or data-parallel states that `saved` holds only as shapes (`Checkpointer.restore`
  of a model only, or of other shapes) are like's."""
  fresh = {f: getattr(like, f) for f in ("links", "grad_state", "tied_state") if _abstract(getattr(saved, f))}
  blank = {"links": jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), saved.links), "grad_state": (),
           "tied_state": ()}
  saved = saved._replace(rng=jax.random.wrap_key_data(saved.rng, impl=jax.random.key_impl(like.rng)),
                         **{f: blank[f] for f in fresh})
  return executor.stack(pipe, optimizer, saved, batch)._replace(**fresh)


# ------------------------------------------------------------------ files
def _model(state: pipeline.TrainState):
  return (state.step, state.rng, state.params, state.model_state, state.opt_state)


def _like(tree):
  return jax.tree.map(lambda x: np.zeros(np.shape(x), x.dtype), tree)


def _on_host(fn, *args):
  """fn(*args) run on this process's CPU (numpy in and out): conversions that must not touch other processes."""
  cpu = jax.local_devices(backend="cpu")[0]
  return jax.device_get(jax.jit(fn)(*jax.device_put(args, cpu)))


class Checkpointer:
  """Saves one checkpoint per epoch under `directory`, keeping the newest `keep` and every
  `keep_period`-th epoch (the baselines that "baseN" warm starts take, N = 10, 20, ...).

  `save` takes the executor's state as it is, `restore` gives the simulate layout; every process
  calls them together."""

  def __init__(self, directory, keep: int = 2, keep_period: int = 10):
    self.directory = directory
    self.manager = ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, keep_period=keep_period, create=True))

  def save(self, epoch: int, state: pipeline.TrainState, meta: dict, host_state=None, layout: dict | None = None):
    """`state`: the simulate layout (numpy or jax arrays), or with `layout` (`StateRows.description`)
    the rows it describes, global arrays that may span processes (each process writes the shards of
    its own devices); `host_state`: numpy arrays kept outside `state` (or None), saved as the `host` item.

    A checkpoint already saved for `epoch` (the epoch was unfinished then) is replaced.
    """
    state = state._replace(rng=_key_data(state.rng))
    arrays = {"model": _model(state), "compression": state.links, "executor": jax.tree.leaves(state.grad_state),
              "tied": jax.tree.leaves(state.tied_state)}
    if host_state is not None:
      arrays["host"] = [np.asarray(a) for a in host_state]
    meta = {**meta, **({"layout": layout} if layout else {}),
            "arrays": {name: describe(tree) for name, tree in arrays.items()}}
    items = {name: ocp.args.StandardSave(tree) for name, tree in arrays.items() if jax.tree.leaves(tree)}
    if epoch in self.manager.all_steps():
      self.manager.delete(epoch)
    self.manager.save(epoch, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **items))
    self.manager.wait_until_finished()

  def latest_epoch(self) -> int | None:
    return self.manager.latest_step()

  def epochs(self) -> list[int]:
    return list(self.manager.all_steps())

  def restore(self, epoch: int, like: pipeline.TrainState, model_only: bool = False, host_state=None):
    """(state, meta) at `epoch`: numpy values in the simulate layout `like` has (arrays or
    ShapeDtypeStructs; the PRNG key comes back as key data); a checkpoint of rows is converted
    (`StateRows.from_description`). `grad_state` and `tied_state` are the saved ones where they have like's
    shapes, else like's; `model_only` keeps like's compression state.

    Unless `model_only`, the saved `host` item is copied into the arrays `host_state`, which
    must be given exactly when the checkpoint has one. CorruptCheckpointError if the files do
    not read back or an array does not match its checksums (nothing is copied then).
    """
    if epoch not in self.manager.all_steps():
      raise FileNotFoundError(f"no checkpoint for epoch {epoch} in {self.directory}; saved epochs: {self.epochs()}")
    like = like._replace(rng=_key_data(like.rng))
    meta = self.meta(epoch)
    other_shapes = lambda name: ValueError(
        f"the checkpoint of epoch {epoch} in {self.directory} holds {name} arrays of other shapes than this run's "
        "(another model, width or compression spec?); start from a matching run")
    rows = None
    if "layout" in meta:
      try:
        rows = StateRows.from_description(like, meta["layout"])
      except ValueError:
        raise other_shapes("model") from None
    saved_like = jax.eval_shape(rows.stack, like._replace(grad_state=(), tied_state=())) if rows else like
    targets = {"model": _model(saved_like)}
    if not model_only:
      saved_host = "host" in meta["arrays"]
      if saved_host != (host_state is not None):
        with_or_without = "with" if saved_host else "without"
        raise ValueError(f"the checkpoint of epoch {epoch} in {self.directory} was saved {with_or_without} "
                         f"host state (AQ-SGD tables in host memory); restore it {with_or_without} host state too")
      targets["compression"] = saved_like.links
      if saved_host:
        targets["host"] = list(host_state)
    for name, tree in targets.items():
      if shapes(tree) != [entry[:2] for entry in meta["arrays"].get(name, [])]:
        raise other_shapes(name)
    out = self._arrays(epoch, targets, meta)
    if "host" in targets:
      for array, saved in zip(host_state, out["host"]):
        array[...] = saved
    step, rng, params, model_state, opt_state = out["model"]
    links = like.links if model_only else out["compression"]
    if rows:
      params, model_state, opt_state = _on_host(rows.unstack_model, params, model_state, opt_state)
      links = links if model_only else _on_host(rows.untables, links)
    if model_only:
      return pipeline.TrainState(step, rng, params, model_state, opt_state, links, like.grad_state,
                                 like.tied_state), meta
    grad_state = self._saved_or_like(epoch, "executor", like.grad_state, meta, rows and rows.grad_canonical)
    tied_state = self._saved_or_like(epoch, "tied", like.tied_state, meta, rows and rows.tied_canonical)
    return pipeline.TrainState(step, rng, params, model_state, opt_state, links, grad_state, tied_state), meta

  def _saved_or_like(self, epoch, item: str, like, meta, canonical):
    """The saved `item`'s leaves (`executor`: grad_state's, `tied`: tied_state's), converted from the executor's
    rows by `canonical` (given the list of row leaves) when saved as rows, in like's structure if they have like's
    shapes, else `like`."""
    saved = [jax.ShapeDtypeStruct(shape, np.dtype(dtype)) for dtype, shape, _ in meta["arrays"].get(item, [])]
    convert = (lambda leaves: jax.tree.leaves(canonical(leaves))) if canonical else (lambda leaves: leaves)
    if not saved or shapes(jax.eval_shape(convert, saved)) != shapes(like):
      return like
    leaves = self._arrays(epoch, {item: _like(saved)}, meta)[item]
    return jax.tree.unflatten(jax.tree.structure(like), _on_host(convert, leaves))

  def meta(self, epoch):
    """The JSON meta of `epoch` (cheap: no arrays are read); CorruptCheckpointError if it is unreadable
    or lacks the array list."""
    try:
      meta = self.manager.restore(epoch, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as err:  # noqa: BLE001 - any failure to read the file is corruption
      raise self._corrupt(epoch, f"its meta does not read back ({type(err).__name__})") from err
    if not isinstance(meta, dict) or "arrays" not in meta:
      raise self._corrupt(epoch, "its meta lacks the array checksums")
    return meta

  def _arrays(self, epoch, targets: dict, meta):
    """Items `targets` (trees of arrays to take the shapes of) read back and checked against their checksums."""
    stored = {name: tree for name, tree in targets.items() if jax.tree.leaves(tree)}  # empty items are not saved
    try:
      out = {**targets, **self.manager.restore(epoch, args=ocp.args.Composite(
          **{name: ocp.args.StandardRestore(_like(tree)) for name, tree in stored.items()}))} if stored else targets
    except Exception as err:  # noqa: BLE001 - shapes were checked: a failure to read is corruption
      raise self._corrupt(epoch, f"its arrays do not read back ({type(err).__name__})") from err
    for name in targets:
      if not all(matches(np.asarray(a), entry[2]) for a, entry in zip(jax.tree.leaves(out[name]), meta["arrays"][name])):
        raise self._corrupt(epoch, f"its {name} arrays do not match their checksums")
    return out

  def _corrupt(self, epoch, why):
    return CorruptCheckpointError(f"the checkpoint of epoch {epoch} in {self.directory} is corrupt: {why}")

  def restore_latest(self, like: pipeline.TrainState, host_state=None):
    """(epoch, state, meta) of the newest intact checkpoint, warning about each corrupt newer one;
    None when there is no checkpoint; CorruptCheckpointError saying why each is corrupt when none is intact."""
    corrupt = []
    for epoch in sorted(self.epochs(), reverse=True):
      try:
        found = (epoch, *self.restore(epoch, like, host_state=host_state))
      except CorruptCheckpointError as err:
        corrupt.append(str(err))
        continue
      for why in corrupt:
        warnings.warn(f"{why}; trying the previous checkpoint", stacklevel=2)
      return found
    if corrupt:
      raise CorruptCheckpointError(f"no intact checkpoint in {self.directory} (epochs {self.epochs()}): "
                                   + "; ".join(corrupt))
    return None

  def close(self):
    self.manager.close()
