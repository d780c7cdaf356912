"""Fine-tuning from a model trained here: the weights of a run's checkpoint as a new run's initial params.

A warm start ("baseN", `train.warm_start`) continues a run: its step, optimizer state and epoch count go on. A
fine-tuning start takes only the model: `checkpoint_params` reads the params of a checkpoint and the new run starts
at step 0 with a fresh optimizer, lr schedule and compression state (`train.fit(initial_params=...)`), as
fine-tuning a downloaded model does.
"""
import pathlib

import jax
import jax.numpy as jnp

from jaxcomp import pipeline
from jaxcomp.runtime.checkpoint import Checkpointer


def checkpoint_params(checkpoint_dir, pipe: pipeline.Pipeline, optimizer, batch) -> tuple[int, tuple]:
  """(step, per-stage params) of the newest checkpoint in `checkpoint_dir` (a run's `ckpt` folder), for `pipe`'s
  stages. `optimizer` is the one the saved run trained with (its state's shapes are checked, not kept); ValueError
  when the folder has no checkpoint or holds another model."""
  directory = pathlib.Path(checkpoint_dir)
  saved = Checkpointer(directory) if directory.is_dir() else None
  if saved is None or not saved.epochs():
    raise ValueError(f"{directory}: no checkpoint there; pass the folder of a run that saved one")
  like = jax.eval_shape(lambda: pipeline.init_state(pipe, optimizer, jax.random.key(0), batch))
  try:
    state, _ = saved.restore(max(saved.epochs()), like, model_only=True)
  except ValueError as err:
    raise ValueError(f"{directory} holds another model than this run's ({' '.join(str(err).split())}); fine-tune "
                     "with the model, stages and optimizer the saved run had") from None
  finally:
    saved.close()
  return int(state.step), tuple(jax.tree.map(jnp.asarray, p) for p in state.params)
