"""Timing of jit-compiled functions: warm-up first, then the median of synchronised runs."""
import time

import jax


def median_seconds(fn, *args, repeats: int = 10, warmup: int = 2) -> float:
  """Median wall time of fn(*args) with every output ready (device work included)."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return sorted(times)[len(times) // 2]
