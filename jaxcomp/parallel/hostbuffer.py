"""AQ-SGD's per-example tables: their memory need, and keeping them in host memory or a memory-mapped file.

Each boundary's table m(xi) has N rows (one per training example) of the boundary
activation's shape: N x prod(row) x itemsize bytes per boundary, twice on the device
(sender and receiver end), once on the host.

On the host the device only ever holds the B rows of the current batch. The pipeline is run
with `AQSGD(num_examples=B)` and each batch's "id" remapped to 0..B-1, so the step does
exactly the arithmetic of the on-device table (tests check bitwise equality). Sender and
receiver mirrors are bitwise identical by construction (same update from the same payload),
so one host copy per boundary serves both ends when they share a process.

Prefetch: while the device runs step t, a thread gathers step t+1's rows; after step t's
rows are written back, rows of examples that appear in both batches are patched with the
fresh values (the read-after-write hazard), so the prefetched rows are never stale.
"""
import concurrent.futures
import dataclasses
import pathlib
import shutil

import jax
import numpy as np
import optax

from jaxcomp import pipeline
from jaxcomp.compress.boundary import Mode
from jaxcomp.compress.schemes import AQSGD, AQSGDState
from jaxcomp.parallel import memory, simulate


def memory_estimate(num_examples: int, row_shapes, dtype=np.float16) -> int:
  """Bytes of one table per boundary: N x prod(row) x itemsize, summed."""
  return sum(num_examples * int(np.prod(r)) * np.dtype(dtype).itemsize for r in row_shapes)


def summary(where: str, num_examples: int, row_shapes, dtype, free: int, ends: int = 1) -> str:
  """One line: where the tables live, boundaries x examples x row x dtype [x ends] = size, free space there."""
  shapes = {tuple(r) for r in row_shapes}
  rows = shapes.pop() if len(shapes) == 1 else [tuple(r) for r in row_shapes]
  need = ends * memory_estimate(num_examples, row_shapes, dtype)
  copies = f" x {ends} ends" if ends > 1 else ""
  return (f"AQ-SGD tables {where}: {len(row_shapes)} boundaries x {num_examples} examples x {rows} "
          f"{np.dtype(dtype).name}{copies} = {need / 2**30:.3g} GiB ({free / 2**30:.3g} GiB free)")


def _aqsgd(pipe: pipeline.Pipeline) -> AQSGD:
  if not isinstance(pipe.boundary.fwd, AQSGD):
    raise ValueError(f"AQ-SGD tables need an AQ-SGD forward scheme, got {pipe.boundary.fwd!r}")
  return pipe.boundary.fwd


def device_pipeline(pipe: pipeline.Pipeline, batch_size: int) -> pipeline.Pipeline:
  """`pipe` with AQ-SGD tables of one batch's rows (what runs on the device)."""
  small = dataclasses.replace(_aqsgd(pipe), num_examples=batch_size)
  return dataclasses.replace(pipe, boundary=dataclasses.replace(pipe.boundary, fwd=small))


def table_rows(pipe: pipeline.Pipeline, batch) -> list[tuple]:
  """Row shape of each boundary's table (one example's activation), traced abstractly: nothing is allocated."""
  return [s.shape[1:] for s in pipeline.activation_shapes(pipe, batch)]


def device_summary(pipe: pipeline.Pipeline, batch) -> str:
  """The `summary` line of on-device tables: both ends of every boundary, as memory.check_aqsgd_memory counts."""
  fwd = _aqsgd(pipe)
  return summary(f"on device ({jax.devices()[0].platform})", fwd.num_examples, table_rows(pipe, batch),
                 fwd.buffer_dtype, memory.available_memory_bytes(), ends=2)


def free_bytes(directory=None) -> int:
  """Free host RAM, or free disk space where `directory` is (or would be created)."""
  if directory is None:
    return memory.free_host_bytes()
  existing = pathlib.Path(directory).absolute()
  while not existing.exists():
    existing = existing.parent
  return shutil.disk_usage(existing).free


def _table_path(directory, boundary: int) -> pathlib.Path:
  return pathlib.Path(directory) / f"boundary{boundary}.npy"


class HostTables:
  """One [N, *row] table per boundary in RAM, or memory-mapped under `directory` (new, zeroed tables).

  Raises a ValueError naming the sizes, before anything is allocated or created, when they do not fit.
  """

  def __init__(self, num_examples: int, row_shapes, dtype=np.float16, directory=None, available=None):
    self.dtype = np.dtype(dtype)
    free = free_bytes(directory) if available is None else available
    if directory is not None:  # tables about to be replaced free their space
      free += sum(_table_path(directory, b).stat().st_blocks * 512 for b in range(len(row_shapes))
                  if _table_path(directory, b).exists())
    where = "in host memory" if directory is None else f"on disk at {directory}"
    self.summary = summary(where, num_examples, row_shapes, self.dtype, free)
    if memory_estimate(num_examples, row_shapes, self.dtype) > free:
      raise ValueError(f"{self.summary}: does not fit; use a memmap directory with more space, fewer examples "
                       "or a smaller dtype")
    if directory is None:
      self.tables = [np.zeros((num_examples, *r), self.dtype) for r in row_shapes]
    else:
      pathlib.Path(directory).mkdir(parents=True, exist_ok=True)
      self.tables = [np.lib.format.open_memmap(str(_table_path(directory, b)), mode="w+", dtype=self.dtype,
                                               shape=(num_examples, *r))
                     for b, r in enumerate(row_shapes)]

  @classmethod
  def for_pipeline(cls, pipe: pipeline.Pipeline, batch, directory=None) -> "HostTables":
    """New tables for `pipe`'s AQ-SGD boundaries and batches like `batch` (the size check first)."""
    fwd = _aqsgd(pipe)
    return cls(fwd.num_examples, table_rows(pipe, batch), fwd.buffer_dtype, directory)

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


PREFETCH_THREAD = "aqsgd-prefetch"  # the name of a HostBufferedStep's thread


class HostBufferedStep:
  """Wraps a (simulate-layout) train step so AQ-SGD rows come from and go back to `tables`.

  Called as step(state, batch, next_ids): `next_ids` (the next batch's "id", or None) are
  gathered ahead while the device runs, by a thread that `close` ends; `takes_next_ids` tells
  train.fit to pass them.
  """
  takes_next_ids = True

  def __init__(self, step, tables: HostTables, prefetch: bool = True):
    self.step, self.tables, self.prefetch = step, tables, prefetch
    self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=PREFETCH_THREAD) if prefetch else None
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
    """Ends the prefetch thread (`train.fit` calls it when a run ends)."""
    if self.pool:
      self.pool.shutdown()


@dataclasses.dataclass(frozen=True)
class HostBuffered(simulate.Simulate):
  """The executor protocol of `simulate` with the AQ-SGD tables in `tables` instead of the train state.

  The caller's pipeline (AQSGD over N examples) runs on the device as AQSGD over the B rows
  of one batch; every train step is a HostBufferedStep. Evaluation never reads the tables.
  `host_state` (the tables) is what train.fit saves with each checkpoint and restores on resume.
  `tables` start as given: one new HostTables per run (`HostTables.for_pipeline`); without them
  (None) the executor's programs are traced and compiled (dry runs), not run.
  """

  tables: HostTables | None
  batch_size: int
  prefetch: bool = True

  @property
  def host_state(self) -> list[np.ndarray] | None:
    return None if self.tables is None else self.tables.tables

  def _device(self, pipe: pipeline.Pipeline) -> pipeline.Pipeline:
    return device_pipeline(pipe, self.batch_size)

  def init_state(self, pipe: pipeline.Pipeline, optimizer: optax.GradientTransformation, rng, batch, params=None):
    """`simulate.init_state` of the device pipeline; ValueError if `pipe` or `batch` do not match the tables."""
    if self.tables is None:
      raise ValueError("HostBuffered without tables traces and compiles steps only; give it HostTables to train")
    state = super().init_state(self._device(pipe), optimizer, rng, batch, params)
    expected = [(len(t), *t.shape[1:]) for t in self.tables.tables]
    got = [(pipe.boundary.fwd.num_examples, *link.fwd_send.buffer.shape[1:]) for link in state.links]
    if got != expected or len(batch["id"]) != self.batch_size:
      raise ValueError(f"host tables (examples, *row) {expected} for batches of {self.batch_size}; the pipeline "
                       f"needs {got} for batches of {len(batch['id'])}")
    return state

  def make_train_step(self, pipe: pipeline.Pipeline, optimizer: optax.GradientTransformation, mode: Mode = Mode.TRAIN):
    return HostBufferedStep(super().make_train_step(self._device(pipe), optimizer, mode), self.tables, self.prefetch)

  def make_eval_step(self, pipe: pipeline.Pipeline, compressed: bool):
    return super().make_eval_step(self._device(pipe), compressed)

  def wire_bytes_per_step(self, pipe: pipeline.Pipeline, batch, mode: Mode = Mode.TRAIN) -> dict[str, int]:
    return super().wire_bytes_per_step(self._device(pipe), batch, mode)

  def state_shapes(self, pipe, optimizer, batch):
    return super().state_shapes(self._device(pipe), optimizer, batch)

  def trace_step(self, pipe, optimizer, mode, state, batch):
    return super().trace_step(self._device(pipe), optimizer, mode, state, batch)

  def describe(self) -> str:
    return super().describe() + ", AQ-SGD tables in host memory"
