"""How much each boundary's messages distort what they carry, over a training run.

    python -m experiments.boundary_error --fwd maxabs:2:stoch --bwd maxabs:4:stoch --every 16 \\
        --steps 192 --epochs 6 --train-examples 256 --eval-examples 128

Trains one `experiments.gpt2_wikitext` run (its flags, recipe and presets; simulate executor,
the same initialisation, batches and keys as that command: the same run, step for step) and,
before step 1, every `--every` steps and after the last, sends the first evaluation batch
through the stages (no dropout) with the run's own boundary compression and measures:

* forward, at boundary b: ||C(a) - a||^2 / ||a||^2 of the activation a that crosses it (the
  message the next stage computes on, as in a train step), and the same error over ||a - a_bar||^2,
  a_bar the mean of a over the batch's tokens: the error against the part of a that differs from
  token to token, the part that carries what the tokens are; and that ratio per channel, averaged
  over channels (every channel weighs the same, as for a next stage that rescales its channels: the
  outlier model's, which reads its outlier channels divided by their gain);
* backward, at boundary b: ||C'(g) - g||^2 / ||g||^2 of the gradient g that crosses it back
  (g computed from the compressed backward messages of the boundaries after it, as in a step);
* per stage, the cosine between its weight gradient in that compressed step and the exact
  one (fp32 both ways): how much of the learning signal reaches it.

EF, EF21 and EF-mixed send from the run's current state (the batch-slot rows of the probe), and their
state's size ||e||^2 / ||a||^2 is reported too; AQ-SGD (rows per training example) is refused.
`--save FILE.npz` keeps the last measurement's activations (`fwd_b`) and gradients (`bwd_b`), for
`python -m benchmarks.quantizer_error --recorded FILE.npz`. The table is printed; `--json FILE`
writes it too.
"""
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from experiments import cli, config, gpt2_wikitext
from jaxcomp.compress.boundary import Mode
from jaxcomp.parallel import executors, simulate


def _relative(approx, exact):
  exact32 = exact.astype(jnp.float32)
  return jnp.sum(jnp.square(approx.astype(jnp.float32) - exact32)) / jnp.sum(jnp.square(exact32))


def _cosine(a_tree, b_tree):
  a = jnp.concatenate([x.reshape(-1) for x in jax.tree.leaves(a_tree)])
  b = jnp.concatenate([x.reshape(-1) for x in jax.tree.leaves(b_tree)])
  return jnp.vdot(a, b) / jnp.sqrt(jnp.vdot(a, a) * jnp.vdot(b, b))


def varying(a):
  """a minus its mean over every token (all axes but the last): the part that differs between tokens."""
  a32 = a.astype(jnp.float32)
  return a32 - jnp.mean(a32, axis=tuple(range(a.ndim - 1)))


def channel_varying_error(error_BxTxF, a):
  """Mean over channels of ||C(a)_c - a_c||^2 / ||a_c - a_bar_c||^2 (channels that do not vary left out)."""
  axes = tuple(range(a.ndim - 1))
  energy = jnp.sum(jnp.square(varying(a)), axis=axes)
  ratio = jnp.sum(jnp.square(error_BxTxF), axis=axes) / jnp.where(energy > 0, energy, 1.0)
  return jnp.sum(jnp.where(energy > 0, ratio, 0.0)) / jnp.maximum(jnp.sum(energy > 0), 1)


def check_measurable(pipe):
  """ValueError for AQ-SGD: its rows are training examples, which an evaluation batch is not."""
  if pipe.boundary.fwd.keyed_by_example:
    raise ValueError(f"boundary_error sends an evaluation batch, which has no rows in AQ-SGD's per-example table; "
                     f"measure a scheme without one (got {pipe.boundary.fwd!r})")


def make_measure(pipe):
  """jit-compiled (params, model_state, links, batch, key) -> per-boundary errors, per-stage cosines and the
  messages' inputs; `links` are the run's LinkStates (their batch-slot rows: one microbatch)."""
  check_measurable(pipe)
  last = pipe.num_stages - 1

  def apply(s, p, ms, x):
    return pipe.stages[s].apply(p, ms, x, train=False, rng=jax.random.key(0))[0]

  def loss_of(out, batch):
    return pipe.loss_fn(out, batch)[0]

  def exact_grads(params, model_state, batch):
    def loss(params):
      x = batch[pipe.input_key]
      for s in range(pipe.num_stages):
        x = apply(s, params[s], model_state[s], x)
      return loss_of(x, batch)
    return jax.grad(loss)(params)

  def state_size(link, a):
    """||e||^2 / ||a||^2 of an EF-family sender's state (0 for a stateless one)."""
    arrays = jax.tree.leaves(link.fwd_send)
    return sum(jnp.sum(jnp.square(t)) for t in arrays) / jnp.sum(jnp.square(a.astype(jnp.float32))) if arrays \
        else jnp.zeros(())

  def measure(params, model_state, links, batch, key):
    x, stage_vjps, link_vjps, acts = batch[pipe.input_key], [], [], []
    fwd_err, fwd_varying, fwd_channel, state = [], [], [], []
    for s in range(pipe.num_stages):
      if s == 0:
        out, vjp = jax.vjp(lambda p, x=x: apply(0, p, model_state[0], x), params[0])
      else:
        out, vjp = jax.vjp(lambda p, x, s=s: apply(s, p, model_state[s], x), params[s], x)
      stage_vjps.append(vjp)
      if s == last:
        break
      link_key = jax.random.fold_in(key, s)
      sent, link_vjp = jax.vjp(lambda a, s=s: pipe.boundary(a, links[s], link_key, Mode.TRAIN)[0], out)
      error_BxTxF = sent.astype(jnp.float32) - out.astype(jnp.float32)
      error = jnp.sum(jnp.square(error_BxTxF))
      fwd_err.append(error / jnp.sum(jnp.square(out.astype(jnp.float32))))
      fwd_varying.append(error / jnp.sum(jnp.square(varying(out))))
      fwd_channel.append(channel_varying_error(error_BxTxF, out))
      state.append(state_size(links[s], out))
      acts.append(out)
      link_vjps.append(link_vjp)
      x = sent
    g = jax.grad(loss_of)(out, batch)
    grads, bwd_err, grad_msgs = [None] * pipe.num_stages, [None] * last, [None] * last
    for s in range(last, -1, -1):
      if s == 0:
        (grads[0],) = stage_vjps[0](g)
        break
      grads[s], dx = stage_vjps[s](g)
      (g,) = link_vjps[s - 1](dx)
      bwd_err[s - 1] = _relative(g, dx)
      grad_msgs[s - 1] = dx
    exact = exact_grads(params, model_state, batch)
    return {"fwd": jnp.stack(fwd_err), "fwd_varying": jnp.stack(fwd_varying),
            "fwd_channel": jnp.stack(fwd_channel), "bwd": jnp.stack(bwd_err),
            "state": jnp.stack(state), "grad_cos": jnp.stack([_cosine(a, b) for a, b in zip(grads, exact)]),
            "activations": acts, "gradients": grad_msgs}

  return jax.jit(measure)


COLUMNS = ("fwd", "fwd_varying", "fwd_channel", "bwd", "state", "grad_cos")


def main(argv=None):
  exp = gpt2_wikitext.EXPERIMENT
  parser = cli.parser_for(exp)
  parser.prog = "python -m experiments.boundary_error"
  parser.add_argument("--every", type=int, default=16, help="measure every N training steps (default: 16)")
  parser.add_argument("--save", type=pathlib.Path, help="write the last measurement's messages' inputs (.npz)")
  parser.add_argument("--json", type=pathlib.Path, help="write the measurements as JSON")
  args = parser.parse_args(argv)
  if args.every < 1:
    parser.error(f"--every must be at least 1, got {args.every}")
  own = ("every", "save", "json")
  cfg = config.resolve(exp, args.recipe, args.preset, **{k: v for k, v in cli.flags_of(args).items() if k not in own})
  if not isinstance(config.executor_config(cfg.executor), executors.SimulateConfig) or cfg.executor.microbatches != 1:
    parser.error("boundary_error runs the simulate executor with one microbatch")
  if cfg.data.eval_examples is not None and cfg.training.batch_size > cfg.data.eval_examples:
    parser.error("the probe is the first evaluation batch: give --eval-examples >= --batch-size")
  pipe, optimizer, data, params = exp.build(cfg)
  measure = make_measure(pipe)
  executor = simulate.Simulate()
  state = executor.init_state(pipe, optimizer, jax.random.key(cfg.training.seed), data.example_batch, params)
  steps = {mode: executor.make_train_step(pipe, optimizer, mode) for mode in (Mode.TRAIN, Mode.WARMUP)}
  probe = next(iter(data.eval_batches()))
  probe_key = jax.random.key(cfg.training.seed + 1)
  total = cfg.training.steps or data.steps_per_epoch * cfg.training.epochs
  rows, losses, step, result = [], [], 0, None

  def record():
    nonlocal result
    result = measure(state.params, state.model_state, state.links, probe, probe_key)
    rows.append({"step": step, "train_loss": float(np.mean(losses)) if losses else None,
                 **{k: np.asarray(result[k]).tolist() for k in COLUMNS}})
    losses.clear()
    r = rows[-1]
    loss = "   -  " if r["train_loss"] is None else f"{r['train_loss']:.3f}"
    print(f"{step:5d} {loss}  " + "  ".join(" ".join(f"{v:{'+.3f' if k == 'grad_cos' else '.3g'}}" for v in r[k])
                                            for k in COLUMNS if k != "state" or any(r["state"])), flush=True)

  print(f"[boundary_error] fwd {cfg.compression.fwd}, bwd {cfg.compression.bwd}, seed {cfg.training.seed}; "
        f"data = {data.name}")
  print(f"{'step':>5s} {'loss':6s}  per boundary: fwd ||C(a)-a||^2/||a||^2; fwd ||C(a)-a||^2/||a-a_bar||^2; "
        "fwd the same per channel, mean over channels; "
        "bwd ||C(g)-g||^2/||g||^2; [EF state ||e||^2/||a||^2]; per stage: cos(weight grad, exact)")
  record()
  for epoch in range(cfg.training.epochs):
    mode = Mode.WARMUP if epoch < cfg.compression.warmup_epochs else Mode.TRAIN
    for batch in data.train_batches(epoch):
      if step >= total:
        break
      state, metrics = steps[mode](state, batch)
      losses.append(float(metrics["loss"]))
      step += 1
      if step % args.every == 0 or step == total:
        record()
  if args.json:
    given = {k: v for k, v in cfg.record().items() if isinstance(v, (int, float, str))}
    args.json.write_text(json.dumps({"config": given, "rows": rows}, indent=1))
  if args.save:
    np.savez(args.save, **{f"fwd_{b}": np.asarray(a) for b, a in enumerate(result["activations"])},
             **{f"bwd_{b}": np.asarray(g) for b, g in enumerate(result["gradients"])})
  return rows


if __name__ == "__main__":
  try:
    main()
  except ValueError as err:
    sys.exit(f"error: {err}")
