"""Orbax checkpoints of a whole run, in one layout for every executor, verified on restore.

Checkpoints hold the *simulate layout* (`pipeline.TrainState` of the global batch, as numpy
values), so any executor, mesh shape or process count resumes or warm-starts from any other:
`simulate_layout` converts an executor's state into it, `executor_layout` back. Slot-row
tables of D data shards are their rows concatenated in shard order; a per-example (AQ-SGD)
table takes example i's row from the shard that owns it (`pipeline.example_shard`).

Items per saved epoch: `model` (step, PRNG key data, params, model state, optimizer state),
`compression` (every link table; a warm start ("baseN") takes only `model`), `meta` (JSON:
epoch, history, and per item `arrays`: the dtype, shape and SHA-256 of every array), `host` when an
executor keeps state outside the TrainState (host-memory AQ-SGD tables), `executor` for
the `grad_state` (gpipe: the data-parallel exchange's error rows), restored when the fresh
state's has the same shapes (same stages and data width).
A checkpoint whose files do not read back or whose arrays do not match their checksums is
corrupt: `restore_latest` then falls back to the newest intact one, with a warning.
"""
import hashlib
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxcomp import pipeline


class CorruptCheckpointError(RuntimeError):
  """A checkpoint's files are unreadable or its arrays do not match their checksums."""


def to_host(tree):
  """numpy values of every array in `tree`, gathered from every process (PRNG keys as key data)."""
  def value(x):
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
  return jax.tree.map(value, tree)


def describe(tree) -> list[list]:
  """[dtype, shape, SHA-256 of the bytes] of each array, in tree-flatten order."""
  def entry(a):
    a = np.asarray(a)
    return [a.dtype.str, list(a.shape), hashlib.sha256(a.tobytes()).hexdigest()]  # tobytes: C order
  return [entry(a) for a in jax.tree.leaves(tree)]


def shapes(tree) -> list[list]:
  """[dtype, shape] of each array (the first two fields of `describe`)."""
  return [[np.dtype(a.dtype).str, list(np.shape(a))] for a in jax.tree.leaves(tree)]


# ------------------------------------------------------------------ layouts
def simulate_layout(executor, pipe, optimizer, state, batch) -> pipeline.TrainState:
  """The executor's train state in the simulate layout of the global `batch`: numpy values,
  PRNG key as key data (`Executor.unstack`); the sharded executor's `grad_state` is its data-parallel
  exchange state, kept in the `executor` item."""
  return to_host(executor.unstack(pipe, optimizer, state, batch))


def executor_layout(executor, pipe, optimizer, saved: pipeline.TrainState, batch, like):
  """Inverse of `simulate_layout` (`like`: the executor's fresh state, whose PRNG implementation it takes)."""
  saved = saved._replace(rng=jax.random.wrap_key_data(saved.rng, impl=jax.random.key_impl(like.rng)))
  return executor.stack(pipe, optimizer, saved, batch)


# ------------------------------------------------------------------ files
def _model(state: pipeline.TrainState):
  return (state.step, state.rng, state.params, state.model_state, state.opt_state)


def _like(tree):
  return jax.tree.map(lambda x: np.zeros(np.shape(x), x.dtype), tree)


class Checkpointer:
  """Saves one checkpoint per epoch under `directory`, keeping the newest `keep` and every
  `keep_period`-th epoch (the baselines that "baseN" warm starts take, N = 10, 20, ...).

  `save` and `restore` take simulate-layout states (see `simulate_layout`) with the PRNG key
  as key data; every process calls them together."""

  def __init__(self, directory, keep: int = 2, keep_period: int = 10):
    self.directory = directory
    self.manager = ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, keep_period=keep_period, create=True))

  def save(self, epoch: int, state: pipeline.TrainState, meta: dict, host_state=None):
    """`host_state`: numpy arrays kept outside `state` (or None), saved as the `host` item.

    A checkpoint already saved for `epoch` (the epoch was unfinished then) is replaced.
    """
    state = to_host(state)
    arrays = {"model": _model(state), "compression": state.links, "executor": state.grad_state}
    if host_state is not None:
      arrays["host"] = [np.asarray(a) for a in host_state]
    meta = {**meta, "arrays": {name: describe(tree) for name, tree in arrays.items()}}
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
    """(state, meta) at `epoch`: numpy values shaped like the simulate-layout `like` (PRNG key
    as key data); `model_only` keeps like's compression state.

    Unless `model_only`, the saved `host` item is copied into the arrays `host_state`, which
    must be given exactly when the checkpoint has one. CorruptCheckpointError if the files do
    not read back or an array does not match its checksum (nothing is copied then).
    """
    if epoch not in self.manager.all_steps():
      raise FileNotFoundError(f"no checkpoint for epoch {epoch} in {self.directory}; saved epochs: {self.epochs()}")
    like = to_host(like)
    meta = self.meta(epoch)
    targets = {"model": _model(like)}
    if not model_only:
      saved_host = "host" in meta["arrays"]
      if saved_host != (host_state is not None):
        with_or_without = "with" if saved_host else "without"
        raise ValueError(f"the checkpoint of epoch {epoch} in {self.directory} was saved {with_or_without} "
                         f"host state (AQ-SGD tables in host memory); restore it {with_or_without} host state too")
      targets["compression"] = like.links
      if saved_host:
        targets["host"] = list(host_state)
    for name, tree in targets.items():
      if shapes(tree) != [entry[:2] for entry in meta["arrays"].get(name, [])]:
        raise ValueError(f"the checkpoint of epoch {epoch} in {self.directory} holds {name} arrays of other shapes "
                         "than this run's (another model, width or compression spec?); start from a matching run")
    out = self._arrays(epoch, targets, meta)
    if "host" in targets:
      for array, saved in zip(host_state, out["host"]):
        array[...] = saved
    step, rng, params, model_state, opt_state = out["model"]
    links = like.links if model_only else out["compression"]
    grad_state = self._executor_rows(epoch, like.grad_state, meta) if not model_only else like.grad_state
    return pipeline.TrainState(step, rng, params, model_state, opt_state, links, grad_state), meta

  def _executor_rows(self, epoch, like, meta):
    """The saved `executor` item if it has like's shapes, else `like`."""
    if not jax.tree.leaves(like) or shapes(like) != [entry[:2] for entry in meta["arrays"].get("executor", [])]:
      return like
    return self._arrays(epoch, {"executor": like}, meta)["executor"]

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
      if describe(out[name]) != meta["arrays"][name]:
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
