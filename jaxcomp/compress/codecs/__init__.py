"""Stateless compressors C: encode to the bytes that travel, decode back.

One module per family under a small base:
  wire        the message: `Payload` and the arrays each family sends (`Dense`, `Narrow`, `Quantized`,
              `Sparse`), `nbytes`
  base        the `Codec` contract (encode, decode, wire_bytes; `codec(x, key)` = decode(encode(x)), the
              C(x) of the papers' math), `Positional` (index reuse), `compiled`, `checked` (`check_encodable` first)
  casts       Identity, Cast (bf16, fp16, fp8), ScaledCast (fp8 with amax scales)
  quantizers  MinMaxQuant, MaxAbsQuant (zero / mid-rise / per-scale grids, clipping)
  sparse      TopK (its q8 values a MaxAbsQuant(8)), RandK
Every codec is a frozen dataclass (hashable, so static under `jax.jit`). Tensors are [B, ...] with a
leading example axis: non-empty and real floating-point, else `encode` raises a ValueError naming the
shape and dtype (integers would be rounded, complex numbers would lose their imaginary part). NaN and
+-inf reach the decoded message on every codec, compiled or not: a NaN makes its scale, range or sent
row NaN.
"""
from jaxcomp.compress.codecs.base import Codec, Positional, check_encodable, checked, compiled
from jaxcomp.compress.codecs.casts import Cast, Identity, ScaledCast
from jaxcomp.compress.codecs.quantizers import (
    AUTO_GRID,
    MAXABS_DEFAULTS,
    MAXABS_GRIDS,
    MaxAbsQuant,
    MinMaxQuant,
    maxabs_defaults,
)
from jaxcomp.compress.codecs.sparse import THRESHOLD_FROM_FRACTION_CPU, TOPK_VALUE_FORMATS, RandK, TopK
from jaxcomp.compress.codecs.wire import Dense, Narrow, Payload, Quantized, Sparse, nbytes

__all__ = [
    "AUTO_GRID", "Cast", "Codec", "Dense", "Identity", "MAXABS_DEFAULTS", "MAXABS_GRIDS", "MaxAbsQuant", "MinMaxQuant",
    "Narrow", "Payload", "Positional", "Quantized", "RandK", "ScaledCast", "Sparse", "THRESHOLD_FROM_FRACTION_CPU",
    "TOPK_VALUE_FORMATS", "TopK", "check_encodable", "checked", "compiled", "maxabs_defaults", "nbytes",
]
