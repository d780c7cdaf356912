"""`jaxcomp.ppermute` and `CompressedLink` against `lax.ppermute` and hand-written references, on 4 devices."""
import functools
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp.analysis import hlo_bytes, overlap, targets
from jaxcomp.compress import codecs
from jaxcomp.compress.boundary import Mode
from jaxcomp.compress.spec import parse_codec
from jaxcomp.models.mlp import mlp_stages
from jaxcomp.parallel import schedules, sharded

from pipeline_cases import BATCH, mlp_pipe

tpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                         reason="libtpu is not installed (pip install -e .[test] brings it on Linux x86-64)")

S, B, F = 4, 2, 16  # devices; each device's message is [B, F]
MESH = jax.sharding.Mesh(np.array(jax.devices()[:S]), ("i",))
RING = ((0, 1), (1, 2), (2, 3), (3, 0))
PARTIAL = ((0, 2), (2, 1))  # devices 0 and 3 receive nothing, 1 and 3 send nothing
X = jax.random.normal(jax.random.key(0), (S * B, F)) * 3 + 1
W = jax.random.uniform(jax.random.key(1), (S * B, F), minval=0.5, maxval=1.5)


def _inverse(perm):
  return tuple((d, s) for s, d in perm)


def _on_mesh(f, n_in, check_vma=True, mesh=MESH):
  """f on each device's block of n_in arguments sharded over "i", its outputs likewise."""
  return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(jax.P("i"),) * n_in, out_specs=jax.P("i"),
                               check_vma=check_vma))


def _forward_and_gradient(send):
  """Each device: y = send(x) and the gradient of L = sum(w y^2) / 2 over all devices (dL/dy = w y)."""
  def f(x, w):
    y, vjp = jax.vjp(send, x)
    return y, vjp(w * y)[0]
  return f


def _computations(hlo: str) -> str:
  """A compiled program's text without its source locations (metadata, file and stack-frame tables)."""
  hlo = re.sub(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n(.+\n)*", "", hlo, flags=re.M)
  return re.sub(r",? metadata=\{[^}]*\}", "", hlo)


@pytest.mark.parametrize("perm", [RING, PARTIAL])
@pytest.mark.parametrize("check_vma", [True, False])
def test_none_is_lax_ppermute(perm, check_vma):
  """Bitwise the same values and gradients (NaN and inf included) and the same compiled program."""
  x = X.at[0, 0].set(jnp.nan).at[B, 1].set(-jnp.inf)
  ours = _on_mesh(_forward_and_gradient(lambda x: jaxcomp.ppermute(x, "i", perm, "none", "none")), 2, check_vma)
  theirs = _on_mesh(_forward_and_gradient(lambda x: jax.lax.ppermute(x, "i", perm)), 2, check_vma)
  for a, b in zip(ours(x, W), theirs(x, W)):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  compiled = [_computations(f.lower(x, W).compile().as_text()) for f in (ours, theirs)]
  assert compiled[0] == compiled[1]


def _round_trip_reference(fwd, bwd, perm, key):
  """y = lax.ppermute of the forward codec's round trip C_f(x); dx = lax.ppermute back of C_b(dL/dy)
  (`reuse`: dL/dy where the sender's TopK kept x)."""
  fc = parse_codec(fwd)

  def f(x, w):
    y = jax.lax.ppermute(fc(x, key), "i", perm)
    back = jax.lax.ppermute(w * y if bwd == "reuse" else parse_codec(bwd)(w * y, jax.random.fold_in(key, 1)), "i",
                            _inverse(perm))
    if bwd == "reuse":
      rows = jnp.arange(x.shape[0])[:, None]
      kept = jnp.zeros((x.shape[0], x[0].size), bool).at[rows, fc.positions(x)].set(True).reshape(x.shape)
      back = jnp.where(kept, back, 0.0)
    return y, back
  return f


@pytest.mark.parametrize("fwd, bwd, perm", [
    ("maxabs:4", "maxabs:8", RING), ("topk:0.25", "reuse", PARTIAL), ("quant:3", "bf16", PARTIAL),
    ("fp8:scaled", "topk:0.5:q8", RING), ("randk:0.25", "maxabs:4:stoch", RING),
    ("hadamard+maxabs:3:group=8", "quant:8", PARTIAL)])
def test_forward_and_gradient_are_the_codecs_round_trips(fwd, bwd, perm):
  """y = C_f(x of the source), dx = C_b(dy of the destination); zeros where lax.ppermute gives zeros."""
  key = jax.random.key(7)
  ours = _on_mesh(_forward_and_gradient(lambda x: jaxcomp.ppermute(x, "i", perm, fwd, bwd, key)), 2)
  y, dx = ours(X, W)
  y_ref, dx_ref = _on_mesh(_round_trip_reference(fwd, bwd, perm, key), 2)(X, W)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
  np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx_ref))
  dense = _on_mesh(lambda x: jax.lax.ppermute(x, "i", perm), 1)(X)
  assert not np.allclose(np.asarray(y), np.asarray(dense), atol=1e-3)  # the codec acted
  silent = [d for d in range(S) if d not in {d for _, d in perm}]
  assert all(not np.asarray(y[d * B:(d + 1) * B]).any() for d in silent)


PAIRS = (("maxabs:4", "maxabs:8"), ("topk:0.1", "reuse"), ("fp8", "bf16"), ("quant:2", "topk:0.3:q8"))


@pytest.mark.parametrize("target", ["cpu", pytest.param("tpu", marks=tpu)])
def test_compiled_collective_permutes_send_exactly_the_wire_bytes(target):
  """Forward and backward through four links in one program, compiled for the CPU and for 4 TPU v5e chips:
  its collective-permutes move 3 pairs x wire_bytes each way."""
  devices = jax.devices()[:S] if target == "cpu" else targets.compile_only_devices(targets.target("v5e-8"))[:S]
  mesh = jax.sharding.Mesh(np.array(devices), ("i",))
  chain = ((0, 1), (1, 2), (2, 3))  # forward messages go up (hlo_bytes: "fwd"), gradients down ("bwd")
  shape = (4, 8, 64)  # one device's activation

  def loss(x):  # each link its own message (x scaled): XLA merges equal collectives
    return sum(jnp.sum(jaxcomp.ppermute(x * (i + 1), "i", chain, fwd, bwd) ** 2) for i, (fwd, bwd) in enumerate(PAIRS))

  x = jax.ShapeDtypeStruct((S * shape[0], *shape[1:]), jnp.float32,
                           sharding=jax.sharding.NamedSharding(mesh, jax.P("i")))
  text = _on_mesh(jax.grad(loss), 1, mesh=mesh).lower(x).compile().as_text()
  sizes = [jaxcomp.compressed_link(fwd, bwd).wire_bytes(shape, jnp.float32) for fwd, bwd in PAIRS]
  assert hlo_bytes.collective_bytes(text) == {
      "fwd": 3 * sum(f for f, _ in sizes), "bwd": 3 * sum(b for _, b in sizes), "data": 0}


def test_under_scan_and_checkpoint_it_is_the_unrolled_op():
  """Three ring shifts of a carry inside lax.scan, each tick under jax.checkpoint: values and gradients are
  those of the same ticks written out."""
  send = functools.partial(jaxcomp.ppermute, axis_name="i", perm=RING, fwd="maxabs:4", bwd="topk:0.5")
  tick = lambda h: jnp.tanh(send(h) * 1.5)

  def scanned(x, w):
    value, grad = jax.value_and_grad(lambda x: jnp.sum(w * jax.lax.scan(
        lambda h, _: (jax.checkpoint(tick)(h), None), x, None, length=3)[0]))(x)
    return value[None], grad

  def unrolled(x, w, tick=tick):
    value, grad = jax.value_and_grad(lambda x: jnp.sum(w * tick(tick(tick(x)))))(x)
    return value[None], grad

  program = lambda f: jax.jit(jax.shard_map(f, mesh=MESH, in_specs=jax.P("i"), out_specs=jax.P("i")))
  (value, grad), (value_ref, grad_ref) = program(scanned)(X, W), program(unrolled)(X, W)
  np.testing.assert_allclose(np.asarray(value), np.asarray(value_ref), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(grad), np.asarray(grad_ref), rtol=1e-6, atol=1e-7)
  dense_tick = lambda h: jnp.tanh(jax.lax.ppermute(h, "i", RING) * 1.5)
  _, grad_dense = program(functools.partial(unrolled, tick=dense_tick))(X, W)
  assert not np.allclose(np.asarray(grad), np.asarray(grad_dense), atol=1e-3)  # the codecs acted


# ---------------------------------------------------------------- schemes with state


def _ef_send(fc, x, e):  # EF: m = C(x + e); e' = x + e - m
  m = fc(x + e)
  return m, x + e - m


def _reference_steps(fwd, bwd, modes, xs):
  """Hand-written: per step and device d, the ring's message d -> d+1 and its gradient back, with every
  state as a dict of per-device arrays (AQ-SGD: per-device tables by example id)."""
  fwd_kind, fwd_spec = fwd.split("+")
  fc = parse_codec(fwd_spec)
  bwd_kind, bwd_spec = bwd.split("+") if "+" in bwd else ("plain", bwd)
  bc = parse_codec(bwd_spec)
  ids = lambda d: jnp.arange(B) + d * B
  zero = jnp.zeros((B, F))
  st = {name: [zero] * S for name in ("fs", "fr", "bs", "br")}
  if fwd_kind == "aqsgd":
    st["fs"] = st["fr"] = [jnp.zeros((S * B, F), jnp.float16)] * S
  out = []
  for mode, x in zip(modes, xs):
    x = x.reshape(S, B, F)
    y = [None] * S
    fs, fr = list(st["fs"]), list(st["fr"])
    for d in range(S):
      dst = (d + 1) % S
      if fwd_kind == "ef":
        y[dst], fs[d] = _ef_send(fc, x[d], fs[d])
      elif fwd_kind == "ef21":  # c = C(x - g); g' = g + c at both ends; the receiver outputs g'
        c = fc(x[d] - fs[d])
        fs[d], fr[dst] = fs[d] + c, fr[dst] + c
        y[dst] = fr[dst]
      elif fwd_kind == "efmixed":  # m = TopK_2(x) + TopK_2(e) of 4 kept per row; e' = x + e - m
        half = codecs.TopK(2 / F)
        m = half(x[d]) + half(fs[d])
        y[dst], fs[d] = m, x[d] + fs[d] - m
      elif mode is Mode.WARMUP:  # AQ-SGD's first visit: a dense, m(xi) = a at both ends
        fs[d], fr[dst] = fs[d].at[ids(d)].set(x[d].astype(jnp.float16)), fr[dst].at[ids(d)].set(x[d].astype(jnp.float16))
        y[dst] = x[d]
      else:  # AQ-SGD: c = C(a - m(xi)); m(xi) += c at both ends; the receiver outputs m(xi)
        c = fc(x[d] - fs[d][ids(d)].astype(jnp.float32))
        fs[d] = fs[d].at[ids(d)].set((fs[d][ids(d)].astype(jnp.float32) + c).astype(jnp.float16))
        fr[dst] = fr[dst].at[ids(d)].set((fr[dst][ids(d)].astype(jnp.float32) + c).astype(jnp.float16))
        y[dst] = fr[dst][ids(d)].astype(jnp.float32)
    dx = [None] * S
    bs, br = list(st["bs"]), list(st["br"])
    for d in range(S):  # device d got its message from src and sends dL/dy = w y back
      src, dy = (d - 1) % S, W.reshape(S, B, F)[d] * y[d]
      if mode is Mode.WARMUP:
        dx[src] = dy
      elif bwd_kind == "ef":
        dx[src], bs[d] = _ef_send(bc, dy, bs[d])
      elif bwd_kind == "ef21":
        c = bc(dy - bs[d])
        bs[d], br[src] = bs[d] + c, br[src] + c
        dx[src] = br[src]
      else:
        dx[src] = bc(dy)
    st = {"fs": fs, "fr": fr, "bs": bs, "br": br}
    out.append((jnp.concatenate(y), jnp.concatenate(dx), {k: jnp.concatenate(v) for k, v in st.items()}))
  return out


@pytest.mark.parametrize("fwd, bwd", [("ef+maxabs:4", "ef21+maxabs:4"), ("ef21+topk:0.25", "ef+topk:0.5"),
                                      ("efmixed+topk:0.25", "maxabs:8"), ("aqsgd+maxabs:4", "quant:6")])
def test_stateful_schemes_match_a_hand_written_reference_for_two_steps(fwd, bwd):
  """On a ring every device sends one message and receives another; AQ-SGD's tables are read at the
  example ids of each (different on one device: ids=(sent, received)). Backward states come back as the
  gradient of the state (`next_state`)."""
  aqsgd = fwd.startswith("aqsgd")
  link = jaxcomp.compressed_link(fwd, bwd, num_examples=S * B)
  modes = (Mode.WARMUP, Mode.TRAIN) if aqsgd else (Mode.TRAIN, Mode.TRAIN)
  xs = [jax.random.normal(jax.random.key(10 + t), (S * B, F)) * (t + 1) for t in range(2)]

  def step(mode):
    def f(state, x, w):
      d = jax.lax.axis_index("i")
      ids = (jnp.arange(B) + d * B, jnp.arange(B) + (d - 1) % S * B) if aqsgd else None

      def loss(x, state):
        y, new = link.ppermute(x, state, "i", RING, ids=ids, mode=mode)
        return 0.5 * jnp.sum(w * y**2), (y, new)
      (_, (y, new)), (dx, state_grad) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, state)
      return y, dx, link.next_state(new, state_grad)
    return jax.jit(jax.shard_map(f, mesh=MESH, in_specs=jax.P("i"), out_specs=jax.P("i")))

  state = jax.jit(jax.shard_map(link.init, mesh=MESH, in_specs=jax.P("i"), out_specs=jax.P("i")))(X)
  for mode, x, (y_ref, dx_ref, st_ref) in zip(modes, xs, _reference_steps(fwd, bwd, modes, xs)):
    y, dx, state = step(mode)(state, x, W)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dx), np.asarray(dx_ref), rtol=1e-6, atol=1e-6)
    for name, part in zip(("fs", "fr", "bs", "br"), state):
      for leaf in jax.tree.leaves(part):
        np.testing.assert_allclose(np.asarray(leaf, np.float32), np.asarray(st_ref[name], np.float32),
                                   rtol=1e-6, atol=1e-6, err_msg=name)
  assert float(jnp.abs(jax.tree.leaves(state.fwd_send)[0]).max()) > 0


# ---------------------------------------------------------------- errors


def _trace(f):
  jax.eval_shape(jax.shard_map(f, mesh=MESH, in_specs=jax.P("i"), out_specs=jax.P("i")), X)


@pytest.mark.parametrize("perm, match", [
    (((0, 1), (0, 2)), r"not a permutation: device 0 is the source of more than one pair"),
    (((0, 1), (2, 1)), r"not a permutation: device 1 is the destination of more than one pair"),
    (((0, 4),), r"names device 4, but axis 'i' has 4 devices \(0..3\)"),
    (((-1, 0),), r"names device -1"),
    (((0, 1, 2),), r"must be a sequence of \(source, destination\) pairs"),
    ((0, 1), r"must be a sequence of \(source, destination\) pairs"),
])
def test_a_perm_that_is_no_permutation_is_refused(perm, match):
  for fwd in ("maxabs:4", "none"):
    with pytest.raises(ValueError, match=match):
      _trace(lambda x: jaxcomp.ppermute(x, "i", perm, fwd, fwd))


@pytest.mark.parametrize("fwd, bwd, match", [
    ("maxabs:99", "maxabs:8", r"bits must be an integer in 1..16, got 99"),
    ("nope", "maxabs:8", r"unknown compressor 'nope'"),
    ("maxabs:4", 8, r"a compression is a spec string .* got 8"),
    ("maxabs:4", "reuse", r"index reuse needs a single TopK forward message"),
    ("ef21+topk:0.1", "maxabs:8", r"fwd='ef21\+topk:0.1', bwd='maxabs:8' keep state between calls; thread it with "
                                  r"jaxcomp.ppermute_with_state"),
])
def test_a_bad_spec_is_refused_by_name(fwd, bwd, match):
  with pytest.raises(ValueError, match=match):
    _trace(lambda x: jaxcomp.ppermute(x, "i", RING, fwd, bwd))


def test_aqsgd_without_ids_is_refused():
  link = jaxcomp.compressed_link("aqsgd+maxabs:4", "maxabs:8", num_examples=100)
  with pytest.raises(ValueError, match=r"AQSGD keeps a row per training example: its tables have 100 rows, the "
                                       r"message 2; pass ids="):
    _trace(lambda x: link.ppermute(x, link.init(x), "i", RING)[0])


def test_a_pytree_is_sent_leaf_by_leaf():
  """As lax.ppermute, a pytree of arrays: each leaf is the single-array call, leaf i keyed by fold_in(key, i)."""
  key = jax.random.key(3)
  f = lambda x: jaxcomp.ppermute({"a": x, "b": 2 * x}, "i", RING, "maxabs:4:stoch", "maxabs:8", key)
  tree = _on_mesh(lambda x: f(x)["a"], 1)(X), _on_mesh(lambda x: f(x)["b"], 1)(X)
  leaf = lambda x, k: jaxcomp.ppermute(x, "i", RING, "maxabs:4:stoch", "maxabs:8", k)
  single = (_on_mesh(lambda x: leaf(x, jax.random.fold_in(key, 0)), 1)(X),
            _on_mesh(lambda x: leaf(2 * x, jax.random.fold_in(key, 1)), 1)(X))
  for got, want in zip(tree, single):
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


def test_ppermute_with_state_is_the_link_with_its_state_explicit():
  """ppermute_init / ppermute_with_state: the same messages and states as compressed_link's, AQ-SGD's table
  size read from the state."""
  fwd, bwd = "aqsgd+maxabs:4", "ef21+maxabs:4"
  link = jaxcomp.compressed_link(fwd, bwd, num_examples=S * B)

  def run(send):
    def f(x):
      ids = (jnp.arange(B) + jax.lax.axis_index("i") * B, jnp.arange(B) + (jax.lax.axis_index("i") - 1) % S * B)
      state = jaxcomp.ppermute_init(x, fwd, bwd, num_examples=S * B)
      for mode in (Mode.WARMUP, Mode.TRAIN):
        y, state = send(x * (1 + mode.trains), state, ids, mode)
      return y, state.fwd_recv.buffer
    return jax.jit(jax.shard_map(f, mesh=MESH, in_specs=jax.P("i"), out_specs=jax.P("i")))(X)

  ours = run(lambda x, st, ids, mode: jaxcomp.ppermute_with_state(x, st, "i", RING, fwd, bwd, ids=ids, mode=mode))
  theirs = run(lambda x, st, ids, mode: link.ppermute(x, st, "i", RING, ids=ids, mode=mode))
  for a, b in zip(ours, theirs):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  assert np.abs(np.asarray(ours[1], np.float32)).max() > 0


@pytest.mark.parametrize("schedule, overlapped", [("gpipe", False), pytest.param("1f1b", True, marks=pytest.mark.slow)])
def test_a_message_of_several_arrays_is_one_collective_permute(schedule, overlapped):
  """maxabs's message is two arrays (codes, per-channel scales), fp8's one: the compiled sharded step has as
  many collective-permutes for either, one per boundary message (the arrays cross as one buffer)."""
  def permutes(fwd, bwd):
    pipe = mlp_pipe(fwd, bwd, stages=mlp_stages(16, 2, 2), m=4)
    ex = sharded.ShardedExecutor(sharded.make_mesh(2), schedule=schedules.parse(schedule, overlapped))
    state = ex.init_state(pipe, optax.sgd(0.1), jax.random.key(1), BATCH)
    return len(overlap.permutes(ex.trace_step(pipe, optax.sgd(0.1), Mode.TRAIN, state, BATCH).lower().compile().as_text()))

  assert len(jax.tree.leaves(parse_codec("maxabs:4").encode(X))) == 2
  assert permutes("maxabs:4", "maxabs:8") == permutes("fp8", "fp8") > 0
