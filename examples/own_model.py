"""Your own Flax model as a compressed pipeline: three stages of your modules, simulate then sharded.

    python -m examples.own_model          # 3 fake CPU devices when no accelerator has 3

Each stage is a Flax module `__call__(x, train)` wrapped as `jaxcomp.FlaxStage`; the boundary compresses the
activations to 4 bits and their gradients to 8; the same pipeline trains on one device (`simulate`) and on one
device per stage (`sharded`, the payloads in ppermutes), and both count the same bytes.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=3")  # before JAX starts: 3 CPU devices

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jaxcomp


class Encoder(nn.Module):  # your own layers: any Flax module with __call__(x, train)
  @nn.compact
  def __call__(self, x, train: bool = False):
    return nn.relu(nn.Dense(128)(x))


class Head(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = False):
    return nn.Dense(4)(nn.relu(nn.Dense(128)(x)))



def main():
  stages = (jaxcomp.FlaxStage(Encoder()), jaxcomp.FlaxStage(Encoder()), jaxcomp.FlaxStage(Head()))
  boundary = jaxcomp.parse_boundary("maxabs:4:stoch", "maxabs:8:stoch")  # 4-bit activations, 8-bit gradients
  pipe = jaxcomp.Pipeline(stages, boundary, jaxcomp.losses.classification, "x", microbatches=4)

  x = jax.random.normal(jax.random.key(0), (64, 32))
  batch = {"x": x, "label": (x[:, 0] > 0).astype(jnp.int32) + 2 * (x[:, 1] > 0)}
  opt = optax.adam(1e-3)
  STEPS = 50

  # one device: every stage and boundary in one program
  sim = jaxcomp.Simulate()
  state = sim.init_state(pipe, opt, jax.random.key(1), batch)
  step = sim.make_train_step(pipe, opt)
  for _ in range(STEPS):
    state, metrics = step(state, batch)
  print("simulate", float(metrics["loss"]), sim.wire_bytes_per_step(pipe, batch, jaxcomp.Mode.TRAIN))

  # one device per stage (here 3 fake CPU devices): the same numbers, the payloads in ppermutes
  ex = jaxcomp.ShardedExecutor(jaxcomp.make_mesh(3), schedule=jaxcomp.OneFOneB())
  flat = ex.init_state(pipe, opt, jax.random.key(1), batch)
  step = ex.make_train_step(pipe, opt)
  for _ in range(STEPS):
    flat, metrics = step(flat, batch)
  print("sharded", float(metrics["loss"]), ex.wire_bytes_per_step(pipe, batch, jaxcomp.Mode.TRAIN))


if __name__ == "__main__":
  main()
