"""What a codec costs on an accelerator, from its compiled programs (nothing runs).

Each op of a message (encode: x -> payload; decode: payload -> x; with TopK's index reuse also the backward's
`values_at`: gradient -> values at the forward's positions, and `scatter`: values -> dense gradient) is compiled
alone for one device of a target (`dryrun.compile_op`) and read three ways:
  logical bytes   what the op cannot avoid moving: every input read once and every output written once;
  traffic         the HBM bytes of the compiled program (`hlo_bytes.memory_bytes`: each top-level instruction
                  reads its operands and writes its result, a fusion at its boundary); passes = traffic / logical;
                  a data-dependent loop (the threshold selection's counting) is in it once, and `loop_bytes` is
                  one more trip of it;
  XLA's count     the backend's own cost analysis ("bytes accessed"), where it gives one (TPU; GPU compile-only
                  devices give none);
and its sorts: a sort whose sorted dimension holds at least 1/`ROW_SORT_SHARE` of a message row's entries (an
example's) is a sort of the row (`lax.top_k` lowers to one for large k); a smaller one (the threshold selection's
strided sample and candidates, a TPU scatter's sort of its few indices) is not. Its roofline time is
max(traffic / HBM bandwidth, matrix FLOPs / peak) at the chip's published figures: an estimate, never a
measurement (`benchmarks.device_check` measures the same ops where a device is at hand).
"""
import re
from typing import NamedTuple

import jax
import numpy as np

from jaxcomp.analysis import dryrun, hlo_bytes, targets
from jaxcomp.compress import codecs

ROW_SORT_SHARE = 8  # a sort of at least 1/8 of a row's entries along its sorted dimension is a sort of the row
_SORT = re.compile(r"=\s*(\(.*?\)|\S+)\s+sort\((.*?)\),\s*dimensions=\{(\d+)\}")
_SHAPE = re.compile(r"\w+\[([\d,]*)\]")


class OpCost(NamedTuple):
  """One compiled op of a codec on a target (bytes per call, one device)."""
  op: str  # "encode", "decode", "values_at", "scatter"
  logical_bytes: int
  traffic_bytes: int
  xla_bytes: float | None  # the backend's cost analysis, where it gives one
  peak_bytes: int
  sorts: int  # sort instructions in the program
  row_sorts: int  # of them, sorts of >= 1/ROW_SORT_SHARE of the row's entries (a sort of the row)
  roofline_s: float
  compile_s: float
  loop_bytes: int = 0  # traffic of one more trip of its data-dependent loops (in traffic_bytes once)

  @property
  def passes(self) -> float:
    """Traffic per logical byte: 1.0 is an op that touches each byte it must exactly once."""
    return self.traffic_bytes / self.logical_bytes


def sorts(hlo: str) -> list[int]:
  """The length of the sorted dimension of each sort instruction in the HLO text."""
  lengths = []
  for result, _, dim in _SORT.findall(hlo):
    dims = _SHAPE.search(result).group(1).split(",")
    lengths.append(int(dims[int(dim)]))
  return lengths


def op_cost(target: targets.Target, op: str, fn, *args, row: int | None = None, devices=None) -> OpCost:
  """`fn(*args)` (arrays or ShapeDtypeStructs) compiled for one device of `target`, read as above. `row`: entries
  in a row of the message (default: an example of the first argument, its size over its leading axis)."""
  row = row or int(np.prod(args[0].shape[1:]))
  device = (devices or targets.compile_only_devices(target))[0]
  placed = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                       sharding=jax.sharding.SingleDeviceSharding(device)), args)
  step, compiled = dryrun.compile_step(op, lambda: jax.jit(fn).trace(*placed), target.platform)
  text = compiled.as_text()
  analysis = compiled.cost_analysis()
  analysis = (analysis[0] if isinstance(analysis, list) else analysis) or {}
  lengths = sorts(text)
  logical = codecs.nbytes(args) + codecs.nbytes(jax.eval_shape(fn, *args))
  return OpCost(op, logical, step.traffic_bytes, analysis.get("bytes accessed"), step.peak_bytes, len(lengths),
                sum(n * ROW_SORT_SHARE >= row for n in lengths), step.estimated_s(target.chip), step.compile_s,
                hlo_bytes.memory_bytes(text, unknown_trips=2) - step.traffic_bytes)


def codec_costs(target: targets.Target, codec: codecs.Codec, shape, dtype, reuse: bool = False,
                devices=None) -> list[OpCost]:
  """The codec's encode and decode of one message of `shape` and `dtype` on `target`; with `reuse` (a TopK codec)
  also the index-reuse backward's `values_at` and `scatter` at the forward's positions."""
  devices = devices or targets.compile_only_devices(target)
  x = jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype))
  encode = lambda x: codec.encode(x, jax.random.key(0))  # a stochastic codec's key: a constant of the program
  payload = jax.eval_shape(encode, x)
  row = int(np.prod(shape[1:]))
  out = [op_cost(target, "encode", encode, x, row=row, devices=devices),
         op_cost(target, "decode", codec.decode, payload, row=row, devices=devices)]
  if reuse:
    where = jax.eval_shape(codec.where, payload)
    values = jax.eval_shape(codec.values_at, x, where)
    out += [op_cost(target, "values_at", codec.values_at, x, where, row=row, devices=devices),
            op_cost(target, "scatter", codec.scatter, values, where, row=row, devices=devices)]
  return out
