"""What a pipeline step costs: each stage's forward and backward and each boundary's codec, per microbatch, from a
clock: `Measured` runs the ops on this process's default device, `Estimated` compiles them for a target's chip and
takes their roofline time (nothing runs). netsim's step timeline is fed from `op_seconds` of these costs; the
planner (`jaxcomp.plan`), the experiments' time to target and the throughput benchmark all read them here.
"""
import hashlib
import json
import pathlib
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomp import pipeline
from jaxcomp.analysis import dryrun, targets
from jaxcomp.compress.boundary import Boundary


def median_seconds(fn, *args, repeats: int = 10, warmup: int = 2) -> float:
  """Median wall time of fn(*args) with every output ready (device work included)."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return sorted(times)[len(times) // 2]


class StageCosts(NamedTuple):
  """One method's seconds per microbatch, and where they come from (`source`, printed with every table).

  fwd_s[s], bwd_s[s]: stage s's forward, and its backward as the executor runs it (the vjp with the forward
  recomputed, `StageRunner.stage_grads`), codecs excluded. encode_s[b], decode_s[b]: boundary b's codec as
  (forward message, backward message); stage b encodes the forward message and decodes the backward one,
  stage b+1 the other way round.
  """
  source: str
  fwd_s: tuple[float, ...]
  bwd_s: tuple[float, ...]
  encode_s: tuple[tuple[float, float], ...]
  decode_s: tuple[tuple[float, float], ...]


CostSource = Callable[[Boundary], StageCosts]  # one method's boundary -> its costs


def op_seconds(costs: StageCosts) -> tuple[list[float], list[float]]:
  """Each stage's forward and backward op with the codec work it does (netsim's fwd_s, bwd_s)."""
  last = len(costs.fwd_s) - 1
  fwd = [t + (costs.decode_s[s - 1][0] if s > 0 else 0.0) + (costs.encode_s[s][0] if s < last else 0.0)
         for s, t in enumerate(costs.fwd_s)]
  bwd = [t + (costs.decode_s[s][1] if s < last else 0.0) + (costs.encode_s[s - 1][1] if s > 0 else 0.0)
         for s, t in enumerate(costs.bwd_s)]
  return fwd, bwd


class Measured:
  """Times ops by running them on this process's default device (the median of `repeats` synchronised runs)."""

  def __init__(self, repeats: int):
    self.repeats = repeats
    self.source = f"measured on {jax.devices()[0].device_kind}"

  def input(self, shape: jax.ShapeDtypeStruct):
    return jax.random.normal(jax.random.key(2), shape.shape, shape.dtype)

  def output(self, fn, *args):
    return jax.jit(fn)(*args)

  def seconds(self, fn, *args) -> float:
    return median_seconds(jax.jit(fn), *args, repeats=self.repeats)


class Estimated:
  """Estimates ops from their programs compiled for `target` (one chip; nothing runs): the roofline
  max(FLOPs / the chip's peak, HBM traffic / its bandwidth) of `dryrun.compile_op`. Ops whose lowered programs
  are equal (stages of the same shape) are compiled once; with `store` (a JSON file) the estimate of every program
  compiled is kept there, keyed by the target, the jax version and the program's SHA-256, so a later run compiles
  only programs it has not seen."""

  def __init__(self, target: targets.Target, store: pathlib.Path | None = None):
    self.target, self.devices, self.store = target, targets.compile_only_devices(target), store
    self.source = f"estimated for {target.chip.name} from programs compiled for {target.name} (roofline, not run)"
    self.known = json.loads(store.read_text()) if store is not None and store.exists() else {}
    self.compiled = 0  # programs compiled by this clock (not found in `known`)

  def input(self, shape: jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(shape.shape, shape.dtype)

  def output(self, fn, *args):
    return jax.eval_shape(fn, *args)

  def seconds(self, fn, *args) -> float:
    program = jax.jit(fn).trace(*args).lower().as_text()
    key = f"{self.target.name} jax {jax.__version__} " + hashlib.sha256(program.encode()).hexdigest()
    if key not in self.known:
      step = dryrun.compile_op(self.target, "op", fn, *args, devices=self.devices)
      self.known[key] = step.estimated_s(self.target.chip)
      self.compiled += 1
      if self.store is not None:
        self.store.parent.mkdir(parents=True, exist_ok=True)
        partial = self.store.with_name(self.store.name + ".partial")
        partial.write_text(json.dumps(self.known, indent=0))
        partial.replace(self.store)  # a run cut mid-write leaves the previous store whole
    return self.known[key]


Clock = Measured | Estimated


def stage_times(pipe, state, microbatch, clock: Clock):
  """(forward seconds, backward seconds) of each stage on one microbatch; the backward is the vjp with the
  forward recomputed, as the executor's explicit backward runs it."""
  fwd_s, bwd_s = [], []
  x = microbatch[pipe.input_key]
  rng = jax.random.key(0)
  for stage, params, ms in zip(pipe.stages, state.params, state.model_state):
    # the model state (e.g. ReparamSSN's constants) is an argument, not a constant of the program: abstract under
    # the Estimated clock, and not folded into the program under the Measured one
    forward = lambda p, x, ms, stage=stage: stage.apply(p, ms, x, train=True, rng=rng)[0]
    y = clock.output(forward, params, x, ms)
    diff_x = jnp.issubdtype(x.dtype, jnp.floating)

    def backward(p, x, ms, g, forward=forward, diff_x=diff_x):
      if diff_x:
        return jax.vjp(lambda p, x: forward(p, x, ms), p, x)[1](g)
      return jax.vjp(lambda p: forward(p, x, ms), p)[1](g)

    fwd_s.append(clock.seconds(forward, params, x, ms))
    bwd_s.append(clock.seconds(backward, params, x, ms, clock.input(y)))
    x = y
  return fwd_s, bwd_s


def scheme_seconds(scheme, x, clock: Clock):
  """(encode seconds, decode seconds, payload) of one message of `x` through `scheme` (its state rows for x's
  rows: AQ-SGD's buffer arithmetic is included)."""
  rows = lambda init: clock.output(lambda: jax.tree.map(lambda a: a[: x.shape[0]],
                                                        init(x.shape[0], x.shape[1:], x.dtype)))
  send = lambda x, state, key: scheme.send(x, state, key)
  sender, receiver, key = rows(scheme.init_sender), rows(scheme.init_receiver), jax.random.key(0)
  payload = clock.output(send, x, sender, key)[0]
  return clock.seconds(send, x, sender, key), clock.seconds(scheme.receive, payload, receiver), payload


def codec_seconds(boundary, shape, clock: Clock):
  """((encode forward, encode backward), (decode forward, decode backward)) seconds of one message each way
  (index reuse: the gather of the gradient at the forward's positions and its scatter)."""
  x = clock.input(shape)
  enc_f, dec_f, payload = scheme_seconds(boundary.fwd, x, clock)
  if boundary.reuse:
    topk = boundary.fwd.codec
    idx = clock.output(topk.where, payload)
    enc_b = clock.seconds(topk.values_at, x, idx)
    dec_b = clock.seconds(topk.scatter, clock.output(topk.values_at, x, idx), idx)
  else:
    enc_b, dec_b, _ = scheme_seconds(boundary.bwd, x, clock)
  return (enc_f, enc_b), (dec_f, dec_b)


def stage_costs(pipe, batch, clock: Clock) -> CostSource:
  """Stage and codec times of one microbatch of `batch` from `clock` (stage times once, codec times per method
  and boundary shape)."""
  state = clock.output(lambda: pipeline.init_state(pipe, optax.sgd(0.0), jax.random.key(1), batch))
  microbatch = jax.tree.map(lambda a: a[0], pipeline.split_microbatches(batch, pipe.microbatches))
  fwd_s, bwd_s = stage_times(pipe, state, microbatch, clock)
  shapes = pipeline.boundary_shapes(pipe, state.params, state.model_state, microbatch[pipe.input_key])

  def costs(boundary):
    by_shape = {}
    for s in shapes:
      if (s.shape, s.dtype) not in by_shape:
        by_shape[s.shape, s.dtype] = codec_seconds(boundary, s, clock)
    encode, decode = zip(*(by_shape[s.shape, s.dtype] for s in shapes))
    return StageCosts(clock.source, tuple(fwd_s), tuple(bwd_s), tuple(encode), tuple(decode))
  return costs
