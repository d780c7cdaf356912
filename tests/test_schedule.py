"""jaxcomp.parallel.schedule: what each schedule holds and when each stage runs."""
import optax
import pytest

from jaxcomp.compress.boundary import Mode
from jaxcomp.models.mlp import mlp_stages
from jaxcomp.parallel import schedule as sched
from jaxcomp.parallel import sharded
from pipeline_cases import BATCH, mlp_pipe


@pytest.mark.parametrize("name, most", [("1f1b", lambda s, S, M: min(M, S - s)),
                                        ("1f1b-fused", lambda s, S, M: min(M, 2 * (S - s) - 1)),
                                        ("gpipe", lambda s, S, M: M)])
def test_schedule_holds_at_most_its_inputs_per_stage(name, most):
  """PipeDream-flush: stage s holds S - s microbatch inputs at most, whatever M (the fused
  variant 2(S-s)-1, GPipe all M); a microbatch reaches stage s+1 the tick after stage s and
  its gradient reaches s the tick after s+1; 1f1b runs one op per stage per tick."""
  for S in range(1, 9):
    for M in range(1, 20):
      pipe = mlp_pipe("quant:4", "quant:8", stages=mlp_stages(16, 2, S), m=M)
      prog = sched.Program(pipe, None, None, [], Mode.TRAIN, True, None, sched.timing(name, S, M))
      ticks = range(sched.total_ticks(prog))
      assert [max(sched.in_flight(prog, s, t) for t in ticks) for s in range(S)] == [most(s, S, M) for s in range(S)]
      stride = prog.timing.stride
      for s in range(S - 1):
        assert sched.backward_tick(prog, s) == sched.backward_tick(prog, s + 1) + 1 > s + 1
      if name == "1f1b":
        assert not any(sched.busy(prog, t, s) and sched.busy(prog, t, sched.backward_tick(prog, s))
                       for t in ticks for s in range(S))
        assert len(ticks) == stride * (M + S - 1)


def test_an_unrolled_tick_holds_only_the_stages_busy_at_it():
  """GPipe with one microbatch runs one stage per tick: its program holds each stage's body a fixed
  number of times, so it grows linearly in S (a switch over all S stages at each of the S ticks grew as S^2:
  GPT-2 small on 8 stages lowered to 6.8 MB of StableHLO and passed 10 GB of host memory compiling for TPU)."""
  dots = {}
  for S in (2, 4, 8):
    pipe = mlp_pipe("none", "none", stages=mlp_stages(16, 2, S), m=1)
    ex = sharded.ShardedExecutor(sharded.make_mesh(S, 1))
    state = ex.state_shapes(pipe, optax.sgd(0.1), BATCH)
    dots[S] = ex.trace_step(pipe, optax.sgd(0.1), Mode.TRAIN, state, BATCH).lower().as_text().count("dot_general")
  assert dots[8] - dots[4] == 2 * (dots[4] - dots[2]), dots
