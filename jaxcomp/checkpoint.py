"""Orbax checkpoints of a whole run: train state plus a JSON run position.

Two items per saved epoch: `model` (step, PRNG key data, params, model state, optimizer
state) and `compression` (every link table and the data-parallel gradient state), so a warm
start ("baseN") can take the model of a differently compressed baseline run; plus `meta`
(epoch, history, config); plus `host` when an executor keeps state outside the TrainState
(host-memory AQ-SGD tables, `hostbuffer.HostBuffered.host_state`): numpy arrays, restored
in place. Restoring onto an abstract target brings back exact dtypes, shapes and NamedTuple
structure.
"""
import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxcomp.pipeline import TrainState


def _model(state: TrainState):
  return (state.step, jax.random.key_data(state.rng), state.params, state.model_state, state.opt_state)


def _abstract(tree):
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


class Checkpointer:
  """Saves one checkpoint per epoch under `directory`, keeping the newest `keep` and every
  `keep_period`-th epoch (the baselines that "baseN" warm starts take, N = 10, 20, ...)."""

  def __init__(self, directory, keep: int = 2, keep_period: int = 10):
    self.manager = ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, keep_period=keep_period, create=True))

  def save(self, epoch: int, state: TrainState, meta: dict, host_state=None):
    """`host_state`: numpy arrays kept outside `state` (or None), saved as the `host` item.

    A checkpoint already saved for `epoch` (the epoch was unfinished then) is replaced.
    """
    items = dict(model=ocp.args.StandardSave(_model(state)),
                 compression=ocp.args.StandardSave((state.links, state.grad_state)),
                 meta=ocp.args.JsonSave(meta))
    if host_state is not None:
      items["host"] = ocp.args.StandardSave([np.asarray(a) for a in host_state])
    if epoch in self.manager.all_steps():
      self.manager.delete(epoch)
    self.manager.save(epoch, args=ocp.args.Composite(**items))
    self.manager.wait_until_finished()

  def latest_epoch(self) -> int | None:
    return self.manager.latest_step()

  def epochs(self) -> list[int]:
    return list(self.manager.all_steps())

  def restore(self, epoch: int, like: TrainState, model_only: bool = False, host_state=None):
    """(state, meta) at `epoch`, shaped like `like`; `model_only` keeps like's compression state.

    Unless `model_only`, the saved `host` item is copied into the arrays `host_state`, which
    must be given exactly when the checkpoint has one.
    """
    if epoch not in self.manager.all_steps():
      raise FileNotFoundError(f"no checkpoint for epoch {epoch} in {self.manager.directory}; "
                              f"saved epochs: {self.epochs()}")
    items = dict(model=ocp.args.StandardRestore(_abstract(_model(like))), meta=ocp.args.JsonRestore())
    if not model_only:
      saved_host = "host" in self.manager.item_metadata(epoch)
      if saved_host != (host_state is not None):
        with_or_without = "with" if saved_host else "without"
        raise ValueError(f"the checkpoint of epoch {epoch} in {self.manager.directory} was saved {with_or_without} "
                         f"host state (AQ-SGD tables in host memory); restore it {with_or_without} host state too")
      items["compression"] = ocp.args.StandardRestore(_abstract((like.links, like.grad_state)))
      if saved_host:
        items["host"] = ocp.args.StandardRestore(_abstract(list(host_state)))
    out = self.manager.restore(epoch, args=ocp.args.Composite(**items))
    if "host" in items:
      for array, saved in zip(host_state, out.host):
        array[...] = saved
    step, rng, params, model_state, opt_state = out.model
    links, grad_state = (like.links, like.grad_state) if model_only else out.compression
    state = TrainState(step, jax.random.wrap_key_data(rng), params, model_state, opt_state, links, grad_state)
    return state, out.meta

  def close(self):
    self.manager.close()
