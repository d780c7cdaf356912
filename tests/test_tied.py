"""Tied parameters: the compressed tied exchange (`pipeline.tie_grads`, `pipeline.tied_member_total`) on both
executors, initial copies, and the tied and data-parallel exchanges' bytes in the compiled program."""
import dataclasses

import jax
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp.analysis import dryrun
from jaxcomp.compress.boundary import Mode
from jaxcomp.models import gpt2
from jaxcomp.parallel import schedules, sharded
from jaxcomp.runtime import checkpoint
from pipeline_cases import BATCH, compare_with_simulate, mlp_pipe, slow, train_sharded

KERNEL = ("Dense_0", "kernel")
TIED = (((1, KERNEL), (2, KERNEL)),)  # stage 1's first kernel and stage 2's: [16, 16] on devices 1 and 2
BLOCKS = "ef+maxabs:4:group=64:scales=group"  # 4-bit codes, one scale per 64 entries


def tied_pipe(scheme, m=2, **changes):
  return dataclasses.replace(mlp_pipe("quant:4", "quant:8", m=m), tied=TIED, grad_clip_norm=0.05,
                             tied_scheme=scheme and jaxcomp.parse_scheme(scheme), **changes)


@pytest.mark.parametrize("scheme, data", [slow("ef+quant:4", 1), slow(BLOCKS, 1), ("ef+maxabs:2:tensor:stoch", 2)])
def test_compressed_tied_copies_stay_bitwise_equal(scheme, data):
  """Three steps with the tied exchange compressed: both copies took the same update (bitwise), which is not the
  dense exchange's; each member's EF error is non-zero, on its own device only, the same on every replica."""
  opt = optax.adam(1e-2)
  _, state = train_sharded(tied_pipe(scheme), opt, steps=3, data=data)
  _, dense = train_sharded(tied_pipe(None), opt, steps=3, data=data)
  a, b = state.params[1]["Dense_0"]["kernel"], state.params[2]["Dense_0"]["kernel"]
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert np.abs(np.asarray(a) - np.asarray(dense.params[1]["Dense_0"]["kernel"])).max() > 1e-4
  (error_a, error_b), = state.tied_state
  for error in (error_a.error, error_b.error):  # [D, 256]: each replica's
    assert error.shape == (data, 256) and np.abs(np.asarray(error)).max() > 0
    np.testing.assert_array_equal(np.asarray(error[0]), np.asarray(error[-1]))


@pytest.mark.parametrize("scheme, data, schedule", [
    ("ef+maxabs:4:tensor:stoch", 1, "gpipe"), slow(BLOCKS, 1, "1f1b"), slow("ef+topk:0.2", 2, "gpipe"),
    slow("quant:4", 1, "zb-h1")])
def test_compressed_tied_exchange_matches_simulate(scheme, data, schedule):
  """The same arithmetic on one device (simulate: both members' messages, their sum) and across the mesh: the same
  losses, parameters and tied-exchange states (`compare_with_simulate`)."""
  compare_with_simulate(tied_pipe(scheme), optax.sgd(0.5), steps=3, data=data, schedule=schedule,
                        sim_pipe=tied_pipe(scheme, m=2 * data))


@pytest.mark.parametrize("scheme, data, grad", [
    (None, 1, None), ("ef+quant:4", 1, None), (BLOCKS, 2, None), slow(None, 2, "ef+quant:4"),
    slow("ef+topk:0.2", 2, "none")])
def test_tied_and_data_exchange_bytes_match_the_compiled_program(scheme, data, grad):
  """Every way the executor counts (`wire_bytes_per_step`: pipeline messages, the tied exchange, the data-parallel
  exchange dense or compressed) is what its compiled step's collectives send (`dryrun.collective_bytes`)."""
  pipe, opt = tied_pipe(scheme), optax.sgd(0.1)
  ex = sharded.ShardedExecutor(sharded.make_mesh(4, data), grad and jaxcomp.parse_scheme(grad))
  counted = ex.wire_bytes_per_step(pipe, BATCH)
  sent = dryrun.collective_bytes(ex, pipe, opt, ex.init_state(pipe, opt, jax.random.key(1), BATCH), BATCH)
  assert sent == {**counted, "data": counted.get("data", 0)}
  segment = 16 * 16  # the tied kernel's entries
  message = 4 * segment if scheme is None else pipe.tied_scheme.wire_bytes((1, segment), np.float32)
  assert counted["tied"] == data * 2 * message  # each replica's two members, one message each way
  if data > 1:
    row = ex.init_state(pipe, opt, jax.random.key(1), BATCH).params.shape[1]  # the padded stage row
    dense = 4 * 2 * (data - 1) * row * 4  # 4 stages: a ring all-reduce of the fp32 row over the replicas
    assert counted["data"] == (dense if grad is None else ex.grad_wire_bytes(pipe, opt, BATCH))


def test_untied_copies_start_equal_and_train_apart():
  """`init_copies`: the second member starts as the first's copy (on the executor's own initialisation too), then
  trains on its own gradient: nothing is tied and nothing is exchanged."""
  pipe, opt = mlp_pipe("quant:4", "quant:8"), optax.sgd(0.5)
  pipe = dataclasses.replace(pipe, init_copies=TIED)
  ex = sharded.ShardedExecutor(sharded.make_mesh(4))
  flat = ex.init_state(pipe, opt, jax.random.key(1), BATCH)
  start = ex.unstack(pipe, opt, flat, BATCH)
  kernel = lambda state, s: np.asarray(state.params[s]["Dense_0"]["kernel"])
  np.testing.assert_array_equal(kernel(start, 1), kernel(start, 2))
  assert "tied" not in ex.wire_bytes_per_step(pipe, BATCH)
  assert "tied" not in dryrun.collective_bytes(ex, pipe, opt, flat, BATCH)
  flat, _ = ex.make_train_step(pipe, opt)(flat, BATCH)
  after = ex.unstack(pipe, opt, flat, BATCH)
  assert np.abs(kernel(after, 1) - kernel(after, 2)).max() > 1e-4


def test_gpt2_tied_exchange_is_counted_both_ways():
  """Tiny GPT-2 on 4 stages: the embedding's gradient (257 x 64 fp32) each way, the issue's 131,584 B per step."""
  cfg = gpt2.GPT2Config.tiny()
  tokens = {"tokens": np.zeros((4, 16), np.int32), "id": np.arange(4)}
  pipe = jaxcomp.Pipeline(gpt2.gpt2_stages(cfg, 4), jaxcomp.parse_boundary("none", "none"),
                          jaxcomp.losses.language_model, "tokens", 2, tied=gpt2.gpt2_tied(4))
  ex = sharded.ShardedExecutor(sharded.make_mesh(4))
  assert ex.wire_bytes_per_step(pipe, tokens)["tied"] == 2 * 257 * 64 * 4 == 131_584
  lay = ex.state_layout(pipe, None, tokens)
  assert [(m.ends, m.nbytes) for m in lay.tied_messages()] == [((0, 3), 257 * 64 * 4)]


def test_a_checkpoint_keeps_the_tied_exchanges_errors(tmp_path):
  """Saved as the executor's rows, restored in the simulate layout: each member's [D, n] error, as unstacked."""
  pipe, opt = tied_pipe("ef+quant:4"), optax.sgd(0.5)
  ex = sharded.ShardedExecutor(sharded.make_mesh(4, 2))
  flat = ex.init_state(pipe, opt, jax.random.key(1), BATCH)
  flat, _ = ex.make_train_step(pipe, opt)(flat, BATCH)
  expected = checkpoint.simulate_layout(ex, pipe, opt, flat, BATCH)
  ckpt = checkpoint.Checkpointer(tmp_path)
  ckpt.save(1, flat, {"epoch": 1}, layout=ex.rows_description(pipe, opt, BATCH))
  like = jax.eval_shape(lambda s: ex.unstack(pipe, opt, s, BATCH), flat)
  restored, _ = ckpt.restore(1, like)
  ckpt.close()
  assert np.abs(np.asarray(expected.tied_state[0][0].error)).max() > 0
  for got, want in zip(jax.tree.leaves(restored.tied_state), jax.tree.leaves(expected.tied_state)):
    np.testing.assert_array_equal(np.asarray(got), want)
  again = checkpoint.executor_layout(ex, pipe, opt, restored, BATCH, flat)
  for got, want in zip(jax.tree.leaves(again.tied_state), jax.tree.leaves(flat.tied_state)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_tied_scheme_errors():
  with pytest.raises(ValueError, match="tied exchange's scheme must be a Plain or EF scheme"):
    tied_pipe("ef21+quant:4")
  pipe = tied_pipe("ef+quant:4")
  ex = sharded.ShardedExecutor(sharded.make_mesh(2), schedule=schedules.Interleaved(chunks=2))  # chunks 1 and 2 on devices 1, 0
  ex._check(pipe)
  one_device = dataclasses.replace(pipe, tied=(((0, KERNEL), (2, KERNEL)),))  # chunks 0 and 2 on device 0
  with pytest.raises(ValueError, match=r"tied pairs of stages \[\(0, 2\)\] are held by one stage device"):
    ex.make_train_step(one_device, optax.sgd(0.1), Mode.TRAIN)
