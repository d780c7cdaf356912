"""The wire format: what a codec's message is made of, and its size.

A `Payload` holds the arrays that travel (one typed NamedTuple per codec family) and the static shape
and dtype both ends know. Narrow floats and scales travel as their bit patterns (`packing.as_bits`), so
no backend widens or narrows them on the wire: the bytes sent are the bytes counted (`nbytes`).
"""
import dataclasses
from typing import Any, NamedTuple

import jax
import numpy as np


class Dense(NamedTuple):
  """Identity's message: `x`, the tensor itself."""
  x: jax.Array


class Narrow(NamedTuple):
  """Cast's and ScaledCast's message. `bits`: the narrow floats as their bit patterns, [shape] uint8 (fp8) or
  uint16 (16-bit); `scale` (ScaledCast): the fp32 scales' bit patterns, uint32 [] per tensor or [C] per channel."""
  bits: jax.Array
  scale: jax.Array | None = None


class Quantized(NamedTuple):
  """A quantizer's message. `codes`: the B-bit codes of every entry, packed into uint8 [ceil(n B / 8)];
  MinMaxQuant: `lo`, `hi`, the tensor's fp32 range; MaxAbsQuant: `scale`, the bit patterns of its scales (one per
  tensor, channel, example or group; uint32 for fp32, uint16 for 16-bit scales)."""
  codes: jax.Array
  lo: jax.Array | None = None
  hi: jax.Array | None = None
  scale: jax.Array | None = None


class Sparse(NamedTuple):
  """TopK's and RandK's message: `values` [R, k] of the kept entries of each of R rows (native dtype, bf16, or
  int8 codes with `scale`, each row's fp32 max |value|, for q8). Where they sit: `indices` [R, k] (uint8/16/32, the
  narrowest that holds F), or `mask`, a packed bitmask [R, ceil(F / 8)] (TopK, whichever is smaller); or `seed`, the
  uint32 [2] PRNG seed that regenerates them (RandK)."""
  values: jax.Array
  scale: jax.Array | None = None
  indices: jax.Array | None = None
  mask: jax.Array | None = None
  seed: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Payload:
  """A message on the wire: `arrays` travel (a typed NamedTuple per codec family: `Dense`, `Narrow`, `Quantized`,
  `Sparse`, or a composite codec's own); `shape`/`dtype` are static (known to both ends)."""
  arrays: NamedTuple
  shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  dtype: Any = dataclasses.field(metadata=dict(static=True))

  def parts(self) -> dict[str, Any]:
    """The fields of `arrays` that travel in this message, by name (fields that are None send nothing)."""
    return {name: a for name, a in self.arrays._asdict().items() if a is not None}


def nbytes(tree) -> int:
  """Bytes of every array leaf in a pytree (payloads, tuples of payloads)."""
  return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))
