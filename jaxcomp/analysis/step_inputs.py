"""netsim's inputs for a pipeline beside its stage and codec costs: the data-parallel exchange of each stage
device, the tied-parameter exchange, and an interleaved table's chunks.
"""
import dataclasses

import jax
import jax.numpy as jnp

from jaxcomp.analysis import netsim
from jaxcomp.analysis.step_cost import Clock, StageCosts, scheme_seconds
from jaxcomp.compress import spec
from jaxcomp.parallel import dataparallel
from jaxcomp.parallel.state_layout import StateLayout


def exchange(scheme, row, stages, replicas, chunks=1) -> netsim.Exchange:
  """Each of the `stages` stage devices' data-parallel exchange of its `chunks` [row] rows (the executor's: every
  stage's parameters padded to the longest's), as `dataparallel.exchange_bytes` counts it: dense (scheme None) a
  ring all-reduce of them all, 2(D-1) messages; compressed a ring all-gather per row, chunks x (D-1) messages."""
  dense = scheme is None
  sent = dataparallel.exchange_bytes(scheme, row, chunks, replicas, dense) / replicas
  return netsim.Exchange([sent] * stages, (2 if dense else chunks) * (replicas - 1))


TIED_CHOICES = ("dense", "untied")  # --tied-exchange's words; anything else is a scheme spec


def tied_exchange(choice: str, pipe, batch, clock: Clock) -> netsim.Tied | None:
  """netsim's tied exchange of one replica of the S-stage `pipe` (GPT-2's embedding and head tied) for
  `--tied-exchange` `choice`: None when untied; else the executor's messages (`StateLayout.tied_messages`: devices
  and bytes each way), with the scheme's encode and two decodes of one member's segment when compressed (the
  clock's seconds); after the data-parallel exchange (`before_exchange` False)."""
  if choice == "untied":
    return None
  scheme = None if choice == "dense" else spec.parse_scheme(choice)
  lay = StateLayout(dataclasses.replace(pipe, tied_scheme=scheme), None, batch, pipe.num_stages, 1)
  codec = []
  for (a, _, _), (b, _, _), n in lay.tied_ends():
    if a != b and scheme is not None:
      encode, decode, _ = scheme_seconds(scheme, clock.input(jax.ShapeDtypeStruct((1, n), jnp.float32)), clock)
      codec.append(encode + 2 * decode)
    elif a != b:
      codec.append(0.0)
  messages = lay.tied_messages()
  return netsim.Tied([m.ends for m in messages], [m.nbytes for m in messages], 1, codec)


def on_chunks(costs: StageCosts, per_message, chunks_per_device: int):
  """(costs, bytes per message) of the S*V chunks of an interleaved table: each stage's forward and backward cut
  into V chunks of 1/V of its time, each of the S*V-1 chunk boundaries with boundary 0's codec times and bytes
  (every boundary carries the same shape: checked by `main`). V = 1: as they are."""
  if chunks_per_device == 1:
    return costs, per_message
  cut = lambda times: tuple(t / chunks_per_device for t in times for _ in range(chunks_per_device))
  n = len(costs.fwd_s) * chunks_per_device - 1
  return (costs._replace(fwd_s=cut(costs.fwd_s), bwd_s=cut(costs.bwd_s), encode_s=(costs.encode_s[0],) * n,
                         decode_s=(costs.decode_s[0],) * n), [per_message[0]] * n)
