"""The shard_map GPipe executor against the single-device simulate executor."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp.analysis import dryrun
from jaxcomp.compress.boundary import Mode
from jaxcomp.models.mlp import mlp_stages
from jaxcomp.parallel import schedules, sharded, simulate

from pipeline_cases import (BATCH, assert_trees_close, bottleneck_pipe, compare_with_simulate, hetero_stages, mlp_pipe,
                            slow)

SCHEMES = [("quant:4", "quant:8"), ("ef+topk:0.2", "ef21+quant:2"), ("efmixed+topk:0.3", "ef+topk:0.2"),
           ("ef21+maxabs:2:stoch", "topk:0.5"), ("topk:0.3", "reuse")]




# all with -m slow; by default topk + reuse runs on 1F1B (test_1f1b_matches_simulate), AQ-SGD + TopK with
# reuse on GPipe (test_index_reuse_...) and aqsgd+quant:2 at data=2 (test_data_parallel_matches_simulate)
@pytest.mark.parametrize("fwd, bwd", [slow(*s) for s in SCHEMES])
def test_matches_simulate(fwd, bwd):
  compare_with_simulate(mlp_pipe(fwd, bwd), optax.sgd(0.1, momentum=0.9), steps=3)


@pytest.mark.parametrize("fwd, bwd", [("ef+topk:0.2", "reuse"), slow("aqsgd+maxabs:2", "ef21+quant:2")])
def test_gpipe_differentiated_by_autodiff_matches_simulate(fwd, bwd):
  """remat="none" (`AutodiffRunner`: each boundary's custom_vjp op, GPipe's backward by autodiff), M=4: fill,
  scanned steady and drain ticks."""
  compare_with_simulate(mlp_pipe(fwd, bwd, m=4), optax.sgd(0.1, momentum=0.9), steps=2, remat="none")


# by default 1F1B's numbers are checked by test_index_reuse_... (AQ-SGD + TopK, reuse, M=2)
@pytest.mark.parametrize("fwd, bwd, schedule", [
    slow(*SCHEMES[-1], "1f1b"), slow(*SCHEMES[-1], "1f1b-fused"),
    *(slow(*s, name) for s in SCHEMES[:-1] for name in ("1f1b", "1f1b-fused"))])
def test_1f1b_matches_simulate(fwd, bwd, schedule):
  """M=8: fill, scanned steady and drain ticks; every state row equals simulate's."""
  compare_with_simulate(mlp_pipe(fwd, bwd, m=8), optax.sgd(0.1, momentum=0.9), steps=2, schedule=schedule)


@pytest.mark.parametrize("spec, schedule", [("subspace:4", "1f1b"), slow("proj:4", "gpipe"), slow("proj:4", "1f1b"),
                                            slow("subspace:4", "gpipe"), slow("proj:4", "1f1b-fused"),
                                            slow("subspace:4", "1f1b-fused")])
def test_learned_bottleneck_matches_simulate(spec, schedule):
  """P on the sending stage, Q (or the tied W) on the receiving one: each device trains its own half."""
  compare_with_simulate(bottleneck_pipe(spec), optax.adam(1e-2), steps=2, schedule=schedule, atol=1e-5)


REUSE_FORWARDS = ("topk:0.3", "ef+topk:0.3", "ef21+topk:0.3", "aqsgd+topk:0.3")  # every scheme reuse allows


@pytest.mark.parametrize("fwd, schedule, m", [
    (fwd, name, 2) if (fwd, name) == ("aqsgd+topk:0.3", "1f1b") else slow(fwd, name, 8)
    for fwd in REUSE_FORWARDS for name in schedules.SCHEDULES])
def test_index_reuse_matches_simulate_for_every_forward_scheme(fwd, schedule, m):
  """TopK index reuse backward behind each forward scheme, on each schedule (the slow M=8
  cases also run scanned steady ticks). AQ-SGD runs warm-up steps (which fill its per-example
  tables) then compressed ones; its first-visit step under reuse is dense both ways, as warm-up."""
  modes = (Mode.WARMUP, Mode.TRAIN) if fwd.startswith("aqsgd") else (Mode.TRAIN,)
  compare_with_simulate(mlp_pipe(fwd, "reuse", m=m), optax.sgd(0.1, momentum=0.9), steps=2, modes=modes, schedule=schedule)




@pytest.mark.slow  # heavy: python -m pytest -m slow
@pytest.mark.parametrize("schedule", [slow("gpipe"), "1f1b"])
def test_aqsgd_warmup_first_visit_and_compressed_match_simulate(schedule):
  compare_with_simulate(mlp_pipe("aqsgd+quant:2", "quant:4"), optax.adam(1e-2), steps=2,
           modes=(Mode.WARMUP, Mode.FIRST_VISIT, Mode.TRAIN), schedule=schedule)


def test_first_visit_step_sends_dense_activations_and_compressed_gradients():
  pipe, opt = mlp_pipe("aqsgd+quant:2", "quant:4"), optax.sgd(0.1)
  ex = sharded.ShardedExecutor(sharded.make_mesh(pipe.num_stages))
  flat = ex.init_state(pipe, opt, jax.random.key(1), BATCH)
  sent = dryrun.collective_bytes(ex, pipe, opt, flat, BATCH, Mode.FIRST_VISIT)
  dense, train = (simulate.wire_bytes_per_step(pipe, BATCH, m) for m in (Mode.WARMUP, Mode.TRAIN))
  assert sent == {"fwd": dense["fwd"], "bwd": train["bwd"], "data": 0}


@pytest.mark.slow  # heavy: python -m pytest -m slow
@pytest.mark.parametrize("schedule", ["gpipe", slow("1f1b")])
def test_heterogeneous_stages_with_batchnorm_match_simulate(schedule):
  # SGD, not Adam: Adam turns a 1-ulp gradient difference between the two programs'
  # float sums into a whole lr step wherever the true gradient is ~0.
  state = compare_with_simulate(mlp_pipe("ef21+topk:0.25", "quant:6", stages=hetero_stages(), m=4),
                   optax.sgd(0.05, momentum=0.9), steps=2, schedule=schedule)
  assert [l.fwd_send.estimate.shape for l in state.links] == [(16, 24), (16, 8)]


@pytest.mark.slow
def test_eight_stages():
  compare_with_simulate(mlp_pipe("quant:3", "topk:0.5", stages=mlp_stages(8, 2, 8), m=2), optax.sgd(0.1), steps=2)


@pytest.mark.parametrize("fwd, bwd", [
    slow("quant:4", "fp8"), slow("ef+topk:0.2", "ef21+quant:2"), slow("efmixed+topk:0.3", "ef+topk:0.2"),
    slow("ef21+maxabs:2:stoch", "topk:0.5"), slow("topk:0.3", "reuse"), ("aqsgd+quant:2", "quant:4"),
])
def test_data_parallel_matches_simulate(fwd, bwd):
  """(data=2, stage=4): each shard runs M=2 microbatches; simulate runs the same 4 in order.
  Boundary gradients (fp8 backward), backward states and weights equal simulate's."""
  compare_with_simulate(mlp_pipe(fwd, bwd, m=2), optax.sgd(0.1), steps=2, data=2, sim_pipe=mlp_pipe(fwd, bwd, m=4))


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_1f1b_data_parallel_matches_simulate():
  compare_with_simulate(mlp_pipe("ef+quant:4", "ef+fp8", m=2), optax.sgd(0.1), steps=2, data=2,
           sim_pipe=mlp_pipe("ef+quant:4", "ef+fp8", m=4), schedule="1f1b")


def test_init_state_is_created_sharded_and_equals_simulate():
  """Per-stage init on the stage's devices (ties by a collective) = simulate's init, stacked."""
  tied = (((1, ("Dense_0", "kernel")), (2, ("Dense_0", "kernel"))),)
  pipe = dataclasses.replace(mlp_pipe("ef+quant:4", "ef21+quant:4", m=2), tied=tied)
  opt = optax.adam(1e-2)
  ex = sharded.ShardedExecutor(sharded.make_mesh(4, data=2))
  flat = ex.init_state(pipe, opt, jax.random.key(1), BATCH)
  expected = ex.stack(pipe, opt, simulate.init_state(pipe, opt, jax.random.key(1), BATCH), BATCH)
  assert_trees_close(jax.random.key_data(flat.rng), jax.random.key_data(expected.rng), 0)
  assert_trees_close(flat._replace(rng=()), expected._replace(rng=()), 0)
  assert {shard.data.shape for shard in flat.params.addressable_shards} == {(1, flat.params.shape[1])}
  assert flat.params.sharding.spec == jax.P("stage")


def test_unstack_returns_the_real_optimizer_state():
  pipe, opt = mlp_pipe("quant:4", "quant:8"), optax.adam(1e-2)
  state = simulate.init_state(pipe, opt, jax.random.key(1), BATCH)
  state, _ = simulate.make_train_step(pipe, opt)(state, BATCH)
  ex = sharded.ShardedExecutor(sharded.make_mesh(4))
  back = ex.unstack(pipe, opt, ex.stack(pipe, opt, state, BATCH), BATCH)
  assert_trees_close(back.opt_state, state.opt_state, 0)
  assert jax.tree.structure(back.opt_state) == jax.tree.structure(state.opt_state)


@pytest.mark.parametrize("name", [name if name == "1f1b-fused" else slow(name) for name in schedules.SCHEDULES])
def test_program_size_does_not_grow_with_microbatches(name):
  """The steady ticks are one scanned loop: M=4 and M=8 compile to as many collectives."""
  def permutes(m):
    pipe = mlp_pipe("quant:4", "quant:8", stages=mlp_stages(16, 2, 2), m=m)
    ex = sharded.ShardedExecutor(sharded.make_mesh(2), schedule=schedules.parse(name))
    state = ex.init_state(pipe, optax.sgd(0.1), jax.random.key(1), BATCH)
    return ex.trace_step(pipe, optax.sgd(0.1), Mode.TRAIN, state, BATCH).lower().compile().as_text().count("collective-permute")
  assert permutes(8) == permutes(4)


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_stage_remat_saves_less_than_no_remat():
  pipe = mlp_pipe("quant:4", "quant:8", stages=mlp_stages(64, 2, 4, layers_per_stage=3), m=4)
  temp = {}
  for remat in ("stage", "none"):
    ex = sharded.ShardedExecutor(sharded.make_mesh(4), remat=remat)
    state = ex.init_state(pipe, optax.sgd(0.1), jax.random.key(1), BATCH)
    temp[remat] = ex.trace_step(pipe, optax.sgd(0.1), Mode.TRAIN, state, BATCH).lower().compile().memory_analysis().temp_size_in_bytes
  assert temp["stage"] < temp["none"]


def test_tied_parameters_and_global_norm_clipping_match_simulate():
  tied = (((1, ("Dense_0", "kernel")), (2, ("Dense_0", "kernel"))),)
  pipe = dataclasses.replace(mlp_pipe("quant:4", "quant:8"), tied=tied, grad_clip_norm=0.05)
  opt = optax.sgd(0.5)
  state = simulate.init_state(pipe, opt, jax.random.key(1), BATCH)
  kernel = state.params[1]["Dense_0"]["kernel"]
  params = (state.params[0], state.params[1], {**state.params[2], "Dense_0": {**state.params[2]["Dense_0"], "kernel": jnp.array(kernel)}},
            state.params[3])
  state = state._replace(params=params)
  _, _, _, grads, _ = jax.jit(lambda st, b: simulate.loss_and_grads(pipe, st, b))(state, BATCH)  # one compile
  norm = np.sqrt(sum(float(jnp.sum(g**2)) for g in jax.tree.leaves(grads)))
  assert norm == pytest.approx(0.05, rel=1e-4)  # clipped
  np.testing.assert_array_equal(np.asarray(grads[1]["Dense_0"]["kernel"]), np.asarray(grads[2]["Dense_0"]["kernel"]))
  ex = sharded.ShardedExecutor(sharded.make_mesh(4))
  flat = ex.stack(pipe, opt, state, BATCH)
  sim_step, g_step = simulate.make_train_step(pipe, opt), ex.make_train_step(pipe, opt)
  for _ in range(2):
    state, _ = sim_step(state, BATCH)
    flat, _ = g_step(flat, BATCH)
  back = ex.unstack(pipe, opt, flat, BATCH)
  assert_trees_close(back.params, state.params, 2e-6)
  np.testing.assert_array_equal(np.asarray(back.params[1]["Dense_0"]["kernel"]),
                                np.asarray(back.params[2]["Dense_0"]["kernel"]))


WIRE_CASES = [("quant:4", "quant:8", None, 2), ("quant:2", "ef+topk:0.1", None, 8), ("topk:0.3", "reuse", None, 8),
              ("maxabs:4", "quant:2", hetero_stages(), 4), ("fp8", "fp8", None, 2), ("bf16", "fp8e5m2", None, 2),
              ("fp8:scaled:channel", "fp8e5m2:scaled", None, 2)]


@pytest.mark.parametrize("fwd, bwd, stages, m, schedule", [
    *((*case, "gpipe") if case in WIRE_CASES[2:4] else slow(*case, "gpipe") for case in WIRE_CASES),
    (*WIRE_CASES[1], "1f1b"), *(slow(*case, "1f1b") for case in WIRE_CASES if case != WIRE_CASES[1]),
    *(slow(*case, "1f1b-fused") for case in WIRE_CASES)])
def test_collective_permutes_carry_exactly_the_payload(fwd, bwd, stages, m, schedule):
  """Every schedule, also with M large enough that the steady ticks run in a scanned loop."""
  pipe = mlp_pipe(fwd, bwd, stages=stages, m=m)
  opt = optax.sgd(0.1)
  ex = sharded.ShardedExecutor(sharded.make_mesh(pipe.num_stages), schedule=schedules.parse(schedule))
  flat = ex.init_state(pipe, opt, jax.random.key(1), BATCH)
  sent = dryrun.collective_bytes(ex, pipe, opt, flat, BATCH)
  expected = jaxcomp.boundary_bytes(pipe, BATCH, simulate.init_state(pipe, opt, jax.random.key(1), BATCH))
  assert sent == {**expected, "data": 0}


@pytest.mark.parametrize("spec", ["proj:4", slow("subspace:4")])
def test_learned_bottleneck_sends_rank_wide_messages_in_the_compiled_program(spec):
  """The collective-permutes carry the codecs' payloads of the r-wide z and dz, as counted; `subspace`'s
  tied W (16 x 4 on both ends of each boundary) sends its gradient both ways, as counted."""
  pipe = bottleneck_pipe(spec)
  opt = optax.sgd(0.1)
  ex = sharded.ShardedExecutor(sharded.make_mesh(pipe.num_stages))
  sent = dryrun.collective_bytes(ex, pipe, opt, ex.init_state(pipe, opt, jax.random.key(1), BATCH), BATCH)
  fwd, bwd = pipe.boundary.wire_bytes((16 // 4, 4), jnp.float32)  # a microbatch of 4 examples, r = 4
  tied = {"tied": 3 * 2 * 16 * 4 * 4} if spec.startswith("subspace") else {}  # 3 boundaries, both ways, fp32
  assert sent == {"fwd": 3 * 4 * fwd, "bwd": 3 * 4 * bwd, "data": 0, **tied}  # 3 boundaries x 4 microbatches
  assert {k: v for k, v in ex.wire_bytes_per_step(pipe, BATCH).items() if k == "tied"} == tied


@pytest.mark.slow  # by hand; test_collective_permutes_carry_exactly_the_payload checks the HLO against wire_bytes
def test_quantized_bytes_are_a_fraction_of_fp32():
  opt = optax.sgd(0.1)
  ex = sharded.ShardedExecutor(sharded.make_mesh(4))
  sent = {}
  for name in ("none", "quant:4", "quant:2"):
    pipe = mlp_pipe(name, name, m=2)
    flat = ex.init_state(pipe, opt, jax.random.key(1), BATCH)
    sent[name] = dryrun.collective_bytes(ex, pipe, opt, flat, BATCH)
  messages = 3 * 2  # boundaries x microbatches
  for direction in ("fwd", "bwd"):
    dense = sent["none"][direction]
    assert dense == messages * 8 * 16 * 4
    assert sent["quant:4"][direction] == dense // 8 + messages * 8  # + fp32 (min, max) per message
    assert sent["quant:2"][direction] == dense // 16 + messages * 8


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_compressed_data_parallel_gradients():
  pipe = mlp_pipe("quant:4", "quant:8", m=2)
  opt = optax.sgd(0.1)
  mesh = sharded.make_mesh(4, data=2)
  executors = {name: sharded.ShardedExecutor(mesh, None if name == "dense" else jaxcomp.parse_scheme(name))
               for name in ("dense", "none", "ef+quant:4")}
  states, sent = {}, {}
  for name, ex in executors.items():
    state = ex.init_state(pipe, opt, jax.random.key(1), BATCH)
    sent[name] = dryrun.collective_bytes(ex, pipe, opt, state, BATCH)
    step = ex.make_train_step(pipe, opt)
    for _ in range(3):
      state, metrics = step(state, BATCH)
    states[name] = state
    assert np.isfinite(float(metrics["loss"]))
  # an identity codec over all-gather is the dense mean
  assert_trees_close(states["none"].params, states["dense"].params, 1e-6)
  assert float(jnp.abs(states["ef+quant:4"].grad_state.error).max()) > 0
  assert not np.allclose(np.asarray(states["ef+quant:4"].params), np.asarray(states["dense"].params))
  for name in ("none", "ef+quant:4"):
    assert sent[name]["data"] == executors[name].grad_wire_bytes(pipe, opt, BATCH)
  stage_rows = states["none"].params.shape[1]
  assert sent["none"]["data"] == stage_rows * 4 * 4 * 2  # 4 stages x fp32 row x 2 replicas x 1 peer
  assert sent["ef+quant:4"]["data"] == (stage_rows // 2 + 8) * 4 * 2


def test_an_executor_builds_its_state_layout_once_per_pipeline_optimizer_and_batch(monkeypatch):
  """Every method that takes (pipe, optimizer, batch) reads the one StateLayout the executor built when first bound
  to them (it is an abstract trace of the initial state); another optimizer is another binding."""
  built = []
  layout_init = sharded.StateLayout.__init__
  monkeypatch.setattr(sharded.StateLayout, "__init__", lambda self, *a, **k: built.append(layout_init(self, *a, **k)))
  pipe, opt = mlp_pipe("quant:4", "quant:8", m=2), optax.sgd(0.1)
  ex = sharded.ShardedExecutor(sharded.make_mesh(pipe.num_stages))
  state = ex.init_state(pipe, opt, jax.random.key(0), BATCH)
  state, _ = ex.make_train_step(pipe, opt)(state, BATCH)
  ex.unstack(pipe, opt, state, BATCH)
  ex.rows_description(pipe, opt, BATCH)
  ex.state_shapes(pipe, opt, BATCH)
  ex.grad_wire_bytes(pipe, opt, BATCH)
  assert len(built) == 1
  ex.state_shapes(pipe, optax.adam(0.1), BATCH)
  assert len(built) == 2


def test_clear_errors():
  with pytest.raises(ValueError, match="grad_scheme must be a Plain or EF scheme"):
    sharded.ShardedExecutor(sharded.make_mesh(2), grad_scheme=jaxcomp.parse_scheme("ef21+quant:4"))
  with pytest.raises(ValueError, match="schedule must be one of"):
    sharded.ShardedExecutor(sharded.make_mesh(2), schedule=schedules.parse("interleaved"))
  with pytest.raises(ValueError, match=r"schedule must be a `schedules.Schedule` \(e.g. schedules.OneFOneB\(\)"):
    sharded.ShardedExecutor(sharded.make_mesh(2), schedule="1f1b")
  with pytest.raises(ValueError, match="remat must be one of"):
    sharded.ShardedExecutor(sharded.make_mesh(2), remat="full")
  with pytest.raises(ValueError, match="needs 16 devices, but only 8 are available .on CPU, "
                                      "XLA_FLAGS=--xla_force_host_platform_device_count=16"):
    sharded.make_mesh(8, data=2)
  ex = sharded.ShardedExecutor(sharded.make_mesh(4))
  with pytest.raises(ValueError, match="the model has 3 stages but the mesh's stage axis has 4 devices"):
    ex.init_state(mlp_pipe("none", "none", stages=hetero_stages()), optax.sgd(0.1), jax.random.key(0), BATCH)
  with pytest.raises(ValueError, match="batch size 16 does not divide into 3 microbatches"):
    ex.init_state(mlp_pipe("none", "none", m=3), optax.sgd(0.1), jax.random.key(0), BATCH)
  ex2 = sharded.ShardedExecutor(sharded.make_mesh(2, data=3))
  with pytest.raises(ValueError, match="batch size 16 does not split over 3 data shards"):
    ex2.init_state(mlp_pipe("none", "none", stages=mlp_stages(8, 2, 2)), optax.sgd(0.1), jax.random.key(0), BATCH)


@pytest.mark.slow  # heavy: python -m pytest -m slow
@pytest.mark.parametrize("executor", ["simulate", "gpipe"])
def test_step_work_does_not_grow_with_the_aqsgd_table(executor):
  """Only a batch's rows of the per-example tables are touched: the compiled step's flops are
  the same for 16 and 4096 examples (writing rows back under autodiff used to cost O(table))."""
  ex = simulate.Simulate() if executor == "simulate" else sharded.ShardedExecutor(sharded.make_mesh(3))

  def flops(num_examples):
    pipe = jaxcomp.Pipeline(mlp_stages(64, 2, 3), jaxcomp.parse_boundary("aqsgd+quant:2", "quant:4",
                                                                        num_examples=num_examples),
                            jaxcomp.losses.classification, "x", microbatches=2)
    opt = optax.sgd(0.1)
    state = ex.init_state(pipe, opt, jax.random.key(1), BATCH)
    cost = ex.trace_step(pipe, opt, Mode.TRAIN, state, BATCH).lower().compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]

  assert flops(4096) == flops(16)


def test_state_shapes_allocate_no_optimizer_state():
  """`state_shapes` (the dry runs' state) works from shapes alone: the optimizer's state is never made
  concrete (Adam's two moments of GPT-2 XL were 12.4 GB of host memory before a compile began)."""
  made = []
  adam = optax.adam(1e-3)

  def init(params):
    state = adam.init(params)
    made.extend(leaf for leaf in jax.tree.leaves(state) if not isinstance(leaf, jax.core.Tracer))
    return state

  pipe = mlp_pipe("none", "none", stages=mlp_stages(16, 2, 4), m=2)
  shapes = sharded.ShardedExecutor(sharded.make_mesh(4, 2)).state_shapes(pipe, optax.GradientTransformation(
      init, adam.update), BATCH)
  assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(shapes))
  assert not [leaf for leaf in made if isinstance(leaf, jax.Array) and leaf.size > 1], made
