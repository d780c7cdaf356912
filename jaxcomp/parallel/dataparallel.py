"""The data-parallel exchange of weight gradients (or QuantizedAdam's first moment), and the
optimizer step of one stage device that follows it: three `Exchange`s, one chosen per step.

Dense: a mean over the `data` axis (XLA's all-reduce, under the scope `mesh.DATA_EXCHANGE` that names it in the
compiled program). Compressed by a Plain/EF scheme:
each replica sends C(g + e) (one `[1, P]` message) to the D-1 others around a ring of
collective-permutes (D-1 rounds, each passing on the message received last), every replica
averages the decoded messages in replica order (so all replicas compute the same mean),
e' = g + e - C(g + e). A ring of permutes rather than `all_gather`: XLA:TPU turns small
all-gathers into all-reduces of zero-padded buffers, which send twice the bytes and more.
"""
from typing import Any, Callable, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from jaxcomp.compress import packing
from jaxcomp.parallel.mesh import DATA, DATA_EXCHANGE
from jaxcomp.parallel.qadam import QuantizedAdam


def ring_gather(tree):
  """Every replica's `tree`, stacked on a new leading axis in replica order: D-1 rounds of a
  collective-permute to the next replica on the `data` ring, bit patterns on the wire."""
  d, me = jax.lax.axis_size(DATA), jax.lax.axis_index(DATA)
  ring = [(j, (j + 1) % d) for j in range(d)]
  received = [jax.tree.map(packing.as_bits, tree)]  # received[i]: replica (me - i) mod d's
  for _ in range(d - 1):
    received.append(jax.tree.map(lambda a: jax.lax.ppermute(a, DATA, ring), received[-1]))
  order = (me - jnp.arange(d)) % d  # replica r's tree is received[(me - r) mod d]
  return jax.tree.map(lambda like, *parts: packing.from_bits(jnp.stack(parts)[order], like.dtype), tree, *received)


def gathered_mean(scheme, payload):
  """Mean over data replicas of the decoded payloads of every replica (`ring_gather`)."""
  return jax.vmap(scheme.codec.decode)(ring_gather(payload)).mean(axis=0)


def compressed_mean(scheme, row, grad_state, key, real, s):
  """(mean over replicas of C(row + e), this replica's new state) of stage s's row; `grad_state` leaves are
  [1, 1, P]. The state stays zero where `real` is False (a stage row's padding), so it
  holds nothing that the executor-independent layout would drop. A device's V chunks' rows [V, P]
  (`grad_state` leaves [1, V, 1, P], s [V]): each chunk's mean and state as its own device's would be."""
  if row.ndim == 2:
    out = [compressed_mean(scheme, row[v], jax.tree.map(lambda a: a[:, v], grad_state), key, real[v], s[v])
           for v in range(row.shape[0])]
    return jnp.stack([mean for mean, _ in out]), jax.tree.map(lambda *a: jnp.stack(a, axis=1), *[e for _, e in out])
  key = jax.random.fold_in(jax.random.fold_in(key, s), jax.lax.axis_index(DATA))
  rows = jax.tree.map(lambda a: a[0], grad_state)  # [1, P]
  payload, rows = scheme.send(row[None], rows, key)
  return gathered_mean(scheme, payload)[0], jax.tree.map(lambda a: jnp.where(real, a, 0)[None], rows)


def exchange_bytes(scheme, row_size: int, num_stages: int, data: int, dense: bool) -> int:
  """Bytes all replicas send per step for one `[P]` row per stage device.

  Dense: a ring all-reduce, 2 (D-1)/D of the fp32 row per device; compressed: every
  replica's message to the D-1 others."""
  if scheme is None or dense:
    return int(2 * (data - 1) * row_size * 4) * num_stages
  return scheme.wire_bytes((1, row_size), jnp.float32) * (data - 1) * data * num_stages


class StageStep(NamedTuple):
  """What an exchange needs of the stage device it runs on."""
  s: jax.Array  # the stage index (traced; [V] chunk indices: `StateLayout.chunks_of`)
  key: jax.Array  # this step's key (stochastic codecs)
  real: jax.Array  # mask of the row's (rows') entries that are not padding
  finish: Callable  # (row(s), tied state) -> (tied and clipped row(s), tied state') (`StateLayout.finish`)
  optimizer: Any  # the optimizer's rows (`padded_rows.OptimizerRows`, as the device holds them)
  tied: Any = ()  # this replica's state of the compressed tied exchange (`StateLayout.finish`)


class Exchange(Protocol):
  def __call__(self, grads_row, opt_row, params_row, grad_state, at: StageStep) -> tuple:
    """(params row', optimizer row', error rows', tied state') from this replica's gradient row of loss / D."""


class DenseMean:
  """g = sum_i g_i (each of loss / D: the mean gradient), ties and clipping, the optimizer's step
  (warm-up steps, and runs without a gradient scheme)."""

  def __call__(self, grads_row, opt_row, params_row, grad_state, at):
    with jax.named_scope(DATA_EXCHANGE):
      grads = jax.lax.psum(grads_row, DATA)
    grads, tied = at.finish(grads, at.tied)
    return (*at.optimizer.update(grads, opt_row, params_row, at.s), grad_state, tied)


class CompressedMean(NamedTuple):
  """g = mean_i C(D g_i + e_i), e_i' = D g_i + e_i - C(D g_i + e_i); then ties, clipping, the step."""
  scheme: Any

  def __call__(self, grads_row, opt_row, params_row, grad_state, at):
    grads, grad_state = compressed_mean(self.scheme, grads_row * jax.lax.axis_size(DATA), grad_state, at.key,
                                        at.real, at.s)
    grads, tied = at.finish(grads, at.tied)
    return (*at.optimizer.update(grads, opt_row, params_row, at.s), grad_state, tied)


class MomentumExchange(NamedTuple):
  """QuantizedAdam after warm-up: m_i = b1 m + (1 - b1) g_i (g_i tied and clipped),
  m' = mean_i C(m_i + e_i), the step with v frozen."""
  scheme: Any
  optimizer: QuantizedAdam

  def __call__(self, grads_row, opt_row, params_row, grad_state, at):
    grads, tied = at.finish(grads_row * jax.lax.axis_size(DATA), at.tied)
    mu, grad_state = compressed_mean(self.scheme, self.optimizer.local_momentum(grads, opt_row), grad_state, at.key,
                                     at.real, at.s)  # decoded padding need not be 0:
    update = self.optimizer.frozen_update if grads_row.ndim == 1 else jax.vmap(self.optimizer.frozen_update)
    return (*update(jnp.where(at.real, mu, 0.0), opt_row, params_row), grad_state, tied)


def check_optimizer(optimizer, scheme):
  """QuantizedAdam needs a scheme for its momentum exchange."""
  if isinstance(optimizer, QuantizedAdam) and scheme is None:
    raise ValueError("QuantizedAdam exchanges Adam's first moment compressed by grad_scheme, but this executor "
                     "has grad_scheme=None; pass e.g. grad_scheme=parse_scheme('ef+quant:4') ('none' for an "
                     "uncompressed exchange), or use optax.adam")


def exchange_for(optimizer, scheme, warmup: bool) -> Exchange:
  """The exchange of a train step: dense without a scheme or in warm-up, else compressed gradients,
  or QuantizedAdam's compressed first moment."""
  if scheme is None or warmup:
    return DenseMean()
  if isinstance(optimizer, QuantizedAdam):
    return MomentumExchange(scheme, optimizer)
  return CompressedMean(scheme)
