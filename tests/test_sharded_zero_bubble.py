"""ZB-H1 on the sharded executor (`ShardedExecutor(schedule=ZeroBubbleH1())`): each backward split into B (the input
gradient, sent upstream at once) and W (the weight gradient, deferred), with bitwise 1F1B's numbers (the same
arithmetic: the weight gradients summed in microbatch order), simulate's, the counted bytes, and its errors."""
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


def check_zero_bubble(pipe, opt, modes=(Mode.TRAIN,), data=1, atol=2e-6, with_simulate=True, **executor):
  """ZB-H1 against 1F1B (bitwise) and against simulate (`with_simulate`, one data shard; 1F1B equals simulate's
  numbers at any data parallelism, test_sharded and test_qadam)."""
  zero_bubble, one_f_one_b = (train_sharded(pipe, opt, modes, data=data, schedule=name, **executor)
                              for name in ("zb-h1", "1f1b"))
  jax.tree.map(np.testing.assert_array_equal, zero_bubble, one_f_one_b)
  if with_simulate and data == 1:
    compare_with_simulate(pipe, opt, 2, modes=modes, schedule="zb-h1", atol=atol)


def three_stages(fwd, bwd, m=2):
  """S = 3: stage 1 defers its W by one microbatch, so its output cotangents wait in their ring (2 slots)."""
  return mlp_pipe(fwd, bwd, stages=mlp_stages(16, 2, 3), m=m)


SCHEMES = [("quant:4", "quant:8"), ("topk:0.3", "reuse"), ("ef+topk:0.2", "ef21+quant:2"),
           ("efmixed+topk:0.3", "ef+topk:0.2")]


@pytest.mark.slow  # heavy: python -m pytest -m slow
@pytest.mark.parametrize("fwd, bwd", SCHEMES)
@pytest.mark.parametrize("stages, m", [(2, 4), (3, 2), (4, 8), (4, 2)])
def test_zero_bubble_with_every_scheme(fwd, bwd, stages, m):
  """Quantizers, TopK with index reuse, EF, EF21, EF-mixed on 2, 3 and 4 stages (M = 8: scanned steady ticks;
  M = 2 < S: W fills a short drain): losses, parameters, optimizer and link states after 2 steps bitwise
  1F1B's, and simulate's."""
  check_zero_bubble(mlp_pipe(fwd, bwd, stages=mlp_stages(16, 2, stages), m=m), optax.sgd(0.1, momentum=0.9))


def test_zero_bubble_gives_1f1bs_numbers_with_aqsgd_tables_and_topk_positions():
  """The default case (CI): AQ-SGD over TopK, index reuse backward, S = 3, M = 2: warm-up then compressed
  steps, bitwise 1F1B's (which equals simulate's, test_sharded)."""
  check_zero_bubble(three_stages("aqsgd+topk:0.3", "reuse"), optax.adam(1e-2), (Mode.WARMUP, Mode.TRAIN),
                    with_simulate=False)


@pytest.mark.slow  # heavy: python -m pytest -m slow
@pytest.mark.parametrize("fwd, bwd", [("aqsgd+topk:0.3", "reuse"), ("aqsgd+quant:2", "quant:4")])
def test_zero_bubble_keeps_aqsgd_tables(fwd, bwd):
  """AQ-SGD alone and over TopK with index reuse: warm-up, first-visit and compressed steps."""
  check_zero_bubble(three_stages(fwd, bwd), optax.adam(1e-2), (Mode.WARMUP, Mode.FIRST_VISIT, Mode.TRAIN))


@pytest.mark.slow  # heavy: python -m pytest -m slow
@pytest.mark.parametrize("spec", ["proj:4", "subspace:4"])
def test_zero_bubble_trains_a_learned_bottleneck(spec):
  """P on the sending stage, Q (or the tied W) on the receiving one: W's weight gradient reaches both."""
  learned = bottleneck.parse(spec)
  pipe = dataclasses.replace(three_stages("maxabs:4", "quant:8"), stages=bottleneck.wrap(mlp_stages(16, 2, 3), learned, 16),
                             tied=bottleneck.tied(learned, 3))
  check_zero_bubble(pipe, optax.adam(1e-2), atol=1e-5)


@pytest.mark.slow  # heavy: python -m pytest -m slow
@pytest.mark.parametrize("grad_scheme, opt, modes", [
    (None, optax.sgd(0.1), (Mode.TRAIN,)),
    ("ef+quant:4", optax.sgd(0.1), (Mode.TRAIN,)),
    ("ef+quant:4", QuantizedAdam(1e-2), (Mode.WARMUP, Mode.TRAIN))])
def test_zero_bubble_with_data_parallelism(grad_scheme, opt, modes):
  """(data=2, stage=3), M=2 per shard: the dense mean, a compressed exchange, QuantizedAdam's momentum."""
  check_zero_bubble(three_stages("ef+quant:4", "ef+fp8"), opt, modes, data=2,
                    grad_scheme=jaxcomp.parse_scheme(grad_scheme) if grad_scheme else None)


@pytest.mark.parametrize("fwd, bwd, stages, m", [("topk:0.3", "reuse", 3, 2), slow("ef+quant:2", "ef+topk:0.1", 4, 8)])
def test_zero_bubble_carries_exactly_the_payload(fwd, bwd, stages, m):
  """The compiled step's collective-permutes move each message once, as counted (`wire_bytes`): W sends nothing."""
  pipe, opt = mlp_pipe(fwd, bwd, stages=mlp_stages(16, 2, stages), m=m), optax.sgd(0.1)
  ex = sharded.ShardedExecutor(sharded.make_mesh(stages), schedule=schedules.ZeroBubbleH1())
  sent = dryrun.collective_bytes(ex, pipe, opt, ex.init_state(pipe, opt, jax.random.key(1), BATCH), BATCH)
  expected = jaxcomp.boundary_bytes(pipe, BATCH, simulate.init_state(pipe, opt, jax.random.key(1), BATCH))
  assert sent == {**expected, "data": 0}


def test_zero_bubble_refuses_no_remat():
  with pytest.raises(ValueError, match=r"the zb-h1 schedule always recomputes a stage from its stashed input"):
    sharded.ShardedExecutor(sharded.make_mesh(4), schedule=schedules.ZeroBubbleH1(), remat="none")
