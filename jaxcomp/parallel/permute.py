"""A compressed `jax.lax.ppermute`: one call puts compression into any shard_map pipeline.

  y = jaxcomp.ppermute(x, axis_name, perm, fwd="maxabs:4", bwd="maxabs:8", key=None)

takes `lax.ppermute`'s arguments and keeps its meaning: for each (i, j) in `perm` device i of `axis_name`
sends x to device j, and a device that is no destination receives zeros. Only the forward codec's payload
travels: the source encodes x, the payload's arrays cross as their bit patterns joined into one buffer
(`packing.join`: one collective-permute per message, moving exactly `wire_bytes`, which no compiler widens or
narrows), the destination decodes: y_j = C_fwd(x_i). Its custom_vjp sends the cotangent back along the inverse permutation
through the backward codec, dx_i = C_bwd(dy_j) (`bwd="reuse"`: dy_j at the forward TopK positions, values
alone, as both ends know them), and a device that is no source gets a zero gradient. `fwd="none",
bwd="none"` is `lax.ppermute` itself. It runs under jit, shard_map (check_vma on or off), lax.scan and
jax.checkpoint (where the backward pass recomputes the call, its forward message is sent again, as a
`lax.ppermute`'s is).

Schemes with state (EF, EF21, EF-mixed, AQ-SGD) take and return it as an explicit pytree:

  state = jaxcomp.ppermute_init(x, fwd="ef21+topk:0.1", bwd="maxabs:8")   # zeros: this device's rows
  y, state = jaxcomp.ppermute_with_state(x, state, axis_name, perm, "ef21+topk:0.1", "maxabs:8", key)

or, optax style, with the specs parsed once: `link = jaxcomp.compressed_link(fwd, bwd)`, `link.init(x)`,
`link.ppermute(x, state, axis_name, perm, key)` (a `CompressedLink`, which says where each part lives).

It is `compress.boundary`'s custom_vjp op with a `Permute` transport. The sharded executor sends every
stage boundary's messages with the same op where autodiff gives its backward (`AutodiffRunner.forward_exchange`),
and elsewhere with its halves' send and receive parts and the same `Permute` transport
(`StageRunner.exchange_forward`, `exchange_backward`).
"""
import dataclasses
import operator
from typing import Any

import jax
import jax.numpy as jnp

from jaxcomp import pipeline
from jaxcomp.compress import codecs, packing, schemes, spec
from jaxcomp.compress.boundary import Boundary, LinkState, Mode, Reuse, Transport

Perm = tuple[tuple[int, int], ...]


def check_perm(perm, axis_size: int, axis_name=None) -> Perm:
  """`perm` as (source, destination) pairs; a ValueError naming it unless it is a permutation of devices
  0..axis_size-1: every index in range, no device the source (or the destination) of two pairs."""
  try:
    pairs = tuple((operator.index(s), operator.index(d)) for s, d in perm)
  except (TypeError, ValueError):
    raise ValueError(f"perm must be a sequence of (source, destination) pairs of device indices, got {perm!r}") from None
  for end, column in (("source", 0), ("destination", 1)):
    ends = [pair[column] for pair in pairs]
    repeated = sorted({i for i in ends if ends.count(i) > 1})
    if repeated:
      raise ValueError(f"perm {perm!r} is not a permutation: device {repeated[0]} is the {end} of more than one "
                       "pair (each device sends at most one message and receives at most one)")
  outside = sorted({i for pair in pairs for i in pair if not 0 <= i < axis_size})
  if outside:
    raise ValueError(f"perm {perm!r} names device {outside[0]}, but axis {axis_name!r} has {axis_size} devices "
                     f"(0..{axis_size - 1})")
  return pairs


def send(payload, axis_name, perm):
  """`lax.ppermute` of a payload as ONE collective: its arrays' bit patterns joined into one flat buffer of
  unsigned words (`packing.join`), split and cast back at the destination. The collective moves exactly the
  payload's bytes (no compiler widens or narrows an integer buffer: XLA:CPU moves f8 as f16, XLA:TPU once
  hoisted a receiver's bf16 cast above a collective-permute), and a message pays one link latency, not one per
  array (AQ-SGD's codes and scales crossed as two permutes, and XLA:TPU hid the 3 KB one behind scalar ops only)."""
  arrays, tree = jax.tree.flatten(payload)
  if len(arrays) > 1:
    moved = packing.split(jax.lax.ppermute(packing.join(arrays), axis_name, perm), arrays)
  else:  # one array (or none) crosses in its own shape
    moved = [packing.from_bits(jax.lax.ppermute(packing.as_bits(a), axis_name, perm), a.dtype) for a in arrays]
  return jax.tree.unflatten(tree, moved)


@dataclasses.dataclass(frozen=True)
class Permute(Transport):
  """Moves a payload along `perm` of mesh axis `axis_name`, and back along the inverse permutation."""
  axis_name: Any
  perm: Perm

  def forward(self, payload):
    return send(payload, self.axis_name, self.perm)

  def backward(self, payload):
    return send(payload, self.axis_name, tuple((d, s) for s, d in self.perm))


def _scheme(value, num_examples):
  """A spec string, Codec, Scheme or Reuse() as the scheme it names (a codec alone: plain C(x))."""
  if isinstance(value, str):
    return spec.parse_scheme(value, num_examples)
  if isinstance(value, codecs.Codec):
    return schemes.Plain(value)
  if isinstance(value, (schemes.Scheme, Reuse)):
    return value
  raise ValueError(f"a compression is a spec string (e.g. 'maxabs:4'), a Codec or a Scheme, got {value!r}")


def _holds(axis_name, devices):
  """Whether this device of `axis_name` is one of `devices`."""
  return jnp.isin(jax.lax.axis_index(axis_name), jnp.asarray(devices, jnp.int32))


@dataclasses.dataclass(frozen=True)
class CompressedLink:
  """A forward and a backward scheme for the messages of `ppermute` calls, with their state.

  The state is a `LinkState` of one device, each part a table of rows (`EmptyState` where a scheme keeps
  none); under shard_map every device holds its own, sharded over the axis like x:
    fwd_send  the device as a source: EF's error e, EF21's estimate g, AQ-SGD's m(xi) of the message it sends;
    bwd_recv  the device as a source, for the gradient of that message coming back (EF21's g);
    fwd_recv  the device as a destination: EF21's g, AQ-SGD's m(xi) of the message it receives, the mirror
              of its source's fwd_send (the same arithmetic keeps them bitwise equal);
    bwd_send  the device as a destination, for the gradient it sends back (EF's e, EF21's g).
  On a ring every device is both ends and uses all four; the parts of an end a device is not stay zero.
  EF, EF21 and EF-mixed keep a row per example of the message ([B, ...], like x); AQ-SGD a row per training
  example ([num_examples, ...]), of which `ids` picks the message's.
  Forward parts come back from `ppermute` updated. Backward parts are threaded as `compress.boundary` does:
  they go in with the state, and the gradient of the loss with respect to them is their new value
  (`next_state`). So each row goes through exactly one call per step whose `send_ok`/`recv_ok` are on
  (a call with them off contributes zero): a pipeline with M microbatches in flight keeps M states.
  """
  boundary: Boundary

  @property
  def dense(self) -> bool:
    """Whether both ways send the tensor itself (`none`/`none`): then `ppermute` is `lax.ppermute`."""
    identity = schemes.Plain(codecs.Identity())
    return self.boundary.fwd == identity and self.boundary.bwd == identity

  def init(self, x) -> LinkState:
    """One device's zero state for messages like `x` [B, ...] (an array or a ShapeDtypeStruct)."""
    return self.boundary.init(x.shape[0], tuple(x.shape[1:]), x.dtype)

  def wire_bytes(self, shape, dtype) -> tuple[int, int]:
    """(forward, backward) bytes of one message of `shape` and `dtype`: what one pair of `perm` sends."""
    return self.boundary.wire_bytes(shape, dtype)

  @staticmethod
  def next_state(state: LinkState, state_grad: LinkState) -> LinkState:
    """The state after a step: the forward parts `ppermute` returned, the backward parts the gradient of the
    loss with respect to the state passed in."""
    return LinkState(state.fwd_send, state.fwd_recv, state_grad.bwd_send, state_grad.bwd_recv)

  def ppermute(self, x, state: LinkState, axis_name, perm, key=None, *, ids=None, mode: Mode = Mode.TRAIN,
               send_ok=True, recv_ok=True):
    """`lax.ppermute(x, axis_name, perm)` through the link: (y, state with new forward parts).

    `key`: randomness of stochastic codecs (None: none is drawn). `ids`: example ids [B] of the message (the
    rows of AQ-SGD's tables), or a tuple (ids of the message this device sends, ids of the one it receives)
    where they differ (a ring shifting microbatch t-s from every stage s at once). `mode`: as the executors'
    (WARMUP sends dense and fills AQ-SGD's tables; EVAL_* compress statelessly or not at all). `send_ok`,
    `recv_ok` (bools, traced or not): False where this device's outgoing / incoming message is no real one
    (a pipeline bubble): no codec work, no state change, zeros.
    """
    perm = check_perm(perm, jax.lax.axis_size(axis_name), axis_name)
    if self.dense:
      return self._dense(x, axis_name, perm, send_ok, recv_ok), state
    sends = jnp.logical_and(send_ok, _holds(axis_name, [s for s, _ in perm]))
    receives = jnp.logical_and(recv_ok, _holds(axis_name, [d for _, d in perm]))
    sent_rows, received_rows = self._rows(x, state, ids)
    tables = jax.lax.stop_gradient((state.fwd_send, state.fwd_recv))  # never differentiated (see Boundary)
    rows = LinkState(_gather(tables[0], sent_rows), _gather(tables[1], received_rows), state.bwd_send, state.bwd_recv)
    op = dataclasses.replace(self.boundary, transport=Permute(axis_name, perm))
    y, (fs, fr) = op(x, rows, key, mode, sends, receives)
    if not mode.trains:  # stateless eval decodes on every device: keep lax.ppermute's zeros
      y = jnp.where(receives, y, jnp.zeros_like(y))
    return y, state._replace(fwd_send=_put(tables[0], sent_rows, fs), fwd_recv=_put(tables[1], received_rows, fr))

  @staticmethod
  def _dense(x, axis_name, perm, send_ok, recv_ok):
    """`lax.ppermute` itself, its ends masked by the flags where they are not constant True."""
    if send_ok is not True:
      x = jnp.where(send_ok, x, jnp.zeros_like(x))
    y = jax.lax.ppermute(x, axis_name, perm)
    return y if recv_ok is True else jnp.where(recv_ok, y, jnp.zeros_like(y))

  def _rows(self, x, state: LinkState, ids):
    """(rows of the message sent, rows of the message received) in the forward tables; None: all of them."""
    if not self.boundary.fwd.keyed_by_example:
      return None, None
    if ids is None:
      rows = sorted({a.shape[0] for a in jax.tree.leaves((state.fwd_send, state.fwd_recv))})
      if rows != [x.shape[0]]:
        raise ValueError(f"{type(self.boundary.fwd).__name__} keeps a row per training example: its tables have "
                         f"{' / '.join(map(str, rows))} rows, the message {x.shape[0]}; pass ids= (the message's "
                         "example ids)")
      return None, None
    return ids if isinstance(ids, tuple) else (ids, ids)


def _gather(table, rows):
  return table if rows is None else pipeline.gather(table, rows)


def _put(table, rows, new_rows):
  return new_rows if rows is None else pipeline.scatter(table, rows, new_rows)


def compressed_link(fwd="maxabs:4", bwd="maxabs:8", num_examples: int | None = None) -> CompressedLink:
  """The link of forward scheme `fwd` and backward scheme `bwd`: spec strings (`docs/guide/specs.md`), codecs or
  schemes; `bwd="reuse"` sends the gradient at the forward TopK positions. AQ-SGD needs `num_examples`."""
  return CompressedLink(Boundary(_scheme(fwd, num_examples), _scheme(bwd, num_examples)))


def ppermute(x, axis_name, perm, fwd="maxabs:4", bwd="maxabs:8", key=None):
  """`jax.lax.ppermute(x, axis_name, perm)` sending x compressed by `fwd` and its gradient by `bwd` (spec
  strings or codecs; stateless: schemes with state go through `ppermute_with_state`). `x` is an array or, as
  for `lax.ppermute`, a pytree of arrays: each leaf is its own message (leaf i of several draws from
  `fold_in(key, i)`). See the module docstring."""
  link = compressed_link(fwd, bwd)
  leaves, tree = jax.tree.flatten(x)
  if any(jax.tree.leaves(jax.eval_shape(link.init, leaf)) for leaf in leaves):
    raise ValueError(f"fwd={fwd!r}, bwd={bwd!r} keep state between calls; thread it with "
                     "jaxcomp.ppermute_with_state (or jaxcomp.compressed_link(fwd, bwd))")
  keys = [key] if len(leaves) == 1 or key is None else [jax.random.fold_in(key, i) for i in range(len(leaves))]
  keys = keys * len(leaves) if len(keys) == 1 else keys
  return jax.tree.unflatten(tree, [link.ppermute(leaf, link.init(leaf), axis_name, perm, k)[0]
                                   for leaf, k in zip(leaves, keys)])


def ppermute_init(x, fwd="maxabs:4", bwd="maxabs:8", num_examples: int | None = None) -> LinkState:
  """This device's zero state of `ppermute_with_state` for messages like `x` [B, ...] (an array or a
  ShapeDtypeStruct): `compressed_link(fwd, bwd, num_examples).init(x)`. AQ-SGD needs `num_examples`."""
  return compressed_link(fwd, bwd, num_examples).init(x)


def ppermute_with_state(x, state: LinkState, axis_name, perm, fwd="maxabs:4", bwd="maxabs:8", key=None, *,
                        ids=None, mode: Mode = Mode.TRAIN, send_ok=True, recv_ok=True):
  """`ppermute` for schemes with state (EF, EF21, EF-mixed, AQ-SGD): (y, state with new forward parts), the
  state made by `ppermute_init`. The backward parts are threaded as the boundary threads them: the new state
  after a step is `CompressedLink.next_state(state, d loss / d state)` (see `CompressedLink`); `ids`, `mode`,
  `send_ok`, `recv_ok` as in `CompressedLink.ppermute`. AQ-SGD's table size is read from the state."""
  tables = jax.tree.leaves(state.fwd_send)
  link = compressed_link(fwd, bwd, tables[0].shape[0] if tables else None)
  return link.ppermute(x, state, axis_name, perm, key, ids=ids, mode=mode, send_ok=send_ok, recv_ok=recv_ok)
