"""One stage boundary: a forward scheme on activations, a backward scheme on their gradients.

`Boundary.__call__` is a `jax.custom_vjp` op:
  forward:  payload = fwd.send(x)  -> transport ->  y = fwd.receive(payload)
  backward: payload = bwd.send(dy) -> transport back ->  dx = bwd.receive(payload)
Forward states come out as outputs. Backward states go in as inputs and their *cotangents
are the new backward states* (the "token" pattern): each state row is touched by exactly one
valid call per step, and a call on a bubble tick (`send_ok`/`recv_ok` False) contributes
zero, so the cotangent summed by autodiff is exactly the new state. Sending and receiving
run under `lax.cond` on those flags: in SPMD, devices that are not this link's ends do no
codec work (on TPU they run it and drop the result: `_run_if`) and change no state. `Reuse()`
as backward scheme sends the gradient only at the forward TopK positions (values only: both
ends already know the indices).
The two halves, `forward_half` and `backward_half`, are public for executors that run a
microbatch's backward explicitly instead of through autodiff.
"""
import dataclasses
import enum
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp.compress import codecs, schemes


class Mode(enum.Enum):
  TRAIN = "train"
  WARMUP = "warmup"  # dense both ways; AQ-SGD fills its buffers
  # AQ-SGD's first visit (Algorithm 1): activations dense, so m(xi) = a at both ends; gradients
  # compressed as in TRAIN (dense under TopK index reuse, which needs a forward mask)
  FIRST_VISIT = "first_visit"
  EVAL_COMPRESSED = "eval_compressed"  # C(x) statelessly
  EVAL_UNCOMPRESSED = "eval_uncompressed"

  @property
  def trains(self) -> bool:
    return self in (Mode.TRAIN, Mode.WARMUP, Mode.FIRST_VISIT)

  @property
  def dense_forward(self) -> bool:
    return self in (Mode.WARMUP, Mode.FIRST_VISIT)

  def dense_backward(self, reuse: bool) -> bool:
    return self is Mode.WARMUP or (reuse and self is Mode.FIRST_VISIT)


@dataclasses.dataclass(frozen=True)
class Reuse:
  """Backward 'scheme' for TopK index reuse: dy is sent at the forward mask's positions."""


@dataclasses.dataclass(frozen=True)
class Transport:
  """Moves a payload across the link. Local (single device) by default: the identity."""

  def forward(self, payload):
    return payload

  def backward(self, payload):
    return payload


class LinkState(NamedTuple):
  """States of one boundary: forward sender/receiver and backward sender/receiver rows.

  The forward sender and backward receiver live with the stage before the boundary; the
  forward receiver and backward sender with the stage after it.
  """
  fwd_send: Any
  fwd_recv: Any
  bwd_send: Any
  bwd_recv: Any


def _masked(ok, tree):
  return jax.tree.map(lambda a: jnp.where(ok, a, jnp.zeros_like(a)), tree)


@dataclasses.dataclass(frozen=True)
class Boundary:
  fwd: schemes.Scheme
  bwd: Any  # schemes.Scheme | Reuse
  transport: Transport = Transport()

  def __post_init__(self):
    if not isinstance(self.fwd, schemes.Scheme):
      why = "; reuse is backward only (it sends the gradient at the forward TopK's indices)" if isinstance(
          self.fwd, Reuse) else ""
      raise ValueError(f"forward scheme must be a Scheme, got {self.fwd!r}{why}")
    if isinstance(self.bwd, Reuse):
      if not isinstance(self.fwd.codec, codecs.Positional) or isinstance(self.fwd, schemes.EFMixed):
        raise ValueError(f"backward index reuse needs a single TopK forward message, got {self.fwd!r}")
    elif not isinstance(self.bwd, schemes.Scheme):
      raise ValueError(f"backward scheme must be a Scheme or Reuse(), got {self.bwd!r}")
    elif self.bwd.keyed_by_example:
      raise ValueError("AQ-SGD compresses activations only; use plain quantization backward")

  @property
  def reuse(self) -> bool:
    return isinstance(self.bwd, Reuse)

  def init(self, slot_rows: int, row_shape, dtype) -> LinkState:
    """Zero states: `slot_rows` = batch size for slot-keyed schemes."""
    def make(scheme, which):
      if isinstance(scheme, Reuse):
        return schemes.EmptyState()
      return getattr(scheme, which)(slot_rows, row_shape, dtype)
    return LinkState(make(self.fwd, "init_sender"), make(self.fwd, "init_receiver"),
                     make(self.bwd, "init_sender"), make(self.bwd, "init_receiver"))

  def wire_bytes(self, shape, dtype) -> tuple[int, int]:
    """(forward, backward) bytes of one message of activation shape `shape`."""
    if self.reuse:
      back = self.fwd.codec.value_bytes(shape, dtype)
    else:
      back = self.bwd.wire_bytes(shape, dtype)
    return self.fwd.wire_bytes(shape, dtype), back

  def eval(self, x, compressed: bool, key=None):
    """Stateless inference path: C(x) through the transport, or the dense tensor."""
    codec = _eval_codec(self, Mode.EVAL_COMPRESSED if compressed else Mode.EVAL_UNCOMPRESSED)
    return codec.decode(self.transport.forward(codec.encode(x, key)))

  def __call__(self, x, state: LinkState, key, mode: Mode = Mode.TRAIN, send_ok=True, recv_ok=True):
    """Train/warm-up step through the boundary. Returns (y, (fwd_send', fwd_recv'))."""
    if mode in (Mode.EVAL_COMPRESSED, Mode.EVAL_UNCOMPRESSED):
      return self.eval(x, mode is Mode.EVAL_COMPRESSED, key), (state.fwd_send, state.fwd_recv)
    ok = (jnp.asarray(send_ok, bool), jnp.asarray(recv_ok, bool))
    y, fs, fr = _link(self, mode, x, state.fwd_send, state.fwd_recv,
                      state.bwd_send, state.bwd_recv, key, *ok)
    # States are not differentiated. Without this, writing the new rows back into a table
    # inside a differentiated step runs scatter's JVP rule, which costs O(table) per step.
    return y, jax.lax.stop_gradient((fs, fr))


def _zeros_like(tree):
  return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)


def _varying(value) -> frozenset:
  """The manual mesh axes a value (or its ShapeDtypeStruct) varies over under shard_map with check_vma
  (jax >= 0.10: `manual_axis_type.varying`; before: `vma`); empty elsewhere."""
  axis_type = getattr(value, "manual_axis_type", None)
  return frozenset(axis_type.varying if axis_type is not None else getattr(value, "vma", None) or ())


def _to_varying(value, axes):
  """`value` made varying over the mesh `axes` it does not vary over yet (`lax.pcast`; `lax.pvary` before jax 0.8.2)."""
  missing = tuple(sorted(axes - _varying(jax.typeof(value))))
  if not missing:
    return value
  pcast = getattr(jax.lax, "pcast", None)
  return pcast(value, missing, to="varying") if pcast else jax.lax.pvary(value, missing)


def _run_if(ok, fun, value, state):
  """(out, state') = fun(value, state) where `ok`; zeros and the old state elsewhere.

  The cond keeps codec work (and any state change) to the device that really sends or receives. Both
  branches' results vary over the same mesh axes, as shard_map with check_vma requires of a cond (zeros vary
  over none). On TPU the branch runs on every device and its result is selected: XLA:TPU's layout assignment
  does not finish on a sharded pipeline step whose codec loop (TopK's threshold count) sits inside a
  conditional. The sharded executor runs one op per tick, direction and activation shape on each device
  (`StageRunner.exchange_forward`), so there this costs only the idle ticks' work.
  """
  shapes = jax.eval_shape(fun, value, state)
  skip = lambda value, state: (_zeros_like(shapes[0]), state)
  skipped = jax.eval_shape(skip, value, state)
  axes = [_varying(a) | _varying(b) for a, b in zip(jax.tree.leaves(shapes), jax.tree.leaves(skipped))]

  def aligned(branch):
    def run(value, state):
      leaves, tree = jax.tree.flatten(branch(value, state))
      return tree.unflatten([_to_varying(v, a) for v, a in zip(leaves, axes)])
    return run

  def selected(ok, value, state):
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), aligned(fun)(value, state), aligned(skip)(value, state))

  conditional = lambda ok, value, state: jax.lax.cond(ok, aligned(fun), aligned(skip), value, state)
  return jax.lax.platform_dependent(ok, value, state, default=conditional, tpu=selected)


def _eval_codec(link: Boundary, mode: Mode):
  """The stateless codec of an eval step: the forward scheme's codec, or the dense tensor."""
  return link.fwd.codec if mode is Mode.EVAL_COMPRESSED else codecs.Identity()


def forward_send(link: Boundary, mode: Mode, x, fs, key, send_ok):
  """The sender's part of `forward_half`: (payload = fwd.send(x), fs'); the dense tensor in warm-up and
  first-visit steps; C(x) statelessly in an eval step (`Boundary.eval`)."""
  fwd = link.fwd
  if not mode.trains:
    send = lambda x, s: (_eval_codec(link, mode).encode(x, key), s)
  else:
    send = fwd.warmup_send if mode.dense_forward else (lambda x, s: fwd.send(x, s, key))
  return _run_if(send_ok, send, x, fs)


def forward_receive(link: Boundary, mode: Mode, arrived, fr, recv_ok):
  """The receiver's part of `forward_half`: (y = fwd.receive(arrived payload), fr') (AQ-SGD's warm-up and
  first visit set m(xi) = a; an eval step decodes statelessly)."""
  fwd = link.fwd
  if not mode.trains:
    receive = lambda p, s: (_eval_codec(link, mode).decode(p), s)
  else:
    receive = fwd.warmup_receive if mode.dense_forward else fwd.receive
  return _run_if(recv_ok, receive, arrived, fr)


def reuse_positions(link: Boundary, mode: Mode, payload):
  """The TopK positions of a forward payload (at either end of the link), as the message carries them
  (`TopK.where`: its mask or indices), when a training step's backward reuses them (else None): what
  `backward_send` and `backward_receive` take."""
  return link.fwd.codec.where(payload) if link.reuse and mode.trains and not mode.dense_forward else None


def forward_half(link: Boundary, mode: Mode, x, fs, fr, key, send_ok, recv_ok):
  """The forward half: y = fwd.receive(transport(fwd.send(x))) (dense in warm-up and
  first-visit steps: AQ-SGD then sets m(xi) = a).

  Returns (y, fs', fr', idx): idx is (sender's, receiver's) TopK positions, as the message carries them
  (`TopK.where`: its mask or indices), when the backward reuses them (else None); an explicit backward passes it
  to `backward_half`."""
  payload, fs = forward_send(link, mode, x, fs, key, send_ok)
  arrived = link.transport.forward(payload)
  y, fr = forward_receive(link, mode, arrived, fr, recv_ok)
  idx = reuse_positions(link, mode, payload)
  return y, fs, fr, None if idx is None else (idx, reuse_positions(link, mode, arrived))


def reuse_index_shapes(link: Boundary, x):
  """Shapes of the `idx` that `forward_half` returns for an activation like `x` (None without
  index reuse). They follow from the forward codec alone, whatever the scheme's state (AQ-SGD's
  is a per-example table, not rows of x)."""
  if not link.reuse:
    return None
  codec = link.fwd.codec
  return jax.eval_shape(lambda x: (lambda p: (codec.where(p), codec.where(p)))(codec.encode(x)), x)


def backward_send(link: Boundary, mode: Mode, dy, bs, key, recv_ok, idx_arrived):
  """The gradient sender's part of `backward_half` (the forward receiver): (payload = bwd.send(dy), bs'), dy
  at the forward TopK positions `idx_arrived` under index reuse; bs' zero where not `recv_ok`."""
  bwd_key = None if key is None else jax.random.fold_in(key, 1)
  if mode.dense_backward(link.reuse):
    payload, _ = _run_if(recv_ok, lambda g, s: (codecs.Identity().encode(g), s), dy, ())
  elif link.reuse:
    payload, _ = _run_if(recv_ok, lambda g, s: (link.fwd.codec.values_at(g, idx_arrived), s), dy, ())
  else:
    payload, bs = _run_if(recv_ok, lambda g, s: link.bwd.send(g, s, bwd_key), dy, bs)
  return payload, _masked(recv_ok, bs)  # bs lives after the boundary (valid with the forward receive)


def backward_receive(link: Boundary, mode: Mode, arrived, br, send_ok, idx_sent, dtype):
  """The gradient receiver's part of `backward_half` (the forward sender): (dx = bwd.receive(arrived) in
  `dtype`, br'), scattered to the forward TopK positions `idx_sent` under index reuse; br' zero where not
  `send_ok`."""
  if mode.dense_backward(link.reuse):
    dx, _ = _run_if(send_ok, lambda p, s: (codecs.Identity().decode(p), s), arrived, ())
  elif link.reuse:
    dx, _ = _run_if(send_ok, lambda p, s: (link.fwd.codec.scatter(p, idx_sent), s), arrived, ())
  else:
    dx, br = _run_if(send_ok, link.bwd.receive, arrived, br)
  return dx.astype(dtype), _masked(send_ok, br)  # br lives before the boundary


def backward_half(link: Boundary, mode: Mode, dy, bs, br, key, send_ok, recv_ok, idx):
  """The backward half: dx = bwd.receive(transport back(bwd.send(dy))).

  The gradient is sent by the forward receiver and decoded by the forward sender. Returns
  (dx, bs', br'), each state zero on the devices that are not its end (see the module doc)."""
  idx_sent, idx_arrived = (None, None) if idx is None else idx  # forward sender's positions, receiver's copy
  payload, bs = backward_send(link, mode, dy, bs, key, recv_ok, idx_arrived)
  dx, br = backward_receive(link, mode, link.transport.backward(payload), br, send_ok, idx_sent, dy.dtype)
  return dx, bs, br


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _link(link, mode, x, fs, fr, bs, br, key, send_ok, recv_ok):
  y, fs, fr, _ = forward_half(link, mode, x, fs, fr, key, send_ok, recv_ok)
  return y, fs, fr


def _link_fwd(link, mode, x, fs, fr, bs, br, key, send_ok, recv_ok):
  y, fs, fr, idx = forward_half(link, mode, x, fs, fr, key, send_ok, recv_ok)
  return (y, fs, fr), (bs, br, key, send_ok, recv_ok, idx)


def _link_bwd(link, mode, res, cotangents):
  bs, br, key, send_ok, recv_ok, idx = res
  dx, bs, br = backward_half(link, mode, cotangents[0], bs, br, key, send_ok, recv_ok, idx)
  return (dx, None, None, bs, br, None, None, None)


_link.defvjp(_link_fwd, _link_bwd)
