"""The data-parallel exchange of weight gradients (or QuantizedAdam's first moment).

Dense: a mean over the `data` axis (XLA's all-reduce). Compressed by a Plain/EF scheme:
each replica sends C(g + e) (one `[1, P]` message) to the D-1 others around a ring of
collective-permutes (D-1 rounds, each passing on the message received last), every replica
averages the decoded messages in replica order (so all replicas compute the same mean),
e' = g + e - C(g + e). A ring of permutes rather than `all_gather`: XLA:TPU turns small
all-gathers into all-reduces of zero-padded buffers, which send twice the bytes and more.
"""
import jax
import jax.numpy as jnp

from jaxcomp import packing
from jaxcomp.schedule import DATA, STAGE


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


def compressed_mean(scheme, row, grad_state, key, real):
  """(mean over replicas of C(row + e), this replica's new state); `grad_state` leaves are
  [1, 1, P]. The state stays zero where `real` is False (a stage row's padding), so it
  holds nothing that the executor-independent layout would drop."""
  key = jax.random.fold_in(jax.random.fold_in(key, jax.lax.axis_index(STAGE)), jax.lax.axis_index(DATA))
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
