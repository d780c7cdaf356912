"""Overlapped sends (a schedule with `forwarding_delay=2`): the same numbers as the plain schedule (bitwise) and as
simulate, the same bytes, and the error for too few microbatches."""
import dataclasses

import jax
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp.analysis import dryrun
from jaxcomp.compress import bottleneck
from jaxcomp.compress.boundary import Mode
from jaxcomp.models.mlp import mlp_stages
from jaxcomp.parallel import schedules, sharded, simulate
from jaxcomp.parallel.qadam import QuantizedAdam

from pipeline_cases import BATCH, compare_with_simulate, mlp_pipe, slow, train_sharded


def check_overlap(pipe, opt, schedule, modes=(Mode.TRAIN,), data=1, atol=2e-6, with_simulate=True, **executor):
  """Overlapped sends against the plain schedule (bitwise: the same arithmetic, op by op) and against simulate
  (`with_simulate`; the plain schedule equals simulate's numbers, test_sharded, so the default cases skip it)."""
  plain, overlapped = (train_sharded(pipe, opt, modes, data=data, schedule=schedule, overlap=overlap, **executor)
                        for overlap in (False, True))
  jax.tree.map(np.testing.assert_array_equal, overlapped, plain)
  if with_simulate and data == 1:
    compare_with_simulate(pipe, opt, 2, modes=modes, schedule=schedule, overlap=True, atol=atol)


def two_stages(fwd, bwd, m=4):
  return mlp_pipe(fwd, bwd, stages=mlp_stages(16, 2, 2), m=m)


# S = 2, M = 4 (one boundary, every tick kind); S = 4, M = 8 (three boundaries, scanned steady ticks) with -m slow
SCHEMES = [("quant:4", "quant:8"), ("topk:0.3", "reuse"), ("ef+topk:0.2", "ef21+quant:2"),
           ("efmixed+topk:0.3", "ef+topk:0.2")]


def test_overlapped_sends_give_the_plain_schedules_numbers_bitwise():
  """The default case (CI): EF forward TopK, EF21 backward quantizer on ZB-H1 (B sends at once, W deferred),
  against the plain schedule."""
  check_overlap(two_stages("ef+topk:0.2", "ef21+quant:2"), optax.sgd(0.1, momentum=0.9), "zb-h1", with_simulate=False)


@pytest.mark.slow  # heavy: python -m pytest -m slow
@pytest.mark.parametrize("fwd, bwd, schedule", [(*scheme, name) for scheme in SCHEMES for name in schedules.SCHEDULES])
def test_overlapped_sends_give_the_plain_schedules_and_simulates_numbers(fwd, bwd, schedule):
  """Quantizers, TopK with index reuse, EF, EF21, EF-mixed: losses, parameters, optimizer and link states after 2
  steps bitwise those without overlap, and simulate's."""
  check_overlap(two_stages(fwd, bwd), optax.sgd(0.1, momentum=0.9), schedule)


@pytest.mark.slow  # heavy: python -m pytest -m slow
@pytest.mark.parametrize("fwd, bwd, schedule", [(*scheme, name) for scheme in SCHEMES for name in schedules.SCHEDULES])
def test_overlapped_sends_on_four_stages(fwd, bwd, schedule):
  check_overlap(mlp_pipe(fwd, bwd, m=8), optax.sgd(0.1, momentum=0.9), schedule)


def test_overlapped_sends_keep_aqsgd_tables_and_topk_positions_bitwise():
  """The default case (CI): AQ-SGD over TopK, index reuse backward, on GPipe (compressed steps from zero tables)."""
  check_overlap(two_stages("aqsgd+topk:0.3", "reuse"), optax.adam(1e-2), "gpipe", with_simulate=False)


@pytest.mark.slow  # heavy: python -m pytest -m slow
@pytest.mark.parametrize("fwd, bwd, schedule, modes", [
    ("aqsgd+topk:0.3", "reuse", "1f1b", (Mode.WARMUP, Mode.TRAIN)),
    ("aqsgd+topk:0.3", "reuse", "gpipe", (Mode.WARMUP, Mode.FIRST_VISIT, Mode.TRAIN)),
    ("aqsgd+quant:2", "quant:4", "gpipe", (Mode.WARMUP, Mode.FIRST_VISIT, Mode.TRAIN)),
    ("aqsgd+quant:2", "quant:4", "1f1b-fused", (Mode.WARMUP, Mode.FIRST_VISIT, Mode.TRAIN)),
    ("aqsgd+topk:0.3", "reuse", "zb-h1", (Mode.WARMUP, Mode.FIRST_VISIT, Mode.TRAIN))])
def test_overlapped_sends_keep_aqsgd_tables(fwd, bwd, schedule, modes):
  """AQ-SGD (alone and with TopK and index reuse): warm-up, first-visit and compressed steps; each end's
  per-example table row moves at its own end's tick (the sender's at the encode, the receiver's at the decode)."""
  check_overlap(two_stages(fwd, bwd), optax.adam(1e-2), schedule, modes)


@pytest.mark.slow  # heavy: python -m pytest -m slow
@pytest.mark.parametrize("spec, schedule", [("proj:4", "1f1b"), ("subspace:4", "gpipe"), ("subspace:4", "1f1b-fused"),
                                           ("proj:4", "zb-h1")])
def test_overlapped_sends_train_a_learned_bottleneck(spec, schedule):
  learned = bottleneck.parse(spec)
  pipe = dataclasses.replace(two_stages("maxabs:4", "quant:8"), stages=bottleneck.wrap(mlp_stages(16, 2, 2), learned, 16),
                             tied=bottleneck.tied(learned, 2))
  check_overlap(pipe, optax.adam(1e-2), schedule, atol=1e-5)


@pytest.mark.slow  # heavy: python -m pytest -m slow
@pytest.mark.parametrize("schedule, grad_scheme, opt, modes", [
    ("1f1b", None, optax.sgd(0.1), (Mode.TRAIN,)), ("zb-h1", None, optax.sgd(0.1), (Mode.TRAIN,)),
    ("gpipe", "ef+quant:4", optax.sgd(0.1), (Mode.TRAIN,)), ("zb-h1", "ef+quant:4", optax.sgd(0.1), (Mode.TRAIN,)),
    ("1f1b-fused", "ef+quant:4", QuantizedAdam(1e-2), (Mode.WARMUP, Mode.TRAIN)),
    ("zb-h1", "ef+quant:4", QuantizedAdam(1e-2), (Mode.WARMUP, Mode.TRAIN))])
def test_overlapped_sends_with_data_parallelism(schedule, grad_scheme, opt, modes):
  """(data=2, stage=2), M=4 per shard, the dense mean, a compressed exchange, QuantizedAdam's momentum: bitwise
  the plain schedule's (which equals simulate's, test_sharded, test_qadam)."""
  check_overlap(two_stages("ef+quant:4", "ef+fp8"), opt, schedule, modes, data=2,
                grad_scheme=jaxcomp.parse_scheme(grad_scheme) if grad_scheme else None)


@pytest.mark.parametrize("fwd, bwd, schedule, stages, m", [("topk:0.3", "reuse", "1f1b", 2, 4),
                                                           slow("quant:2", "ef+topk:0.1", "gpipe", 4, 8),
                                                           slow("maxabs:4", "quant:2", "1f1b-fused", 4, 8),
                                                           slow("ef+quant:2", "ef+topk:0.1", "zb-h1", 4, 8)])
def test_overlapped_sends_carry_exactly_the_payload(fwd, bwd, schedule, stages, m):
  """The compiled step's collective-permutes move each message once, as counted (`wire_bytes`)."""
  pipe, opt = mlp_pipe(fwd, bwd, stages=mlp_stages(16, 2, stages), m=m), optax.sgd(0.1)
  ex = sharded.ShardedExecutor(sharded.make_mesh(stages), schedule=schedules.parse(schedule, overlap=True))
  sent = dryrun.collective_bytes(ex, pipe, opt, ex.init_state(pipe, opt, jax.random.key(1), BATCH), BATCH)
  expected = jaxcomp.boundary_bytes(pipe, BATCH, simulate.init_state(pipe, opt, jax.random.key(1), BATCH))
  assert sent == {**expected, "data": 0}


def test_overlap_needs_2s_microbatches_and_the_explicit_backward():
  pipe, opt = mlp_pipe("quant:4", "quant:8", m=4), optax.sgd(0.1)
  ex = sharded.ShardedExecutor(sharded.make_mesh(4), schedule=schedules.parse("gpipe", overlap=True))
  with pytest.raises(ValueError, match=r"need at least 2S microbatches per data shard: got M=4 for S=4 stages; use "
                                       r"--microbatches 8 \(or more\), or drop --overlap"):
    ex.init_state(pipe, opt, jax.random.key(1), BATCH)
  with pytest.raises(ValueError, match=r"overlapped sends run the explicit backward \(remat='stage'\)"):
    sharded.ShardedExecutor(sharded.make_mesh(4), remat="none", schedule=schedules.parse("gpipe", overlap=True))
