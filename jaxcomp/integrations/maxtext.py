"""MaxText's pipeline with its stage-to-stage activations sent through `jaxcomp.ppermute`.

  from jaxcomp.integrations import maxtext as jaxcomp_maxtext

  with jaxcomp_maxtext.patch_pipeline(fwd="maxabs:4", bwd="maxabs:8"):
    ...  # build, trace and run MaxText here: a Pipeline's apply, its train loop (train.main([...]))

MaxText's pipeline module (maxtext 0.2.5, `maxtext/layers/pipeline.py`) moves data between stages at the end of
every loop iteration (`PipelineBase.get_new_loop_state`) with `jax.lax.ppermute(arr, "stage", perm)` inside
`jax.shard_map(..., check_vma=True)` helpers:
  `_shift_right`, `_rotate_right`  the stage outputs (`shift`, or `prev_outputs` with delayed forwarding), stage
                                   i to i+1 (mod stages): activations, COMPRESSED;
  `_rotate_right` of `circ_storage_mover`  (circular pipelines with more microbatches than stages) the outputs on
                                   their way from the last stage to the first for the next repeat, i to i+1:
                                   activations, COMPRESSED;
  `_rotate_left` in `_update_state_io`  the `state_io` stream, i to i-1: microbatch inputs moving towards stage 0
                                   and finished outputs away from the last stage, one hop per iteration: not a
                                   stage boundary's activation, sent DENSE as MaxText sends it.
So the call compresses the ring i -> i+1 over mesh axis "stage" and nothing else: each such message, the
[1, microbatch, length, embed] block of one stage, goes as `jaxcomp.ppermute(block[0], "stage", perm, fwd, bwd)`
(its rows are the microbatch's examples), under the named scope `SCOPE`, which names its collective-permutes (both
ways) in the compiled program: `stage_permute_bytes` reads what they send. `fwd="none", bwd="none"` computes what
MaxText computes, bit for bit.

How: while the context is open, the name `jax` in MaxText's pipeline module is a view of jax whose `lax.ppermute`
is the dispatch above (everything else is jax itself); MaxText's files are not changed. A program takes the
patch when it is traced, so the context clears JAX's caches when it opens and when it closes: programs traced
before it are traced again inside it, and those traced inside are not reused after it (a `.compile()`d object
stays what it was compiled as). It patches process state: not thread-safe, and not re-entrant.
Stateful schemes (EF, EF21, AQ-SGD) need state threaded through MaxText's loop state and are refused;
stochastic codecs draw from no key here (`key=None`).
"""
import contextlib
import types

import jax
import jax.numpy as jnp

import jaxcomp
from jaxcomp.analysis import hlo_bytes

SCOPE = "jaxcomp_stage_activations"  # the named scope of the compressed permutes
AXIS = "stage"  # MaxText's pipeline mesh axis


def _is_stage_ring(axis_name, perm) -> bool:
  """Whether `perm` over `axis_name` is MaxText's activation ring: every stage i sends to i+1 (mod stages)."""
  if axis_name != AXIS:
    return False
  n = jax.lax.axis_size(axis_name)
  return [tuple(pair) for pair in perm] == [(i, (i + 1) % n) for i in range(n)]


def _stage_ppermute(fwd, bwd):
  """`lax.ppermute` that sends MaxText's activation ring through `jaxcomp.ppermute(fwd, bwd)`."""
  def ppermute(x, axis_name, perm):
    if not _is_stage_ring(axis_name, perm):
      return jax.lax.ppermute(x, axis_name, perm)
    if x.shape[0] != 1:
      raise ValueError(f"MaxText's stage block should hold one stage (shape [1, ...]), got shape {x.shape}")
    with jax.named_scope(SCOPE):
      return jaxcomp.ppermute(x[0], axis_name, perm, fwd, bwd)[None]
  return ppermute


class _View(types.ModuleType):
  """A module that is `base` except for the attributes given."""

  def __init__(self, base, **replaced):
    super().__init__(base.__name__)
    self.__dict__.update(replaced)
    self._base = base

  def __getattr__(self, name):
    return getattr(self._base, name)


def _check_stateless(fwd, bwd):
  """A ValueError naming the specs unless both parse and keep no state between calls."""
  link = jaxcomp.compressed_link(fwd, bwd)
  if jax.tree.leaves(jax.eval_shape(link.init, jax.ShapeDtypeStruct((1, 1), jnp.float32))):
    raise ValueError(f"fwd={fwd!r}, bwd={bwd!r} keep state between steps, which MaxText's pipeline loop does not "
                     "carry; use stateless specs (e.g. maxabs:4, topk:0.1, fp8)")


@contextlib.contextmanager
def patch_pipeline(fwd="maxabs:4", bwd="maxabs:8"):
  """Within the context, MaxText pipelines traced send their stage-to-stage activations compressed by `fwd` and
  their gradients by `bwd` (spec strings of docs/guide/specs.md or codecs, stateless); see the module docstring."""
  from maxtext.layers import pipeline  # imported here: jaxcomp installs and imports without MaxText

  _check_stateless(fwd, bwd)
  if not hasattr(pipeline.PipelineBase, "get_new_loop_state"):
    raise ValueError("this MaxText's pipeline has no PipelineBase.get_new_loop_state: jaxcomp's patch follows "
                     "maxtext 0.2.5 (pip install 'jaxcomp[maxtext]')")
  if pipeline.jax is not jax:
    raise RuntimeError("MaxText's pipeline is already patched: patch_pipeline contexts do not nest")
  pipeline.jax = _View(jax, lax=_View(jax.lax, ppermute=_stage_ppermute(fwd, bwd)))
  jax.clear_caches()
  try:
    yield
  finally:
    pipeline.jax = jax
    jax.clear_caches()


def stage_permute_bytes(hlo) -> dict[str, int]:
  """Bytes a compiled program's collective-permutes send per call, summed over devices: `fwd` the activations
  `patch_pipeline` sends (under `SCOPE`), `bwd` their gradients (the same, in the backward pass), `other` every
  other collective-permute (MaxText's state_io stream and its gradient). `hlo`: the program's text."""
  totals = {"fwd": 0, "bwd": 0, "other": 0}
  for send in hlo_bytes.collective_permutes(hlo):
    op_name = send.inst.line.partition('op_name="')[2].partition('"')[0]
    kind = ("bwd" if "transpose(" in op_name else "fwd") if f"/{SCOPE}/" in op_name else "other"
    totals[kind] += send.runs * send.bytes_per_pair * len(send.pairs)
  return totals
