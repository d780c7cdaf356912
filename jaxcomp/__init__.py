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
from jaxcomp import losses
from jaxcomp.compress import codecs, schemes
from jaxcomp.compress.boundary import Boundary, Mode, Reuse
from jaxcomp.compress.spec import parse_boundary, parse_codec, parse_scheme
from jaxcomp.parallel import sharded, simulate
from jaxcomp.parallel.permute import CompressedLink, compressed_link, ppermute, ppermute_init, ppermute_with_state
from jaxcomp.pipeline import (
    FlaxStage,
    Pipeline,
    TrainState,
    init_state,
    wire_bytes_per_step,
)

__all__ = [
    "Boundary", "CompressedLink", "FlaxStage", "Mode", "Pipeline", "Reuse", "TrainState", "codecs",
    "compressed_link", "init_state", "losses", "parse_boundary", "parse_codec", "parse_scheme", "ppermute",
    "ppermute_init", "ppermute_with_state", "schemes", "sharded", "simulate", "wire_bytes_per_step",
]
