"""TopK selection and the topk codec: threshold vs `lax.top_k` vs `approx_max_k` vs NumPy, one run.

`python -m benchmarks.topk_selection [--shape 8,98304] [--repeats 7]`
Per row of F features, k = K*F entries of largest |x|. Table 1: selection alone (positions
of the k entries): threshold (`jaxcomp.compress.selection`), `lax.top_k`, `lax.approx_max_k`, NumPy
`argpartition` on the host, and an inexact sampled threshold (|x| >= a sample quantile; its
count varies); recall = fraction of the exact set returned, kept/k = entries kept per k. Table 2:
the topk codec's encode+decode with each `select=`, and the path before this change
(`lax.top_k` + per-row `jnp.nonzero` mask decode). Every method is timed in interleaved
rounds (machine drift hits all alike); each figure is the median over rounds.
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import median_seconds
from jaxcomp.compress import codecs, packing, selection


def numpy_argpartition(a, k):
  """Host selection of the same rows: indices of the k largest |x| per row (unordered)."""
  return np.argpartition(-np.abs(a), k - 1, axis=1)[:, :k]


def before_this_change(codec: codecs.TopK):
  """encode+decode as it was: lax.top_k, sorted positions, mask decoded with a per-row nonzero."""
  def round_trip(x):
    r, f = x.shape[0], x[0].size
    x_RxF = x.reshape(r, f)
    k = codec.k(x.shape)
    idx = jnp.sort(jax.lax.top_k(jnp.abs(x_RxF), k)[1], axis=1)
    rows = jnp.arange(r)[:, None]
    packed = packing.pack_mask(jnp.zeros((r, f), bool).at[rows, idx].set(True))
    values = jnp.take_along_axis(x_RxF, idx, axis=1)
    mask = packing.unpack_mask(packed, f)
    got = jax.vmap(lambda m: jnp.nonzero(m, size=k, fill_value=0)[0])(mask)
    return jnp.zeros((r, f), x.dtype).at[rows, got].set(values).reshape(x.shape)
  return round_trip


def sampled_threshold_mask(a, k, key, samples=4096):
  """Keep |x| >= the (1 - k/F) quantile of a random sample of each row (not exactly k)."""
  a = jnp.abs(a)
  idx = jax.random.randint(key, (a.shape[0], samples), 0, a.shape[1])
  t = jnp.quantile(jnp.take_along_axis(a, idx, axis=1), 1 - k / a.shape[1], axis=1, keepdims=True)
  return a >= t


def host_seconds(fn, *args, repeats):
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn(*args)
    times.append(time.perf_counter() - start)
  return sorted(times)[len(times) // 2]


def interleaved(methods, rounds):
  """Median over rounds of each method's median-of-3 time; methods alternate within a round."""
  samples = {name: [] for name in methods}
  for _ in range(rounds):
    for name, run in methods.items():
      samples[name].append(run())
  return {name: sorted(v)[len(v) // 2] for name, v in samples.items()}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", default="8,98304", help="rows,features (GPT-2 small example: 8,786432)")
  parser.add_argument("--fractions", default="0.1,0.01")
  parser.add_argument("--repeats", type=int, default=7, help="interleaved rounds")
  args = parser.parse_args(argv)
  rows, f = (int(s) for s in args.shape.split(","))
  x = jax.random.normal(jax.random.key(0), (rows, f))
  x_host = np.asarray(x)
  print(f"device: {jax.devices()[0].device_kind}; x of shape [{rows}, {f}] fp32; {args.repeats} interleaved rounds\n")
  selection_rows, codec_rows = [], []
  for fraction in (float(s) for s in args.fractions.split(",")):
    k = codecs.TopK(fraction).k(x.shape)
    truth = np.asarray(jax.lax.top_k(jnp.abs(x), k)[1])
    truth_mask = np.zeros((rows, f), bool)
    truth_mask[np.arange(rows)[:, None], truth] = True
    jitted = {name: jax.jit(lambda x, name=name: selection.top_k_positions(x, k, name)) for name in selection.SELECTORS}
    methods = {f"jaxcomp {name}": (lambda fn=fn: median_seconds(fn, x, repeats=3, warmup=1)) for name, fn in jitted.items()}
    methods["NumPy argpartition"] = lambda: host_seconds(numpy_argpartition, x_host, k, repeats=3)
    sampled = jax.jit(lambda x: sampled_threshold_mask(x, k, jax.random.key(1)))
    methods["sampled threshold"] = lambda: median_seconds(sampled, x, repeats=3, warmup=1)
    sel_times = interleaved(methods, args.repeats)
    outputs = {**{f"jaxcomp {n}": np.asarray(fn(x)) for n, fn in jitted.items()},
               "NumPy argpartition": numpy_argpartition(x_host, k), "sampled threshold": np.asarray(sampled(x))}
    for name, t in sel_times.items():
      mask = outputs[name]
      if mask.dtype != bool:
        mask = np.zeros((rows, f), bool)
        mask[np.arange(rows)[:, None], outputs[name]] = True
      recall = (mask & truth_mask).sum() / truth_mask.sum()
      selection_rows.append((fraction, name, t, recall, mask.sum() / truth_mask.sum(), t / sel_times["NumPy argpartition"]))

    codec_fns = {f"topk:{fraction}:{s}": jax.jit(codecs.TopK(fraction, select=s)) for s in selection.SELECTORS}
    codec_fns["before (lax.top_k + nonzero decode)"] = jax.jit(before_this_change(codecs.TopK(fraction)))
    runs = {name: (lambda fn=fn: median_seconds(fn, x, repeats=3, warmup=1)) for name, fn in codec_fns.items()}
    runs["NumPy argpartition (selection only)"] = lambda: host_seconds(numpy_argpartition, x_host, k, repeats=3)
    times = interleaved(runs, args.repeats)
    reference = np.asarray(codec_fns["before (lax.top_k + nonzero decode)"](x))
    for name, t in times.items():
      same = "" if name.startswith("NumPy") else ("yes" if np.array_equal(np.asarray(codec_fns[name](x)), reference) else "NO")
      codec_rows.append((fraction, name, t, t / times["before (lax.top_k + nonzero decode)"],
                         t / times["NumPy argpartition (selection only)"], same))

  print("Selection (positions of the k largest |x| per row):\n")
  print("| K | method | ms | recall | kept/k | / argpartition |")
  print("|---|---|---:|---:|---:|---:|")
  for fraction, name, t, recall, kept, ratio in selection_rows:
    print(f"| {fraction * 100:g}% | {name} | {t * 1e3:.2f} | {recall:.4f} | {kept:.3f} | {ratio:.2f} |")
  print("\nCodec encode+decode (jit, round trip C(x)):\n")
  print("| K | path | ms | / before | / argpartition | same output as before |")
  print("|---|---|---:|---:|---:|---|")
  for fraction, name, t, before, argp, same in codec_rows:
    print(f"| {fraction * 100:g}% | {name} | {t * 1e3:.2f} | {before:.3f} | {argp:.2f} | {same} |")


if __name__ == "__main__":
  main()
