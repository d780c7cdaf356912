"""A hand-written 4-stage GPipe loop (shard_map + ppermute), trained with and without compression.

Every tick each stage runs its layer on the activation it holds, then one `ppermute` hands the
activations to the next stage. The compressed twin changes that one call:
`jax.lax.ppermute(h, "stage", perm)` -> `jaxcomp.ppermute(h, "stage", perm, fwd="maxabs:4", bwd="maxabs:8")`.
Both train a student pipeline on a teacher's outputs from the same data and initialisation.

  XLA_FLAGS=--xla_force_host_platform_device_count=4 PYTHONPATH=. python -m examples.gpipe_loop
"""
import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxcomp
from jaxcomp.analysis import hlo_bytes

S, M, B, D = 4, 8, 32, 256  # stages (one per device), microbatches, examples per microbatch, width


def gpipe_loss(send, w, x, y):
  """One stage device's part of the loss: w [1, D, D] its layer; x, y [M, B, D] the microbatches."""
  s = jax.lax.axis_index("stage")
  perm = [(i, i + 1) for i in range(S - 1)]  # stage i hands its output to stage i + 1

  def tick(h, t):  # at tick t, stage s runs microbatch t - s
    h = jnp.where(s == 0, x[jnp.minimum(t, M - 1)], h)
    h = h + jnp.tanh(h @ w[0])
    m = t - (S - 1)  # the microbatch leaving the last stage
    err = jnp.where((s == S - 1) & (m >= 0), jnp.mean((h - y[jnp.maximum(m, 0)]) ** 2), 0.0)
    return send(h, "stage", perm), err  # <- the call the compressed twin replaces

  _, errs = jax.lax.scan(tick, jnp.zeros_like(x[0]), jnp.arange(M + S - 1))
  return jnp.sum(errs) / M


def teacher(w, x):
  """The same residual layers in one program: the targets the pipeline learns."""
  for layer in w:
    x = x + jnp.tanh(x @ layer)
  return x


def train(send, steps: int, mesh, lr: float = 3e-3):
  """Adam on the pipeline's layers (device s holds layer s): (losses, layers, eval loss fn, step, args)."""
  P = jax.P
  keys = jax.random.split(jax.random.key(0), 3)
  w_teacher = jax.random.normal(keys[0], (S, D, D)) * 1.5 / np.sqrt(D)
  w = jax.device_put(jax.random.normal(keys[1], (S, D, D)) * 0.5 / np.sqrt(D),
                     jax.sharding.NamedSharding(mesh, P("stage")))
  opt = optax.adam(lr)
  opt_state = opt.init(w)

  def loss_and_grads(send, w, x, y):
    loss, g = jax.value_and_grad(gpipe_loss, argnums=1)(send, w, x, y)
    return jax.lax.psum(loss, "stage"), g

  def pipeline(send):
    return jax.shard_map(functools.partial(loss_and_grads, send), mesh=mesh, in_specs=(P("stage"), P(), P()),
                         out_specs=(P(), P("stage")), check_vma=False)

  @jax.jit
  def step(w, opt_state, key):
    x = jax.random.normal(key, (M, B, D))
    loss, g = pipeline(send)(w, x, teacher(w_teacher, x))
    updates, opt_state = opt.update(g, opt_state, w)
    return optax.apply_updates(w, updates), opt_state, loss

  @functools.partial(jax.jit, static_argnums=0)
  def evaluate(send, w):  # a held-out batch, sent with `send`
    x = jax.random.normal(keys[2], (M, B, D))
    return pipeline(send)(w, x, teacher(w_teacher, x))[0]

  compiled = step.lower(w, opt_state, keys[0]).compile()
  losses = []
  for t in range(steps):
    w, opt_state, loss = compiled(w, opt_state, jax.random.fold_in(keys[0], t))
    losses.append(float(loss))
  return losses, w, evaluate, compiled


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--fwd", default="maxabs:4", help="forward spec of the compressed twin")
  parser.add_argument("--bwd", default="maxabs:8", help="backward spec of the compressed twin")
  args = parser.parse_args(argv)
  if jax.device_count() < S:
    raise SystemExit(f"error: the loop needs {S} devices, found {jax.device_count()}; on CPU run with "
                     f"XLA_FLAGS=--xla_force_host_platform_device_count={S}")
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:S]), ("stage",))
  sends = {"lax.ppermute": jax.lax.ppermute,
           "jaxcomp.ppermute": functools.partial(jaxcomp.ppermute, fwd=args.fwd, bwd=args.bwd)}
  runs = {name: train(send, args.steps, mesh) for name, send in sends.items()}
  print(f"{S}-stage GPipe loop, {M} microbatches of [{B}, {D}] fp32, {M + S - 1} ticks per step; "
        f"compressed twin fwd={args.fwd} bwd={args.bwd}; Adam, {args.steps} steps, same data and init")
  print("step | loss, lax.ppermute | loss, jaxcomp.ppermute")
  for t in sorted({*range(0, args.steps, max(1, args.steps // 5)), args.steps - 1}):
    print(f"{t:4d} | {runs['lax.ppermute'][0][t]:.4f} | {runs['jaxcomp.ppermute'][0][t]:.4f}")
  for name, (_, w, evaluate, _) in runs.items():
    print(f"eval loss of the {name} run, sent dense / compressed: "
          f"{float(evaluate(sends['lax.ppermute'], w)):.4f} / {float(evaluate(sends['jaxcomp.ppermute'], w)):.4f}")
  link = jaxcomp.compressed_link(args.fwd, args.bwd)
  messages = (M + S - 1) * (S - 1)  # every tick, every pair of perm
  counted = {"lax.ppermute": (B * D * 4,) * 2, "jaxcomp.ppermute": link.wire_bytes((B, D), jnp.float32)}
  for name, (_, _, _, compiled) in runs.items():
    sent = hlo_bytes.collective_bytes(compiled.as_text())
    print(f"bytes per step, {name}: compiled program fwd {sent['fwd']:,} bwd {sent['bwd']:,}; "
          f"counted {messages} x wire_bytes = fwd {messages * counted[name][0]:,} bwd {messages * counted[name][1]:,}")


if __name__ == "__main__":
  main()
