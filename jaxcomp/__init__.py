"""jaxcomp: compressed activations and activation-gradients for pipeline training.

Layers, data flowing down (a layer imports only those below it):
  compress/  the papers' math: packing, codecs C (quantizers, TopK), rotation, adaptive bits,
             schemes (EF, EF21, EF-mixed, AQ-SGD state), the custom_vjp boundary, spec strings
  pipeline, losses  the core: stages, boundaries between them, the train state, the `Executor`
             contract
  parallel/  executing a pipeline: simulate (one device), the sharded executor (stages across
             devices, typed schedules compiled into a plan: GPipe, 1F1B, ZB-H1, interleaved 1F1B),
             `ppermute` (a compressed `jax.lax.ppermute`, which the executor sends with), data
             parallelism, QuantizedAdam, AQ-SGD tables in host memory; `executors` builds one
  analysis/  reading and modelling programs, running none: bytes and FLOPs of compiled programs, the
             network simulator, accelerator targets, dry runs (through the `Executor` contract)
  runtime/   running experiments: train loop, checkpoints, results, locks, multi-host start-up
analysis/ and runtime/ sit side by side above parallel/: neither imports the other (training reads no
program, and a dry run trains nothing); the experiment scripts use both.
  integrations/  the top: other libraries' pipelines with jaxcomp inside (`integrations.maxtext`); each imports
             jaxcomp's public API and its library, and is not imported here (jaxcomp needs no MaxText)
"""
import warnings

from jaxcomp import losses
from jaxcomp.compress import codecs, schemes
from jaxcomp.compress.boundary import Boundary, Mode, Reuse
from jaxcomp.compress.spec import parse_boundary, parse_codec, parse_scheme
from jaxcomp.parallel import sharded, simulate
from jaxcomp.parallel.executors import HostBufferedConfig, ShardedConfig, SimulateConfig, make_executor
from jaxcomp.parallel.permute import CompressedLink, compressed_link, ppermute, ppermute_init, ppermute_with_state
from jaxcomp.parallel.schedules import GPipe, Interleaved, OneFOneB, Schedule, ZeroBubbleH1
from jaxcomp.parallel.mesh import make_mesh
from jaxcomp.parallel.sharded import ShardedExecutor
from jaxcomp.parallel.simulate import Simulate
from jaxcomp.pipeline import FlaxStage, Pipeline, TrainState, boundary_bytes, init_state
from jaxcomp.runtime.hooks import Hook
from jaxcomp.runtime.train import Data, RunConfig, fit

__all__ = [
    # a pipeline: stages, the boundary between them (specs), its state
    "Boundary", "FlaxStage", "Mode", "Pipeline", "Reuse", "TrainState", "codecs", "init_state", "losses",
    "parse_boundary", "parse_codec", "parse_scheme", "schemes",
    # executing it: executors and their factory, schedules
    "GPipe", "HostBufferedConfig", "Interleaved", "OneFOneB", "Schedule", "ShardedConfig", "ShardedExecutor",
    "Simulate", "SimulateConfig", "ZeroBubbleH1", "make_executor", "make_mesh", "sharded", "simulate",
    # training it, counting its bytes, sending compressed messages in your own shard_map
    "Data", "Hook", "RunConfig", "boundary_bytes", "fit",
    "CompressedLink", "compressed_link", "ppermute", "ppermute_init", "ppermute_with_state",
]

_warned = set()


def wire_bytes_per_step(pipe, state, batch):
  """The old name of `boundary_bytes(pipe, batch, state)` (its arguments in the old order); warns once."""
  if "wire_bytes_per_step" not in _warned:
    _warned.add("wire_bytes_per_step")
    warnings.warn("jaxcomp.wire_bytes_per_step(pipe, state, batch) is now jaxcomp.boundary_bytes(pipe, batch, "
                  "state=None); the old name will go", FutureWarning, stacklevel=2)
  return boundary_bytes(pipe, batch, state)
