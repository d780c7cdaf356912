"""A toy training run the driver's tests share: a 3-stage MLP classifier on 48 random examples, batches of 8."""
import jax
import numpy as np
import optax

import jaxcomp
from jaxcomp.data import batching
from jaxcomp.models.mlp import mlp_stages
from jaxcomp.parallel import simulate
from jaxcomp.runtime import train

N, B = 48, 8
RNG = np.random.default_rng(0)
X = RNG.normal(size=(N, 6)).astype(np.float32)
ARRAYS = {"x": X, "label": (X[:, 0] > 0).astype(np.int32)}


def toy_data(poison_epoch=None, shards=1):
  def batches(epoch):
    for batch in batching.iterate(ARRAYS, B, seed=3, epoch=epoch, shards=shards):
      if epoch == poison_epoch:
        batch = {**batch, "x": batch["x"] * np.nan}
      yield batch
  return train.Data(batches, N // B, lambda: batching.iterate(ARRAYS, B, 0, 0, shuffle=False),
                    next(batching.iterate(ARRAYS, B, 0, 0, shuffle=False)), "toy")


def toy_pipe(fwd="aqsgd+quant:2", bwd="ef+quant:4", stages=3):
  return jaxcomp.Pipeline(mlp_stages(8, 2, stages), jaxcomp.parse_boundary(fwd, bwd, num_examples=N),
                          jaxcomp.losses.classification, "x", microbatches=2)


OPT = optax.adam(1e-2)


def toy_fit(tmp, epochs, resume=False, data=None, pipe=None, executor=simulate.Simulate(), hooks=(), **kw):
  """`train.fit` of the toy run for `epochs` (one of them an uncompressed warm-up), checkpointed in `tmp`; `kw`:
  more of `train.RunConfig`."""
  cfg = train.RunConfig(epochs=epochs, warmup_epochs=1, checkpoint_dir=str(tmp), resume=resume, progress=False, **kw)
  return train.fit(pipe or toy_pipe(), OPT, executor, data or toy_data(), cfg, jax.random.key(0), hooks=hooks)
