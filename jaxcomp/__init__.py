"""jaxcomp: compressed activations and activation-gradients for pipeline training.

Layers: codecs (stateless C) -> feedback (EF, EF21, EF-mixed, AQ-SGD state) -> boundary
(custom_vjp op per stage boundary) -> executors (simulate; gpipe across devices).
"""
from jaxcomp import codecs, feedback, losses, simulate
from jaxcomp.boundary import Boundary, Mode, Reuse
from jaxcomp.pipeline import FlaxStage, Pipeline, TrainState, init_state, wire_bytes_per_step
from jaxcomp.spec import parse_boundary, parse_codec, parse_scheme

__all__ = [
    "Boundary", "FlaxStage", "Mode", "Pipeline", "Reuse", "TrainState", "codecs", "feedback",
    "init_state", "losses", "parse_boundary", "parse_codec", "parse_scheme", "simulate",
    "wire_bytes_per_step",
]
