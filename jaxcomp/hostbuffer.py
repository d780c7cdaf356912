"""AQ-SGD buffers in host memory (or a memory-mapped file) instead of on the device.

The per-example tables m(xi) of every boundary live on the host; the device only ever holds
the B rows of the current batch. The pipeline is built with `AQSGD(num_examples=B)` and each
batch's "id" remapped to 0..B-1, so the step does exactly the arithmetic of the on-device
table (tests check bitwise equality). Sender and receiver mirrors are bitwise identical by
construction (same update from the same payload), so one host copy per boundary serves
both ends when they share a process.

Prefetch: while the device runs step t, a thread gathers step t+1's rows; after step t's
rows are written back, rows of examples that appear in both batches are patched with the
fresh values (the read-after-write hazard), so the prefetched rows are never stale.
"""
import concurrent.futures
import os
import pathlib
import shutil

import numpy as np

from jaxcomp.feedback import AQSGDState


def memory_estimate(num_examples: int, row_shapes, dtype=np.float16) -> int:
  """Bytes of one table per boundary: N x prod(row) x itemsize, summed."""
  return sum(num_examples * int(np.prod(r)) * np.dtype(dtype).itemsize for r in row_shapes)


class HostTables:
  """One [N, *row] table per boundary in RAM, or memory-mapped under `directory`."""

  def __init__(self, num_examples: int, row_shapes, dtype=np.float16, directory=None, available=None):
    self.dtype = np.dtype(dtype)
    need = memory_estimate(num_examples, row_shapes, dtype)
    if directory is None:
      where = "host memory"
      free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") if available is None else available
    else:
      pathlib.Path(directory).mkdir(parents=True, exist_ok=True)
      where = f"disk at {directory}"
      free = shutil.disk_usage(directory).free if available is None else available
    self.summary = (f"AQ-SGD host buffers: {len(row_shapes)} boundaries x {num_examples} examples x "
                    f"rows {[tuple(r) for r in row_shapes]} {self.dtype.name} = {need / 2**30:.3f} GiB "
                    f"in {where} ({free / 2**30:.2f} GiB free)")
    if need > free:
      raise ValueError(f"{self.summary}: does not fit; use a memmap directory with more space, fewer examples "
                       "or a smaller dtype")
    if directory is None:
      self.tables = [np.zeros((num_examples, *r), self.dtype) for r in row_shapes]
    else:
      self.tables = [np.lib.format.open_memmap(str(pathlib.Path(directory) / f"boundary{b}.npy"), mode="w+",
                                               dtype=self.dtype, shape=(num_examples, *r))
                     for b, r in enumerate(row_shapes)]

  def gather(self, ids) -> list[np.ndarray]:
    return [t[ids] for t in self.tables]

  def scatter(self, ids, rows):
    for t, r in zip(self.tables, rows):
      t[ids] = r


def _device_rows(state) -> list[np.ndarray]:
  return [np.asarray(link.fwd_send.buffer) for link in state.links]


def _with_rows(state, rows):
  links = tuple(link._replace(fwd_send=AQSGDState(r), fwd_recv=AQSGDState(r)) for link, r in zip(state.links, rows))
  return state._replace(links=links)


class HostBufferedStep:
  """Wraps a (simulate-layout) train step so AQ-SGD rows come from and go back to `tables`."""

  def __init__(self, step, tables: HostTables, prefetch: bool = True):
    self.step, self.tables, self.prefetch = step, tables, prefetch
    self.pool = concurrent.futures.ThreadPoolExecutor(1) if prefetch else None
    self.pending = None  # (ids, rows) gathered ahead for the next batch

  def __call__(self, state, batch, next_ids=None):
    ids = np.asarray(batch["id"])
    if self.pending is not None and np.array_equal(self.pending[0], ids):
      rows = self.pending[1]
    else:
      rows = self.tables.gather(ids)
    local = {**batch, "id": np.arange(len(ids), dtype=np.int32)}
    state, metrics = self.step(_with_rows(state, rows), local)  # dispatched; runs on the device
    future = self.pool.submit(self.tables.gather, next_ids) if self.prefetch and next_ids is not None else None
    new_rows = _device_rows(state)  # waits for the step
    self.tables.scatter(ids, new_rows)
    self.pending = None
    if future is not None:
      ahead = future.result()
      position = {int(e): j for j, e in enumerate(ids)}
      for j, e in enumerate(np.asarray(next_ids)):
        if int(e) in position:  # written by this step after the prefetch read it
          for a, r in zip(ahead, new_rows):
            a[j] = r[position[int(e)]]
      self.pending = (np.asarray(next_ids), ahead)
    return state, metrics

  def close(self):
    if self.pool:
      self.pool.shutdown()
