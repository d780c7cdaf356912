"""Interleaved 1F1B on the sharded executor (`ShardedExecutor(schedule=Interleaved(V))`): V chunks per device,
chunk c on device c mod S, its boundaries on a ring, each with its own compression state; bitwise 1F1B's
numbers on an S V-device mesh (the same arithmetic: each chunk's weight gradients summed in microbatch order),
simulate's, and its errors."""
import dataclasses

import jax
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp.analysis import dryrun, hlo_bytes
from jaxcomp.compress.boundary import Mode
from jaxcomp.models.mlp import mlp_stages
from jaxcomp.parallel import schedules, sharded, simulate
from jaxcomp.parallel.qadam import QuantizedAdam

from pipeline_cases import (BATCH, assert_trees_close, bottleneck_pipe, compare_with_simulate, mlp_pipe, train_sharded)


def check_interleaved(fwd, bwd, devices, chunks, m, data=1, modes=(Mode.TRAIN,), opt=optax.sgd(0.1, momentum=0.9),
                      evals=False):
  """interleaved:V on `devices` against 1F1B on devices V, bit for bit (losses, parameters, optimizer and link
  states; `evals`: then eval losses, compressed and not), and against simulate (D shards of M microbatches:
  simulate's M D)."""
  pipe = mlp_pipe(fwd, bwd, stages=mlp_stages(16, 2, devices * chunks), m=m)
  losses, state = train_sharded(pipe, opt, modes, data=data, stage_devices=devices, evals=evals,
                                schedule=f"interleaved:{chunks}")
  jax.tree.map(np.testing.assert_array_equal, (losses, state),
               train_sharded(pipe, opt, modes, data=data, evals=evals, schedule="1f1b"))
  sim_pipe = mlp_pipe(fwd, bwd, stages=mlp_stages(16, 2, devices * chunks), m=m * data)
  sim = simulate.init_state(sim_pipe, opt, jax.random.key(1), BATCH)
  sim_losses = []
  for mode in modes:
    step = simulate.make_train_step(sim_pipe, opt, mode)
    for _ in range(2):
      sim, metrics = step(sim, BATCH)
      sim_losses.append(float(metrics["loss"]))
  sim_losses += [float(simulate.make_eval_step(sim_pipe, c)(sim, BATCH)["loss"]) for c in (True, False)[:2 * evals]]
  np.testing.assert_allclose(np.asarray(losses, np.float64), sim_losses, rtol=1e-5)
  assert_trees_close(state.params, sim.params, atol=2e-6)
  assert_trees_close(state.opt_state, sim.opt_state, atol=2e-6)
  if data == 1 or not pipe.boundary.fwd.keyed_by_example:
    assert_trees_close(state.links, sim.links, atol=2e-6)


@pytest.mark.slow  # heavy: python -m pytest -m slow (by default test_interleaved_trains_evaluates_and_sends_what_is_counted)
@pytest.mark.parametrize("fwd, bwd, devices, chunks, m, data", [
    ("ef+topk:0.2", "ef21+quant:2", 2, 2, 4, 1), ("topk:0.3", "reuse", 2, 2, 2, 2), ("none", "none", 2, 2, 4, 1),
    ("quant:4", "quant:8", 2, 2, 2, 2), ("topk:0.3", "reuse", 2, 2, 4, 1), ("ef+quant:4", "ef+fp8", 4, 2, 4, 1),
    ("quant:4", "quant:8", 2, 3, 4, 1)])
def test_interleaved_matches_1f1b_and_simulate(fwd, bwd, devices, chunks, m, data):
  """Stateless and stateful (EF, EF21, TopK index reuse) boundaries, dense data parallelism: simulate's and
  1F1B's bit for bit."""
  check_interleaved(fwd, bwd, devices, chunks, m, data)


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_interleaved_aqsgd_warmup_first_visit_and_compressed():
  check_interleaved("aqsgd+quant:2", "quant:4", 2, 2, 2, modes=(Mode.WARMUP, Mode.FIRST_VISIT, Mode.TRAIN),
                    opt=optax.adam(1e-2))


@pytest.mark.slow  # heavy: python -m pytest -m slow (by default test_interleaved_trains_evaluates_and_sends_what_is_counted)
@pytest.mark.parametrize("fwd, bwd, devices, chunks, overlap", [("topk:0.3", "reuse", 2, 2, False),
                                                                ("quant:2", "ef+topk:0.1", 2, 3, False),
                                                                ("topk:0.3", "reuse", 2, 2, True)])
def test_interleaved_collective_permutes_carry_exactly_the_payload(fwd, bwd, devices, chunks, overlap):
  """The compiled step's collective-permutes move each message of every boundary once (the ring's
  wrap-around ones from device S-1 to 0 too), as counted (`wire_bytes`), M = 4: scanned ticks; with
  overlapped sends too."""
  pipe, opt = mlp_pipe(fwd, bwd, stages=mlp_stages(16, 2, devices * chunks), m=4), optax.sgd(0.1)
  ex = sharded.ShardedExecutor(sharded.make_mesh(devices), schedule=schedules.parse(f"interleaved:{chunks}", overlap))
  sent = dryrun.collective_bytes(ex, pipe, opt, ex.init_state(pipe, opt, jax.random.key(1), BATCH), BATCH)
  expected = jaxcomp.boundary_bytes(pipe, BATCH, simulate.init_state(pipe, opt, jax.random.key(1), BATCH))
  assert sent == {**expected, "data": 0}


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_init_state_puts_chunk_c_on_device_c_mod_s():
  """Each device initialises its chunks d, d+S, ... ([S, V, P] rows, [S, V, D*rows, F] link tables) =
  simulate's init, stacked."""
  pipe, opt = mlp_pipe("ef+quant:4", "ef21+quant:4", stages=mlp_stages(16, 2, 4), m=2), optax.adam(1e-2)
  ex = sharded.ShardedExecutor(sharded.make_mesh(2, data=2), schedule=schedules.Interleaved(2))
  flat = ex.init_state(pipe, opt, jax.random.key(1), BATCH)
  simulated = simulate.init_state(pipe, opt, jax.random.key(1), BATCH)
  assert_trees_close(flat._replace(rng=()), ex.stack(pipe, opt, simulated, BATCH)._replace(rng=()), 0)
  assert flat.params.shape[:2] == (2, 2) and flat.links.fwd_send.error.ndim == 4
  assert_trees_close(ex.unstack(pipe, opt, flat, BATCH).params[1], simulated.params[1], 0)
  assert_trees_close(flat.params[1, 0], ex.state_layout(pipe, opt, BATCH).params.put(1, simulated.params[1]), 0)


def test_interleaved_errors_name_the_value_and_the_fix():
  opt = optax.sgd(0.1)
  ex = sharded.ShardedExecutor(sharded.make_mesh(2), schedule=schedules.Interleaved(2))
  with pytest.raises(ValueError, match=r"the model has 2 stages but the mesh's stage axis has 2 devices x 2 chunks"):
    ex.make_train_step(mlp_pipe("none", "none", stages=mlp_stages(16, 2, 2), m=2), opt)
  with pytest.raises(ValueError, match=r"multiple of the stages, got M=3 for S=2 \(use M = 4\)"):
    ex.make_train_step(mlp_pipe("none", "none", stages=mlp_stages(16, 2, 4), m=3), opt)
  with pytest.raises(ValueError, match=r"or interleaved:V \(V >= 1 chunks per device\), got 'interleaved:0'"):
    sharded.ShardedExecutor(sharded.make_mesh(2), schedule=schedules.parse("interleaved:0"))
  with pytest.raises(ValueError, match=r"need at least 2S microbatches per data shard: got M=2 for S=2 stages"):
    overlapped = schedules.Interleaved(2, forwarding_delay=2)
    sharded.ShardedExecutor(sharded.make_mesh(2), schedule=overlapped).make_train_step(
        mlp_pipe("none", "none", stages=mlp_stages(16, 2, 4), m=2), opt)


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_interleaved_eval_steps_match_simulate():
  """Eval steps, compressed and not (they differ), from simulate's initial state: simulate's losses (the
  forwards of interleaved GPipe, `Interleaved.eval_table`, each boundary its
  stateless codec)."""
  pipe, opt = mlp_pipe("ef+quant:2", "quant:8", stages=mlp_stages(16, 2, 4), m=4), optax.sgd(0.1)
  losses, _ = train_sharded(pipe, opt, steps=0, evals=True, stage_devices=2, schedule="interleaved:2")
  sim = simulate.init_state(pipe, opt, jax.random.key(1), BATCH)
  np.testing.assert_allclose(losses, [simulate.make_eval_step(pipe, c)(sim, BATCH)["loss"] for c in (True, False)],
                             rtol=1e-6)
  assert losses[0] != losses[1]


@pytest.mark.slow  # heavy: python -m pytest -m slow
@pytest.mark.parametrize("fwd, bwd", [("ef+quant:4", "quant:8"), ("topk:0.3", "reuse"), ("aqsgd+quant:2", "quant:4")])
def test_interleaved_eval_steps_after_training(fwd, bwd):
  """Eval steps (compressed and not) after two train steps: bitwise 1F1B's on S V devices, simulate's."""
  check_interleaved(fwd, bwd, 2, 2, 2, evals=True)


def test_interleaved_trains_evaluates_and_sends_what_is_counted():
  """The default case: 2 devices x 2 chunks, M = 4 (scanned ticks), stateful boundaries (EF, EF21: each
  boundary its own rows), tied parameters of chunks on two devices (1 and 2: slot 0 of device 1, slot 1 of
  device 0) and on one (1 and 3: device 1's two slots), global-norm clipping over every chunk. Initialised
  sharded: simulate's init; the compiled step's collectives carry the counted bytes (the wrap-around link's
  too; the tied pair on one device sends nothing); two steps, then eval steps (compressed and not, which
  differ): simulate's losses and states, the ties equal bit for bit."""
  tied = (((1, ("Dense_0", "kernel")), (2, ("Dense_0", "kernel"))), ((1, ("Dense_0", "bias")), (3, ("Dense_0", "bias"))))
  pipe = dataclasses.replace(mlp_pipe("ef+quant:4", "ef21+quant:2", m=4), tied=tied, grad_clip_norm=0.05)
  opt = optax.sgd(0.5, momentum=0.9)
  ex = sharded.ShardedExecutor(sharded.make_mesh(2), schedule=schedules.Interleaved(2))
  state = simulate.init_state(pipe, opt, jax.random.key(1), BATCH)
  flat = ex.init_state(pipe, opt, jax.random.key(1), BATCH)
  assert_trees_close(flat._replace(rng=()), ex.stack(pipe, opt, state, BATCH)._replace(rng=()), 0)
  kernel = np.asarray(state.params[1]["Dense_0"]["kernel"])
  step = ex.trace_step(pipe, opt, Mode.TRAIN, flat, BATCH).lower().compile()
  assert ex.wire_bytes_per_step(pipe, BATCH)["tied"] == 2 * 16 * 16 * 4  # the kernel both ways, not the bias
  assert hlo_bytes.collective_bytes(step.as_text(), 2) == {**ex.wire_bytes_per_step(pipe, BATCH), "data": 0}
  sim_step = simulate.make_train_step(pipe, opt)
  for _ in range(2):
    state, sim_metrics = sim_step(state, BATCH)
    flat, metrics = step(flat, BATCH)
    np.testing.assert_allclose(metrics["loss"], sim_metrics["loss"], rtol=1e-6)
  back = ex.unstack(pipe, opt, flat, BATCH)
  for part in ("params", "opt_state", "links"):
    assert_trees_close(getattr(back, part), getattr(state, part), 2e-6)
  assert np.abs(np.asarray(back.params[1]["Dense_0"]["kernel"]) - kernel).max() > 1e-3  # trained
  for (sa, pa), (sb, pb) in tied:
    np.testing.assert_array_equal(np.asarray(back.params[sa][pa[0]][pa[1]]), np.asarray(back.params[sb][pb[0]][pb[1]]))
  evals = [ex.make_eval_step(pipe, compressed)(flat, BATCH)["loss"] for compressed in (True, False)]
  np.testing.assert_allclose(evals, [simulate.make_eval_step(pipe, c)(state, BATCH)["loss"] for c in (True, False)],
                             rtol=1e-6)
  assert evals[0] != evals[1]


@pytest.mark.slow  # heavy: python -m pytest -m slow
@pytest.mark.parametrize("spec", ["proj:4", "subspace:4"])
def test_interleaved_learned_bottleneck_matches_simulate(spec):
  """P on a boundary's sending chunk, Q (or the tied W: chunks b and b+1 on two devices) on its receiving one."""
  compare_with_simulate(bottleneck_pipe(spec), optax.adam(1e-2), steps=2, schedule="interleaved:2", stage_devices=2,
                        atol=1e-5)


@pytest.mark.slow  # heavy: python -m pytest -m slow
@pytest.mark.parametrize("opt, modes", [(optax.sgd(0.1, momentum=0.9), (Mode.TRAIN,)),
                                        (QuantizedAdam(1e-2), (Mode.WARMUP, Mode.TRAIN))])
def test_interleaved_compressed_data_parallel_matches_1f1b(opt, modes):
  """A compressed data-parallel exchange (`ef+quant:4`: gradients, or QuantizedAdam's first moment after its
  warm-up), each chunk with its own error rows and keys: bitwise 1F1B's on S V devices (losses, parameters,
  optimizer state, error rows)."""
  pipe = mlp_pipe("quant:4", "quant:8", stages=mlp_stages(16, 2, 4), m=2)
  run = lambda **ex: train_sharded(pipe, opt, modes, data=2, grad_scheme=jaxcomp.parse_scheme("ef+quant:4"), **ex)
  losses, state = run(stage_devices=2, schedule="interleaved:2")
  jax.tree.map(np.testing.assert_array_equal, (losses, state), run(schedule="1f1b"))
  assert all(np.abs(np.asarray(error)).max() > 0 for error in jax.tree.leaves(state.grad_state))


@pytest.mark.slow  # heavy: python -m pytest -m slow
@pytest.mark.parametrize("fwd, bwd", [("ef+topk:0.2", "ef21+quant:2"), ("topk:0.3", "reuse"), ("aqsgd+quant:2", "quant:4")])
def test_interleaved_overlapped_sends_give_its_numbers_bitwise(fwd, bwd):
  """overlapped sends (each message two ticks, `Interleaved(2, forwarding_delay=2)`): losses and states after 2 steps
  bitwise those without overlap, and simulate's (its evals too)."""
  pipe, opt = mlp_pipe(fwd, bwd, stages=mlp_stages(16, 2, 4), m=4), optax.sgd(0.1, momentum=0.9)
  plain, overlapped = (train_sharded(pipe, opt, stage_devices=2, schedule="interleaved:2", overlap=overlap)
                       for overlap in (False, True))
  jax.tree.map(np.testing.assert_array_equal, overlapped, plain)
  compare_with_simulate(pipe, opt, 2, schedule="interleaved:2", overlap=True, stage_devices=2)


@pytest.mark.slow  # heavy: python -m pytest -m slow
@pytest.mark.parametrize("spec", ["proj:4", "subspace:4"])
def test_interleaved_overlapped_sends_train_a_learned_bottleneck(spec):
  """`overlap=True` with P on each boundary's sending chunk and Q (or the tied W) on its receiving one: bitwise the
  plain interleaved run's, and simulate's."""
  pipe, opt = bottleneck_pipe(spec), optax.adam(1e-2)
  plain, overlapped = (train_sharded(pipe, opt, stage_devices=2, schedule="interleaved:2", overlap=overlap)
                       for overlap in (False, True))
  jax.tree.map(np.testing.assert_array_equal, overlapped, plain)
  compare_with_simulate(pipe, opt, 2, schedule="interleaved:2", overlap=True, stage_devices=2, atol=1e-5)


@pytest.mark.slow  # heavy: python -m pytest -m slow
@pytest.mark.parametrize("grad_scheme, opt, modes", [(None, optax.sgd(0.1), (Mode.TRAIN,)),
                                                     ("ef+quant:4", optax.sgd(0.1), (Mode.TRAIN,)),
                                                     ("ef+quant:4", QuantizedAdam(1e-2), (Mode.WARMUP, Mode.TRAIN))])
def test_interleaved_overlapped_sends_with_data_parallelism(grad_scheme, opt, modes):
  """(data=2, stage=2), V=2, M=4 per shard: the dense mean, a compressed exchange, QuantizedAdam's momentum, with
  `overlap=True`: bitwise the plain interleaved run's (which is 1F1B's on S V devices, the tests above)."""
  pipe = mlp_pipe("ef+quant:4", "ef+fp8", stages=mlp_stages(16, 2, 4), m=4)
  grads = jaxcomp.parse_scheme(grad_scheme) if grad_scheme else None
  plain, overlapped = (train_sharded(pipe, opt, modes, data=2, stage_devices=2, schedule="interleaved:2",
                                     overlap=overlap, grad_scheme=grads) for overlap in (False, True))
  jax.tree.map(np.testing.assert_array_equal, overlapped, plain)
