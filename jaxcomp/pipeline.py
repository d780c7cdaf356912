"""What every executor shares: stages, the pipeline spec, train state, keys, state rows and tied parameters.

A pipeline is S stage functions with the same Boundary between consecutive stages. A batch
of B examples is split into M microbatches of B/M; boundary b's state tables live in
`TrainState.links[b]`, with B slot rows (EF-style "global buffer" of a batch) or one row
per training example (AQ-SGD). Tied parameters (copies on two stages kept equal) start equal and take one
summed gradient, exchanged exact or compressed (`tie_grads`, `tied_member_total`).
"""
import abc
import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jaxcomp.arguments import is_integer
from jaxcomp.compress import codecs, schemes
from jaxcomp.compress.boundary import Boundary, LinkState, Mode


class Stage(Protocol):
  """A pipeline stage: a pure function of (params, model_state, x), initialised from a shape."""

  def init(self, rng, x) -> tuple[Any, Any]:
    """(params, model_state) for inputs shaped like `x` (values must not matter)."""

  def apply(self, params, model_state, x, *, train: bool, rng) -> tuple[Any, Any]:
    """(y, model_state')."""


class Executor(abc.ABC):
  """Runs a Pipeline's train and eval steps (`simulate.Simulate`, `sharded.ShardedExecutor`,
  `hostbuffer.HostBuffered`): an executor subclasses it, implements its abstract methods and takes the
  defaults of the optional hooks (`parallel.executors` builds one from a typed config).

  An executor is built for its devices (one device, or a mesh), which may be compile-only ones
  (`analysis.targets`): `state_shapes`, `batch_shapes` and `trace_step` then give the programs a dry
  run compiles (`analysis.dryrun`) without allocating or running anything.
  """

  mesh: Any = None  # the device mesh batches are split over (its `data` axis); None: one device
  host_state: Any = None  # numpy arrays kept outside the train state, saved with it (AQ-SGD tables)

  @abc.abstractmethod
  def init_state(self, pipe: "Pipeline", optimizer, rng, batch, params=None) -> "TrainState":
    """The executor's train state for batches shaped like `batch`."""

  @abc.abstractmethod
  def make_train_step(self, pipe: "Pipeline", optimizer, mode) -> Callable:
    """(state, batch) -> (state, metrics). A step with a `close()` holds resources (a thread) until the
    caller calls it (`train.fit` does when the run ends)."""

  @abc.abstractmethod
  def make_eval_step(self, pipe: "Pipeline", compressed: bool) -> Callable:
    """(state, batch) -> metrics."""

  @abc.abstractmethod
  def wire_bytes_per_step(self, pipe: "Pipeline", batch, mode) -> dict[str, int]:
    """Bytes one training step sends, each way (and over `data`)."""

  @abc.abstractmethod
  def state_shapes(self, pipe: "Pipeline", optimizer, batch) -> "TrainState":
    """ShapeDtypeStructs, placed on the executor's devices (with their shardings), of what `init_state`
    returns for batches like `batch` (arrays or shapes): nothing is allocated and no memory is checked."""

  @abc.abstractmethod
  def batch_shapes(self, batch):
    """ShapeDtypeStructs of `batch` placed as the executor's steps take it."""

  @abc.abstractmethod
  def trace_step(self, pipe: "Pipeline", optimizer, mode, state, batch) -> jax.stages.Traced:
    """The step of `mode` (a training mode: the train step; EVAL_COMPRESSED / EVAL_UNCOMPRESSED: the
    eval step) traced for `state` and `batch` (arrays or `state_shapes` / `batch_shapes`): its `.jaxpr`, and
    `.lower()` for the executor's devices (`.lower().compile()`: HLO text, memory analysis)."""

  def collective_ways(self, mode) -> tuple[str, ...]:
    """The ways of `wire_bytes_per_step` that the compiled step's collective-permutes and all-gathers carry
    (what `analysis.hlo_bytes.collective_bytes` reads); by default none: one device, no link in the program."""
    return ()

  def describe(self) -> str:
    """One line: where the executor runs the stages (dry runs print it)."""
    return type(self).__name__

  def unstack(self, pipe: "Pipeline", optimizer, state: "TrainState", batch) -> "TrainState":
    """The state in the simulate layout of the global `batch` (what checkpoints hold); by default the
    executor's state is that layout."""
    return state

  def stack(self, pipe: "Pipeline", optimizer, state: "TrainState", batch) -> "TrainState":
    """Inverse of `unstack`, placed on the executor's devices (by default the default device)."""
    return jax.device_put(state)

  def rows_description(self, pipe: "Pipeline", optimizer, batch) -> dict | None:
    """How a checkpoint of the executor's own state turns into the simulate layout
    (`state_layout.StateRows.description`); None (the default): the state is that layout."""
    return None


@dataclasses.dataclass(frozen=True)
class FlaxStage:
  """A Flax module `__call__(x, train)` as a pure stage: (params, model_state, x) -> y.

  `model_state` holds every non-param collection (e.g. BatchNorm `batch_stats`); dropout
  draws from the `dropout` rng stream.
  """
  module: nn.Module

  def init(self, rng, x):
    variables = dict(self.module.init({"params": rng, "dropout": rng}, x, train=False))
    return variables.pop("params", {}), variables

  def apply(self, params, model_state, x, *, train: bool, rng):
    variables = {"params": params, **model_state}
    if train and model_state:
      y, updated = self.module.apply(variables, x, train=True, rngs={"dropout": rng},
                                     mutable=list(model_state))
      return y, dict(updated)
    return self.module.apply(variables, x, train=train, rngs={"dropout": rng}), model_state


@dataclasses.dataclass(frozen=True)
class Pipeline:
  """S stages, the boundary compression between them, and the loss on the last output.

  loss_fn(outputs, microbatch) -> (scalar loss, dict of scalar metrics); metrics are
  averaged over microbatches. `tied` lists pairs ((stage, param path), (stage, param path))
  of parameters kept equal (their gradients are summed), e.g. GPT-2's embedding and head;
  `tied_scheme` (a Plain or EF scheme) compresses that sum's exchange (`tie_grads`; None:
  the exact g_a + g_b). `init_copies` lists pairs of the same form whose second member starts as
  a copy of the first and then trains on its own (GPT-2 with an untied head).
  `grad_clip_norm` clips the global gradient norm over all stages (an executor's job: no
  single stage's optimizer sees the global norm).
  """
  stages: tuple  # of Stage
  boundary: Boundary
  loss_fn: Callable
  input_key: str
  microbatches: int = 1
  tied: tuple = ()
  grad_clip_norm: float | None = None
  tied_scheme: Any = None
  init_copies: tuple = ()

  def __post_init__(self):
    if len(self.stages) < 1:
      raise ValueError("a pipeline needs at least one stage")
    for s, stage in enumerate(self.stages):
      if isinstance(stage, nn.Module):
        raise TypeError(f"stage {s} is a Flax module ({type(stage).__name__}); wrap it as jaxcomp.FlaxStage(module): "
                        "a stage is init(rng, x) -> (params, model_state) and apply(params, model_state, x, *, train, "
                        "rng) -> (y, model_state), and FlaxStage makes a module `__call__(x, train)` one")
    check_tied_scheme(self.tied_scheme)
    m = self.microbatches
    if not is_integer(m) or m < 1:
      raise ValueError(f"microbatches must be a positive integer, got {m!r}")

  @property
  def num_stages(self) -> int:
    return len(self.stages)


class TrainState(NamedTuple):
  step: jax.Array
  rng: jax.Array
  params: tuple
  model_state: tuple
  opt_state: Any
  links: tuple  # LinkState per boundary
  grad_state: Any = ()  # data-parallel gradient compression state (sharded executor)
  tied_state: Any = ()  # per tied pair, its members' states of the compressed tied exchange (`init_tied_exchange`)


def split_microbatches(batch, m: int):
  """Tree of [B, ...] -> tree of [M, B/M, ...]; B must divide by M."""
  sizes = {x.shape[0] for x in jax.tree.leaves(batch)}
  if len(sizes) != 1:
    raise ValueError(f"all batch fields need one batch size, got sizes {sorted(sizes)}")
  (b,) = sizes
  if b % m:
    raise ValueError(f"batch size {b} does not divide into {m} microbatches")
  return jax.tree.map(lambda x: x.reshape(m, b // m, *x.shape[1:]), batch)


def microbatch_shapes(batch, m: int):
  """Shapes (ShapeDtypeStructs) of one of the M microbatches of `batch` (arrays or shapes)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] // m, *x.shape[1:]), x.dtype), batch)


def stage_key(step_key, microbatch, stage):
  return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(step_key, 0), microbatch), stage)


def link_key(step_key, microbatch, boundary):
  return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(step_key, 1), microbatch), boundary)


def rows(scheme, microbatch, microbatch_size, ids):
  """State rows touched by one microbatch: its example ids (AQ-SGD) or its batch slots."""
  if getattr(scheme, "keyed_by_example", False):
    return ids
  return microbatch * microbatch_size + jnp.arange(microbatch_size)


def example_shard(ids, shards: int):
  """The data shard that processes each example, the same in every epoch: i mod D (so an
  AQ-SGD buffer row lives on one shard; `data.batching` deals examples out by it)."""
  return ids % shards


def gather(table, r):
  return jax.tree.map(lambda t: t[r], table)


def scatter(table, r, new_rows):
  return jax.tree.map(lambda t, n: t.at[r].set(n.astype(t.dtype)), table, new_rows)


def link_rows(link: LinkState, boundary: Boundary, send_rows_of, recv_rows_of) -> LinkState:
  """Gathers one message's rows: forward sender & backward receiver on the sending side."""
  fwd, bwd = boundary.fwd, boundary.bwd
  return LinkState(gather(link.fwd_send, send_rows_of(fwd)), gather(link.fwd_recv, recv_rows_of(fwd)),
                   gather(link.bwd_send, recv_rows_of(bwd)), gather(link.bwd_recv, send_rows_of(bwd)))


def boundary_shapes(pipe: Pipeline, params, model_state, microbatch):
  """Abstract activation [B/M, ...] at each of the S-1 boundaries."""
  shapes = []
  x = jax.ShapeDtypeStruct(microbatch.shape, microbatch.dtype)
  for s, stage in enumerate(pipe.stages):
    x = jax.eval_shape(lambda p, ms, x: stage.apply(p, ms, x, train=False, rng=jax.random.key(0))[0],
                       params[s], model_state[s], x)
    shapes.append(x)
  return shapes[:-1]


def activation_shapes(pipe: Pipeline, batch) -> list:
  """The activation [B/M, ...] at each of the S-1 boundaries for batches like `batch`, traced
  abstractly (nothing is allocated; compression tables are left out). The shapes depend on the
  stages, microbatches and batch shapes only: a pipeline that hashes is traced once per batch shapes,
  later calls (the run's checks, its bytes in each mode, its tables) reuse that trace."""
  dense = uncompressed(pipe)
  leaves, treedef = jax.tree.flatten(batch)
  shapes = (treedef, tuple((tuple(x.shape), jnp.dtype(x.dtype)) for x in leaves))
  try:
    hash(dense)
  except TypeError:  # a stage holding an unhashable value: traced every time
    return list(_traced_activation_shapes(dense, shapes))
  return list(_remembered_activation_shapes(dense, shapes))


def _traced_activation_shapes(dense: Pipeline, shapes) -> tuple:
  treedef, leaves = shapes
  batch = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in leaves])
  state = jax.eval_shape(lambda b: init_state(dense, optax.identity(), jax.random.key(0), b), batch)
  return tuple(boundary_shapes(dense, state.params, state.model_state,
                               microbatch_shapes(batch, dense.microbatches)[dense.input_key]))


_remembered_activation_shapes = functools.lru_cache(maxsize=32)(_traced_activation_shapes)


def _init_stages(stages, rng, x) -> tuple[list, list, list]:
  """(params, model_state, output) per stage, stage s initialised on the previous stage's output."""
  params, model_state, outputs = [], [], []
  for s, stage in enumerate(stages):
    p, ms = stage.init(jax.random.fold_in(rng, s), x)
    x = stage.apply(p, ms, x, train=False, rng=rng)[0]
    params.append(p)
    model_state.append(ms)
    outputs.append(x)
  return params, model_state, outputs


def init_state(pipe: Pipeline, optimizer: optax.GradientTransformation, rng, batch, params=None) -> TrainState:
  """Initialises every stage on one microbatch, zero compression state, optimizer state.

  `params` (per-stage trees, e.g. pretrained weights) replace the random initialisation.
  Tracing it abstractly (`jax.eval_shape`) allocates nothing; executors that allocate call
  `parallel.memory.check_aqsgd_memory` first.
  """
  given = params
  mb = jax.tree.map(lambda x: x[0], split_microbatches(batch, pipe.microbatches))
  init_rng, state_rng = jax.random.split(rng)
  params, model_state, outputs = jax.jit(lambda r, x: _init_stages(pipe.stages, r, x))(init_rng, mb[pipe.input_key])
  if given is not None:
    jax.tree.map(lambda a, b: _check_shape(a, b), given, tuple(params))
    params = [jax.tree.map(jnp.asarray, p) for p in given]
  params = tie_params(tuple(params), pipe.tied + pipe.init_copies)
  model_state = tuple(model_state)
  shapes = outputs[:-1]  # the activation at each boundary
  batch_size = jax.tree.leaves(batch)[0].shape[0]
  links = tuple(pipe.boundary.init(batch_size, s.shape[1:], s.dtype) for s in shapes)
  return TrainState(jnp.zeros((), jnp.int32), state_rng, params, model_state,
                    optimizer.init(params), links, (), init_tied_exchange(pipe.tied, pipe.tied_scheme, params))


def ties(pipe: Pipeline) -> dict:
  """JSON: the pipeline's tied pairs, how their exchange is compressed and its initial copies (what a checkpoint
  records: a run resumes only with the same)."""
  pairs = lambda pairs: [[[s, list(path)] for s, path in pair] for pair in pairs]
  return {"tied": pairs(pipe.tied), "tied_scheme": None if pipe.tied_scheme is None else repr(pipe.tied_scheme),
          "init_copies": pairs(pipe.init_copies)}


def uncompressed(pipe: Pipeline) -> Pipeline:
  """The same pipeline with dense tensors both ways (what warm-up epochs send)."""
  dense = schemes.Plain(codecs.Identity())
  return dataclasses.replace(pipe, boundary=Boundary(dense, dense, pipe.boundary.transport))


def as_sent(pipe: Pipeline, mode: Mode) -> Pipeline:
  """The pipeline whose boundary describes what a train step of `mode` sends: TRAIN as
  configured, WARMUP dense both ways, FIRST_VISIT dense activations (and gradients as
  configured, dense under TopK index reuse)."""
  if mode is Mode.TRAIN:
    return pipe
  dense = uncompressed(pipe).boundary
  backward = dense.bwd if mode.dense_backward(pipe.boundary.reuse) else pipe.boundary.bwd
  return dataclasses.replace(pipe, boundary=dataclasses.replace(dense, bwd=backward))


def _check_shape(given, initialised):
  if tuple(given.shape) != tuple(initialised.shape):
    raise ValueError(f"given parameter of shape {tuple(given.shape)} does not fit the model's "
                     f"{tuple(initialised.shape)}")


def boundary_bytes(pipe: Pipeline, batch, state: TrainState | None = None) -> dict[str, int]:
  """Exact bytes one training step of `batch` sends across all boundaries, each way: {"fwd", "bwd"}, summed over
  microbatches and boundaries (each message's payload as its codec encodes it). The message shapes come from the
  model (`activation_shapes`), or from `state`'s parameters when given. (An executor's
  `wire_bytes_per_step(pipe, batch, mode)` counts what its program sends in a mode: these messages, and its tied
  and data-parallel exchanges.)"""
  if state is not None and not isinstance(state, TrainState):
    raise TypeError(f"jaxcomp.boundary_bytes(pipe, batch, state=None) takes a TrainState (or None) as state, got "
                    f"{type(state).__name__}")
  if state is None:
    shapes = activation_shapes(pipe, batch)
  else:
    microbatch = microbatch_shapes(batch, pipe.microbatches)[pipe.input_key]
    shapes = boundary_shapes(pipe, state.params, state.model_state, microbatch)
  per_message = [pipe.boundary.wire_bytes(s.shape, s.dtype) for s in shapes]
  m = pipe.microbatches
  return {"fwd": m * sum(f for f, _ in per_message), "bwd": m * sum(b for _, b in per_message)}


def clip_factor(squared_norm, max_norm):
  """g <- g * min(1, max_norm / ||g||), as optax.clip_by_global_norm."""
  norm = jnp.sqrt(squared_norm)
  return jnp.where(norm > max_norm, max_norm / jnp.where(norm > 0, norm, 1.0), 1.0)


def finish_grads(pipe: Pipeline, grads: tuple, tied_state=(), step_key=None) -> tuple:
  """(gradients, tied_state'): ties (`tie_grads`), then global-norm clipping: what happens to the gradients of all
  stages at once."""
  grads, tied_state = tie_grads(grads, pipe.tied, pipe.tied_scheme, tied_state, step_key)
  if pipe.grad_clip_norm is None:
    return grads, tied_state
  factor = clip_factor(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)), pipe.grad_clip_norm)
  return jax.tree.map(lambda g: g * factor, grads), tied_state


# ---------------------------------------------------------------- tied parameters
# A tied pair ((stage a, param path), (stage b, param path)) holds one parameter in each member; both start as a's
# value (`tie_params`) and both take the pair's gradient g_a + g_b. Exchanged dense, each member sends its g to the
# other. Compressed by a Plain or EF scheme (the data-parallel gradient schemes), each member sends one message of
# a [1, n] row:
#   m_a = C(g_a + e_a),  e_a' = g_a + e_a - m_a   (EF; Plain: m_a = C(g_a), no state)
# and both use the same total, its own message decoded too, in the same order: g = D(m_a) + D(m_b) on a and on b,
# so the two copies take the same update and stay bitwise equal. Each member draws its own key (`tied_member_key`:
# stochastic codecs), the same wherever the pair runs. A member's error state is the scheme's sender state of one
# [1, n] row per data-parallel replica ([D, n] leaves). `tie_grads` runs the exchange with both members in one
# program (the simulate layout); `tied_member_total` runs one member's half, the other's message arriving through
# `exchange` (the sharded layout, a device per member: `state_layout.StateLayout.finish`).

def check_tied_scheme(scheme):
  """ValueError unless `scheme` is None (a dense exchange) or a Plain or EF scheme."""
  if scheme is not None and not schemes.sender_only(scheme):
    raise ValueError(f"the tied exchange's scheme must be a Plain or EF scheme (no receiver state), got {scheme!r}")


def _at(tree, path):
  for p in path:
    tree = tree[p]
  return tree


def _set(tree, path, value):
  if not path:
    return value
  return {**tree, path[0]: _set(tree[path[0]], path[1:], value)}


def tie_params(params: tuple, pairs) -> tuple:
  """Per-stage parameter trees in which each pair's second member holds a copy of the first's value."""
  params = list(params)
  for (sa, pa), (sb, pb) in pairs:
    params[sb] = _set(params[sb], pb, jnp.array(_at(params[sa], pa)))
  return tuple(params)


def init_tied_exchange(pairs, scheme, params, replicas: int = 1) -> tuple:
  """The compressed exchange's state: per pair (member a's, member b's) states, each the scheme's sender state of
  one [n] row per replica (leaves [replicas, n], n the pair's parameter size); () when `scheme` is None (an exact
  exchange)."""
  if scheme is None:
    return ()
  member = lambda n: scheme.init_sender(replicas, (n,), jnp.float32)
  return tuple((member(n), member(n)) for n in (int(jnp.size(_at(params[sa], pa))) for (sa, pa), _ in pairs))


def tied_member_key(step_key, pair: int, member):
  """The key of member `member` (0: a, 1: b; may be traced) of tied pair `pair` in the step of `step_key`."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(step_key, 3), pair), member)


def _tied_send(scheme, g_n, state, key):
  """(payload m = C(g + e) of one member's gradient segment [n], its state') for its state of one replica ([1, n]
  leaves): the scheme's own `send` (EF's error feedback)."""
  return scheme.send(g_n[None], state, key)


def _tied_total(scheme, payload_a, payload_b):
  """The pair's gradient [n] on both members: D(m_a) + D(m_b), a's first."""
  return (scheme.codec.decode(payload_a) + scheme.codec.decode(payload_b))[0]


def tie_grads(grads: tuple, pairs, scheme=None, state=(), step_key=None) -> tuple:
  """(gradients, state'): each pair's members both get g_a + g_b, exact (`scheme` None), or D(m_a) + D(m_b) of
  their compressed messages (`state`: the pairs' member states of one replica, `step_key` the step's)."""
  grads, states = list(grads), []
  for k, ((sa, pa), (sb, pb)) in enumerate(pairs):
    g_a, g_b = _at(grads[sa], pa), _at(grads[sb], pb)
    if scheme is None:
      pair_total = g_a + g_b
    else:
      sent = [_tied_send(scheme, g.reshape(-1), member_state, tied_member_key(step_key, k, member))
              for member, (g, member_state) in enumerate(zip((g_a, g_b), state[k]))]
      pair_total = _tied_total(scheme, sent[0][0], sent[1][0]).reshape(g_a.shape).astype(g_a.dtype)
      states.append((sent[0][1], sent[1][1]))
    grads[sa] = _set(grads[sa], pa, pair_total)
    grads[sb] = _set(grads[sb], pb, pair_total)
  return tuple(grads), tuple(states)


def tied_member_total(scheme, mine, state, key, is_a, exchange):
  """(the pair's gradient [n], state') on the member holding gradient segment `mine` [n] (`is_a`: member a; may be
  traced): its message (`mine`, or with `scheme` m = C(g + e) from its `state` of one replica, [1, n] leaves, and
  its `key`) goes out through `exchange` (message -> the other member's message), and both members sum in a's-first
  order: g_a + g_b, or D(m_a) + D(m_b). `state'` is () for an exact exchange."""
  if scheme is not None:
    mine, state = _tied_send(scheme, mine, state, key)
  other = exchange(mine)
  pick = lambda first, second: jax.tree.map(lambda x, y: jnp.where(is_a, x, y), first, second)
  a, b = pick(mine, other), pick(other, mine)
  return (a + b, ()) if scheme is None else (_tied_total(scheme, a, b), state)
