"""Free memory, and whether AQ-SGD's per-example tables fit in it before an executor allocates them.

Both ends of every boundary hold a table of one row per training example: 2 x sum_b N x |activation_b| bytes of
the buffer dtype (`schemes.AQSGD.buffer_bytes`), against the default device's free memory (its `bytes_limit` less
`bytes_in_use`, or the host's free RAM on CPU).
"""
import os

import jax

from jaxcomp.compress import schemes
from jaxcomp.compress.boundary import Boundary


def free_host_bytes() -> int:
  """Free host RAM."""
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def available_memory_bytes() -> int:
  """Free memory of the default device (accelerator limit, or host RAM on CPU)."""
  stats = jax.local_devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
  return free_host_bytes()


class TablesDoNotFit(ValueError):
  """AQ-SGD's per-example tables would not fit in the memory that is free (`need`, `available`: bytes)."""

  def __init__(self, message: str, need: int, available: int):
    super().__init__(message)
    self.need, self.available = need, available


def check_aqsgd_memory(boundary: Boundary, shapes, available: int | None = None):
  """TablesDoNotFit before allocating AQ-SGD tables (two ends x every boundary) that cannot fit
  (`shapes`: the activation at each boundary, or a function returning them, called only for AQ-SGD)."""
  if not isinstance(boundary.fwd, schemes.AQSGD):
    return
  shapes = shapes() if callable(shapes) else shapes
  total = sum(2 * boundary.fwd.buffer_bytes(s.shape[1:]) for s in shapes)
  available = available_memory_bytes() if available is None else available
  if total > available:
    raise TablesDoNotFit(
        f"AQ-SGD buffers need {total / 2**30:.2f} GiB ({boundary.fwd.num_examples} examples x "
        f"{len(shapes)} boundaries x 2 ends, {boundary.fwd.buffer_dtype}) but only "
        f"{available / 2**30:.2f} GiB is free; use fewer examples, a smaller buffer dtype or tables in host memory "
        "(hostbuffer.HostBuffered)", total, available)
