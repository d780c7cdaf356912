"""Deterministic epoch iteration shared by every dataset.

The order of epoch e is a permutation drawn from (seed, e) alone, so a resumed run sees
exactly the batches an uninterrupted one would. Every batch carries "id": the example's
index in its split (AQ-SGD keys its per-example buffers by it).

Data parallelism over D shards: example i belongs to shard i mod D in every epoch (AQ-SGD
keeps its buffer on that shard), and each shard visits its own examples in the order they
take in the epoch's permutation. Global batch k is the concatenation, in shard order, of the
D shards' k-th local batches of B/D examples; D = 1 is the plain shuffled order.
"""
from typing import Callable, Iterator

import numpy as np

from jaxcomp.pipeline import example_shard


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
  return np.random.default_rng([seed, epoch]).permutation(n)


def shard_of(ids: np.ndarray, shards: int) -> np.ndarray:
  """The data shard that processes each example (the same in every epoch)."""
  return example_shard(np.asarray(ids), shards)


def shard_orders(order: np.ndarray, shards: int) -> list[np.ndarray]:
  """`order` split into each shard's examples, keeping their relative order."""
  owner = shard_of(order, shards)
  return [order[owner == d] for d in range(shards)]


def num_batches(n: int, batch_size: int, shards: int = 1) -> int:
  """Full global batches per epoch: every shard fills its B/D slots (the rest is dropped)."""
  return (n // shards) // (batch_size // shards)


def iterate(arrays: dict[str, np.ndarray], batch_size: int, seed: int, epoch: int, shuffle: bool = True,
            transform: Callable[[dict, np.random.Generator], dict] | None = None,
            shards: int = 1) -> Iterator[dict]:
  """Global batches of `batch_size` over `shards` data shards (see the module docstring).

  Partial batches are dropped: state tables need a fixed B.
  """
  n = len(next(iter(arrays.values())))
  if shards < 1 or batch_size % shards:
    raise ValueError(f"batch_size {batch_size} must split evenly over {shards} data shards; "
                     f"use a batch size that is a multiple of {shards}")
  if not shards <= batch_size <= n:
    raise ValueError(f"batch_size must be in {shards}..{n} (the split's size), got {batch_size}")
  order = epoch_order(n, seed, epoch) if shuffle else np.arange(n)
  per_shard, local = shard_orders(order, shards), batch_size // shards
  rng = np.random.default_rng([seed, epoch, 1])
  for k in range(num_batches(n, batch_size, shards)):
    idx = np.concatenate([o[k * local: (k + 1) * local] for o in per_shard])
    batch = {key: v[idx] for key, v in arrays.items()}
    batch["id"] = idx.astype(np.int32)
    yield transform(batch, rng) if transform else batch
