"""TopK selection: exact `lax.top_k` vs `lax.approx_max_k` vs a sampled threshold.

`python -m benchmarks.topk_selection [--shape 8,131072] [--repeats 10]`
Per row of F features, k = K*F entries of largest |x|. Recall = fraction of the exact
top-k set a method returns; "kept/k" = how many entries it keeps (the threshold method's
count varies, so it does not give the exact-count guarantee the library's TopK keeps).
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import median_seconds


def exact(a, k):
  return jax.lax.top_k(a, k)[1]


def approx(a, k):
  return jax.lax.approx_max_k(a, k, recall_target=0.95)[1]


def threshold_mask(a, k, key, samples=4096):
  """Keep |x| >= the (1 - k/F) quantile of a random sample of each row."""
  f = a.shape[1]
  idx = jax.random.randint(key, (a.shape[0], samples), 0, f)
  sample = jnp.take_along_axis(a, idx, axis=1)
  t = jnp.quantile(sample, 1 - k / f, axis=1, keepdims=True)
  return a >= t


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", default="8,98304", help="rows,features (GPT-2 small example: 8,786432)")
  parser.add_argument("--repeats", type=int, default=10)
  args = parser.parse_args(argv)
  rows, f = (int(s) for s in args.shape.split(","))
  a = jnp.abs(jax.random.normal(jax.random.key(0), (rows, f)))
  print(f"device: {jax.devices()[0].device_kind}; |x| of shape [{rows}, {f}]\n")
  print("| K | method | ms | recall | kept/k |")
  print("|---|---|---:|---:|---:|")
  key = jax.random.key(1)
  for fraction in (0.1, 0.01):
    k = max(1, int(round(fraction * f)))
    truth = np.asarray(jax.jit(exact, static_argnums=1)(a, k))
    truth_mask = np.zeros((rows, f), bool)
    truth_mask[np.arange(rows)[:, None], truth] = True
    methods = {"exact lax.top_k": lambda a: exact(a, k), "lax.approx_max_k (0.95)": lambda a: approx(a, k),
               "sampled threshold": lambda a: threshold_mask(a, k, key)}
    for name, fn in methods.items():
      jitted = jax.jit(fn)
      t = median_seconds(jitted, a, repeats=args.repeats)
      out = np.asarray(jitted(a))
      mask = out if out.dtype == bool else np.zeros((rows, f), bool)
      if out.dtype != bool:
        mask[np.arange(rows)[:, None], out] = True
      recall = (mask & truth_mask).sum() / truth_mask.sum()
      print(f"| {fraction:.0%} | {name} | {t * 1e3:.2f} | {recall:.4f} | {mask.sum() / truth_mask.sum():.3f} |")


if __name__ == "__main__":
  main()
