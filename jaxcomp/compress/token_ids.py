"""Token ids beside a codec: the last channel of x holds integer token ids, sent as an integer array of their own.

A message [..., F + 1] whose last channel holds token ids as float values (exact integers; ReparamSSN's boundary,
`models.protocol_gpt`: the subspace coordinates c, F wide, then the id of each position's token) is sent as

    payload = (C(x[..., :F]), uint16(x[..., F]))       decode: concat(C^-1(...), float(ids))

so the ids cross exactly (never through a float codec, never as bit patterns inside a float) at 2 bytes a token,
as Protocol NanoGPT's ReparamSSN record counts its id slot; the codec C sees only the coordinates. Ids must lie
in [0, 65535] (the benchmark's vocabulary is 50,304): larger values are clamped. On the gradient of such a message
the id channel is exactly zero (ids carry no gradient) and is sent as zeros, as the record sends it.
"""
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp.compress.codecs import Codec, Payload, checked, compiled
from jaxcomp.compress.codecs.base import num_entries

MAX_ID = 65535  # uint16


class WithTokenIds(NamedTuple):
  """`ids+CODEC`'s message: `inner`, the inner codec's payload of x[..., :-1]; `ids`, uint16 [...] of x[..., -1]."""
  inner: Payload
  ids: jax.Array


@dataclasses.dataclass(frozen=True)
class TokenIds(Codec):
  """C'(x) = [C(x[..., :-1]), x[..., -1]]: the last channel (token ids) sent exactly as uint16; wire bytes are the
  inner codec's of the first F channels plus 2 per token."""
  inner: Codec

  def __post_init__(self):
    if not isinstance(self.inner, Codec):
      raise ValueError(f"TokenIds wraps a Codec, got {self.inner!r}")

  @staticmethod
  def _check(shape):
    if len(shape) < 2 or shape[-1] < 2:
      raise ValueError(f"ids+CODEC sends the last channel as token ids beside at least one other; got shape "
                       f"{tuple(shape)} (a message [..., F + 1] with F >= 1)")

  @checked
  @compiled
  def encode(self, x, key=None) -> Payload:
    self._check(x.shape)
    ids = jnp.clip(jnp.round(x[..., -1].astype(jnp.float32)), 0, MAX_ID).astype(jnp.uint16)
    return Payload(WithTokenIds(self.inner.encode(x[..., :-1], key), ids), tuple(x.shape), x.dtype)

  @compiled
  def decode(self, payload: Payload) -> jax.Array:
    rest = self.inner.decode(payload.arrays.inner).astype(payload.dtype)
    return jnp.concatenate([rest, payload.arrays.ids.astype(payload.dtype)[..., None]], axis=-1)

  def wire_bytes(self, shape, dtype) -> int:
    self._check(shape)
    return self.inner.wire_bytes((*shape[:-1], shape[-1] - 1), dtype) + 2 * num_entries(shape[:-1])
