"""Deterministic epoch iteration shared by every dataset.

The order of epoch e is a permutation drawn from (seed, e) alone, so a resumed run sees
exactly the batches an uninterrupted one would. Every batch carries "id": the example's
index in its split (AQ-SGD keys its per-example buffers by it).
"""
from typing import Callable, Iterator

import numpy as np


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
  return np.random.default_rng([seed, epoch]).permutation(n)


def iterate(arrays: dict[str, np.ndarray], batch_size: int, seed: int, epoch: int, shuffle: bool = True,
            transform: Callable[[dict, np.random.Generator], dict] | None = None) -> Iterator[dict]:
  """Batches of `batch_size` (the last partial batch is dropped: state tables need a fixed B)."""
  n = len(next(iter(arrays.values())))
  if not 1 <= batch_size <= n:
    raise ValueError(f"batch_size must be in 1..{n} (the split's size), got {batch_size}")
  order = epoch_order(n, seed, epoch) if shuffle else np.arange(n)
  rng = np.random.default_rng([seed, epoch, 1])
  for start in range(0, n - batch_size + 1, batch_size):
    idx = order[start: start + batch_size]
    batch = {k: v[idx] for k, v in arrays.items()}
    batch["id"] = idx.astype(np.int32)
    yield transform(batch, rng) if transform else batch


def num_batches(n: int, batch_size: int) -> int:
  return n // batch_size
