"""Example-to-shard assignment: each example stays on one data shard in every epoch."""
import numpy as np
import pytest

from jaxcomp.data import batching


def _ids(epoch, shards, n=50, batch_size=8, seed=3):
  return [b["id"] for b in batching.iterate({"x": np.arange(n)}, batch_size, seed, epoch, shards=shards)]


@pytest.mark.parametrize("shards", [2, 4])
def test_every_example_stays_on_its_shard_every_epoch(shards):
  local = 8 // shards
  seen = [set() for _ in range(shards)]
  for epoch in range(4):
    batches = _ids(epoch, shards)
    assert len(batches) == batching.num_batches(50, 8, shards)
    epoch_ids = np.concatenate(batches)
    assert len(set(epoch_ids.tolist())) == len(epoch_ids)  # no repeats within an epoch
    for batch in batches:
      for d in range(shards):  # the global batch is the shards' local batches in shard order
        part = batch[d * local: (d + 1) * local]
        np.testing.assert_array_equal(batching.shard_of(part, shards), d)
        seen[d].update(part.tolist())
  for d in range(shards):
    assert seen[d] and all(i % shards == d for i in seen[d])


def test_shards_are_shuffled_per_epoch_and_one_shard_is_the_plain_order():
  assert not all(np.array_equal(a, b) for a, b in zip(_ids(1, 2), _ids(2, 2)))
  order = batching.epoch_order(50, 3, 1)
  np.testing.assert_array_equal(np.concatenate(_ids(1, 1)), order[:48])


def test_batch_must_split_over_shards():
  with pytest.raises(ValueError, match="batch_size 6 must split evenly over 4 data shards"):
    next(batching.iterate({"x": np.arange(50)}, 6, 0, 0, shards=4))
