"""AQ-SGD's buffer against the activation it stands for, epoch by epoch: where the buffer pays.

    python -m benchmarks.aqsgd_drift                                # the frontier budget, aqsgd fw2-bw4
    python -m benchmarks.aqsgd_drift --fwd aqsgd+maxabs:2:stoch:grid=zero:clip=1 --dropout 0 --lr 3e-3
    python -m benchmarks.aqsgd_drift --init-from runs/gpt2_wikitext/baseline --init-epoch 6 --epochs 12 \
        --warmup-epochs 7 --lr 1e-4

Trains GPT-2 as `experiments.gpt2_wikitext` would with the given flags (default: the frontier's
budget, 256 blocks x 6 epochs, batch 8, one dense warm-up epoch, `aqsgd+maxabs:2:stoch` /
`maxabs:4:stoch`; `--init-from/--init-epoch N` warm-start the model, not the buffers, and the
run goes on from epoch N: `--epochs` and `--warmup-epochs` count from the baseline's start) on the
simulate executor, and after every epoch probes the first training batch. Per boundary, with
a the activation stage b sends on that batch's next visit (the dense pipeline with the
current weights, a fresh dropout draw) and m = m(xi) the buffer row:
  drift       ||a - m|| / ||a||           how far the buffer lags (= ||delta|| / ||a||)
  dropout     ||a - a'|| / ||a||          a' another dropout draw: the floor of drift
  aq error    ||C(a - m) - (a - m)|| / ||a||   what stage b+1 would get wrong after this visit
  direct err  ||C(a) - a|| / ||a||        the same for direct compression of a
  zero codes  fraction of C(a - m) entries that decode to exactly 0
  fp16        ||fp16(a) - a|| / ||a||     the buffer's own rounding
The buffer pays where aq error < direct err. Values are means over the boundaries (the
per-boundary ones go to --json). Prints one markdown row per epoch.
"""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from experiments import cli, config, gpt2_wikitext
from jaxcomp.compress.boundary import Mode
from jaxcomp.compress.schemes import AQSGD
from jaxcomp.parallel import executors
from jaxcomp.runtime import train

DEFAULTS = dict(fwd="aqsgd+maxabs:2:stoch", bwd="maxabs:4:stoch", warmup_epochs=1, epochs=6, batch_size=8,
                train_examples=256, eval_examples=128)  # under the flags given
COLUMNS = ("drift", "dropout", "aq error", "direct err", "zero codes", "fp16")


def boundary_activations(pipe, state, tokens, rng):
  """The activation at every boundary of the dense pipeline (training mode: dropout drawn from rng)."""
  x, acts = tokens, []
  for s, stage in enumerate(pipe.stages[:-1]):
    x, _ = stage.apply(state.params[s], state.model_state[s], x, train=True, rng=jax.random.fold_in(rng, s))
    acts.append(x)
  return acts


def probe(pipe, state, batch, rng):
  """{column: [value per boundary]} on one batch (see the module doc)."""
  codec, ids = pipe.boundary.fwd.codec, jnp.asarray(batch["id"])
  norm = lambda v: float(jnp.linalg.norm(v.astype(jnp.float32)))
  now = boundary_activations(pipe, state, batch[pipe.input_key], rng)
  again = boundary_activations(pipe, state, batch[pipe.input_key], jax.random.fold_in(rng, 99))
  out = {c: [] for c in COLUMNS}
  for b, (a, a2) in enumerate(zip(now, again)):
    m = state.links[b].fwd_send.buffer[ids].astype(jnp.float32)
    delta = a - m
    key = jax.random.fold_in(rng, 1000 + b)
    sent = codec(delta, key)
    out["drift"].append(norm(delta) / norm(a))
    out["dropout"].append(norm(a - a2) / norm(a))
    out["aq error"].append(norm(sent - delta) / norm(a))
    out["direct err"].append(norm(codec(a, key) - a) / norm(a))
    out["zero codes"].append(float(jnp.mean(sent == 0)))
    out["fp16"].append(norm(a.astype(jnp.float16).astype(jnp.float32) - a) / norm(a))
  return out


def main(argv=None):
  exp = gpt2_wikitext.EXPERIMENT
  parser = cli.parser_for(exp)
  parser.add_argument("--buffer-dtype", default="float16", help="AQ-SGD buffer dtype (float16 as the paper, float32)")
  parser.add_argument("--json", help="write every epoch's per-boundary values here")
  args = parser.parse_args(argv)
  given = {k: v for k, v in cli.flags_of(args).items() if k not in ("buffer_dtype", "json") and v not in (None, False)}
  run = config.resolve(exp, args.recipe, args.preset, **{**DEFAULTS, **given})
  if not isinstance(config.executor_config(run.executor), executors.SimulateConfig):
    raise SystemExit("error: the probe reads the simulate executor's on-device tables; leave --executor and "
                     "--aqsgd-buffers at their defaults")
  pipe, optimizer, data, params = exp.build(run)
  if not isinstance(pipe.boundary.fwd, AQSGD):
    raise SystemExit(f"error: --fwd {run.compression.fwd!r} keeps no AQ-SGD buffer; use an aqsgd+ spec")
  pipe = dataclasses.replace(pipe, boundary=dataclasses.replace(
      pipe.boundary, fwd=dataclasses.replace(pipe.boundary.fwd, buffer_dtype=args.buffer_dtype)))
  executor = config.executor_for(run.executor)
  state, start = executor.init_state(pipe, optimizer, jax.random.key(run.training.seed), data.example_batch, params), 0
  if run.training.init_epoch:  # epochs (and --warmup-epochs) count on from the baseline's, as in train.fit
    state, start = train.warm_start(state, f"{run.training.init_from}/ckpt", run.training.init_epoch)
  probe_batch = next(iter(data.train_batches(0)))
  eval_step = executor.make_eval_step(pipe, compressed=False)
  steps, records, done = {}, [], 0
  dropout = run.options.dropout
  print(f"{run.compression.fwd} / {run.compression.bwd}, lr {run.training.lr}, buffers {args.buffer_dtype}, "
        f"dropout {'model default' if dropout is None else dropout}, seed {run.training.seed}; {data.name}\n")
  print("| epoch | mode | train loss | eval loss (off) | " + " | ".join(COLUMNS) + " |")
  print("|---:|---|---:|---:|" + "---:|" * len(COLUMNS))
  for epoch in range(start, run.training.epochs):
    mode = Mode.WARMUP if epoch < run.compression.warmup_epochs else Mode.TRAIN
    steps.setdefault(mode, executor.make_train_step(pipe, optimizer, mode))
    losses = []
    for batch in data.train_batches(epoch):
      if run.training.steps is not None and done >= run.training.steps:
        break
      state, metrics = steps[mode](state, batch)
      losses.append(float(metrics["loss"]))
      done += 1
    evals = [eval_step(state, b) for b in data.eval_batches()]
    values = probe(pipe, state, probe_batch, jax.random.fold_in(jax.random.key(7), epoch))
    records.append({"epoch": epoch + 1, "mode": mode.value, "train_loss": float(np.mean(losses)),
                    "eval_off": float(np.mean([float(e["loss"]) for e in evals])), **values})
    r = records[-1]
    print(f"| {epoch + 1} | {mode.value} | {r['train_loss']:.4f} | {r['eval_off']:.4f} | "
          + " | ".join(f"{np.mean(r[c]):.4f}" for c in COLUMNS) + " |", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"config": {k: v for k, v in run.record().items() if isinstance(v, (int, float, str, type(None)))},
                 "buffer_dtype": args.buffer_dtype, "epochs": records}, f, indent=1)
  return records


if __name__ == "__main__":
  main()
