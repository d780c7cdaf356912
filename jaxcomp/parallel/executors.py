"""Which executor runs a pipeline, as a typed value, and the one factory that builds it on its devices.

A config says what runs, without devices: `SimulateConfig()` (every stage and boundary in one program on one
device), `ShardedConfig(stages=S, data_parallel=D, schedule=..., grad_scheme=...)` (stage s on device s of an
S x D mesh, the schedule's ticks, `ppermute`s carrying the payloads) or `HostBufferedConfig(batch_size=B,
directory=...)` (simulate, with AQ-SGD's per-example tables in host memory or memory-mapped files under
`directory`). `make_executor(config, devices)` builds it on `devices` (default: this process's; a dry run's
compile-only ones); no executor is chosen anywhere else.
"""
import dataclasses
from typing import Any

from jaxcomp import pipeline
from jaxcomp.compress import schemes
from jaxcomp.parallel import hostbuffer, schedules, sharded, simulate
from jaxcomp.parallel.mesh import make_mesh


@dataclasses.dataclass(frozen=True)
class SimulateConfig:
  """Every stage and boundary in one jitted program on one device (`simulate.Simulate`)."""

  @property
  def devices_needed(self) -> int:
    return 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardedConfig:
  """Stage s on device s of a `stages` x `data_parallel` mesh running `schedule`'s ticks; `grad_scheme` (Plain
  or EF around a codec) compresses the data-parallel weight-gradient exchange; `remat` "stage" recomputes a
  stage in its backward, "none" (GPipe) differentiates the forward ticks (`sharded.ShardedExecutor`)."""
  stages: int
  data_parallel: int = 1
  schedule: schedules.Schedule = schedules.GPipe()
  grad_scheme: schemes.Scheme | None = None
  remat: str = "stage"

  @property
  def devices_needed(self) -> int:
    return self.stages * self.data_parallel


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostBufferedConfig:
  """The simulate executor with AQ-SGD's per-example tables off the device, for batches of `batch_size`: in host
  memory (`directory` None) or memory-mapped under `directory` (`hostbuffer.HostBuffered`)."""
  batch_size: int
  directory: str | None = None

  @property
  def devices_needed(self) -> int:
    return 1


Config = SimulateConfig | ShardedConfig | HostBufferedConfig  # what `make_executor` builds


def make_executor(config: Config, devices=None) -> pipeline.Executor:
  """The executor `config` says, on `devices` (default: this process's). A host-buffered executor comes without
  tables: a run gives it new ones once their folder is locked (`dataclasses.replace(executor, tables=...)`), a
  dry run compiles without them."""
  device: Any = None if devices is None else list(devices)[0]
  match config:
    case SimulateConfig():
      return simulate.Simulate(device=device)
    case HostBufferedConfig():
      return hostbuffer.HostBuffered(None, config.batch_size, device=device)
    case ShardedConfig():
      return sharded.ShardedExecutor(make_mesh(config.stages, config.data_parallel, devices), config.grad_scheme,
                                     remat=config.remat, schedule=config.schedule)
  raise TypeError(f"an executor config is one of {Config}, got {config!r}")
