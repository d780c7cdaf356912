"""Floating-point operations of a traced program, counted on its jaxpr.

Matrix products and convolutions, the work an accelerator's matrix units do and the term a
roofline compares with the chip's peak:
  dot_general:        2 * prod(output) * prod(contracting dims)
  conv_general_dilated: 2 * prod(output) * prod(kernel dims but the output features)
                        / prod(lhs dilation)   (taps that land on dilation holes do nothing)
Every other primitive costs one operation per output element. Loops and branches count as they
run: a `scan` body times its length, a `while_loop` body once (its trip count is data; the
count is then a lower bound and `Flops.exact` is False), a `cond`/`switch` its costliest
branch, a `lax.platform_dependent` choice the branch of the platform counted for. Inside
`shard_map` shapes are one device's, so a sharded step counts per device.
"""
import dataclasses

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Flops:
  by_dtype: dict  # matrix FLOPs (dot_general, convolution) by operand dtype name
  other: float  # one per output element of every other primitive
  exact: bool  # False when a loop with a data-dependent trip count was counted once

  @property
  def matmul(self) -> float:
    return sum(self.by_dtype.values())

  @property
  def total(self) -> float:
    return self.matmul + self.other

  def __add__(self, other):
    by_dtype = {d: self.by_dtype.get(d, 0.0) + other.by_dtype.get(d, 0.0) for d in {**self.by_dtype, **other.by_dtype}}
    return Flops(by_dtype, self.other + other.other, self.exact and other.exact)

  def __mul__(self, times):
    return Flops({d: f * times for d, f in self.by_dtype.items()}, self.other * times, self.exact)


ZERO = Flops({}, 0.0, True)


def _matmul(eqn, flops) -> Flops:
  return Flops({eqn.invars[0].aval.dtype.name: flops}, 0.0, True)
_FREE = {"reshape", "squeeze", "expand_dims", "broadcast_in_dim", "convert_element_type", "bitcast_convert_type",
         "copy", "copy_p", "slice", "dynamic_slice", "dynamic_update_slice", "concatenate", "pad", "transpose",
         "select_n", "iota", "gather", "scatter", "device_put", "stop_gradient", "pjit", "psum", "ppermute",
         "all_gather", "axis_index", "pmax", "pmin", "rev", "random_bits", "random_wrap",
         "random_unwrap", "random_seed", "random_fold_in", "threefry2x32", "pvary", "pcast", "sharding_constraint",
         "optimization_barrier", "reshard", "mesh_cast"}


def _size(aval) -> float:
  return float(np.prod(getattr(aval, "shape", ()), dtype=np.float64))


def _dot(eqn) -> float:
  (lhs_contract, _), _ = eqn.params["dimension_numbers"]
  lhs = eqn.invars[0].aval.shape
  return 2.0 * _size(eqn.outvars[0].aval) * float(np.prod([lhs[d] for d in lhs_contract], dtype=np.float64))


def _conv(eqn) -> float:
  kernel = eqn.invars[1].aval.shape
  out_feature = eqn.params["dimension_numbers"].rhs_spec[0]
  taps = np.prod([n for d, n in enumerate(kernel) if d != out_feature], dtype=np.float64)
  holes = np.prod(eqn.params.get("lhs_dilation") or (1,), dtype=np.float64)
  return 2.0 * _size(eqn.outvars[0].aval) * float(taps) / float(holes)


def _subjaxprs(eqn, platform):
  """The jaxprs an equation runs, with how: ("all", [jaxpr]) or ("max", [branches])."""
  params = eqn.params
  if eqn.primitive.name == "cond":
    branches = [b.jaxpr for b in params["branches"]]
    platforms = params.get("branches_platforms")
    if platform and platforms:  # lax.platform_dependent: the branch that names the platform, else the default
      named = [i for i, p in enumerate(platforms) if p and platform in p]
      return "all", [branches[named[0] if named else platforms.index(None)]]
    return "max", branches
  found = []
  for value in params.values():
    for v in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(v, jax.extend.core.ClosedJaxpr):
        found.append(v.jaxpr)
      elif isinstance(v, jax.extend.core.Jaxpr):
        found.append(v)
  return "all", found


def count(jaxpr, platform: str | None = None) -> Flops:
  """FLOPs of a (closed) jaxpr on `platform` ("cpu", "tpu", "cuda"; None: the costliest choice),
  per the rules in the module docstring."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  total = ZERO
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    how, subs = _subjaxprs(eqn, platform)
    if subs:
      inner = [count(j, platform) for j in subs]
      if how == "max":
        total += max(inner, key=lambda f: f.total)
      elif name == "scan":
        total += sum(inner, ZERO) * eqn.params["length"]
      elif name == "while":
        body = sum(inner, ZERO)
        total += Flops(body.by_dtype, body.other, False)
      else:
        total += sum(inner, ZERO)
    elif name == "dot_general":
      total += _matmul(eqn, _dot(eqn))
    elif name == "conv_general_dilated":
      total += _matmul(eqn, _conv(eqn))
    elif name not in _FREE:
      total += Flops({}, sum(_size(v.aval) for v in eqn.outvars), True)
  return total


def of(fn, *args, platform: str | None = None) -> Flops:
  """FLOPs of `fn(*args)` on `platform`, traced with abstract arguments (ShapeDtypeStructs work)."""
  return count(jax.make_jaxpr(fn)(*args), platform)
