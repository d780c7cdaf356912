"""jaxcomp.parallel.stage_runner: what each schedule's table holds and what its program compiles to."""
import jax
import optax
import pytest

from jaxcomp.compress.boundary import Mode
from jaxcomp.models.mlp import mlp_stages
from jaxcomp.parallel import schedules, sharded, timetable
from jaxcomp.parallel.plan import Plan
from jaxcomp.parallel.timetable import Op
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
      table = schedules.parse(name).train_table(S, M)
      ticks = range(table.ticks)
      assert [max(timetable.inputs_held(table, s, t) for t in ticks) for s in range(S)] == [
          most(s, S, M) for s in range(S)]
      assert timetable.peak_inputs_held(table) == tuple(most(s, S, M) for s in range(S))
      tick = {op: t for op, (t, _, _) in timetable.positions(table).items()}
      for s in range(S - 1):
        for m in range(M):
          assert tick[Op("F", s + 1, m)] == tick[Op("F", s, m)] + 1
          assert tick[Op("BW", s, m)] == tick[Op("BW", s + 1, m)] + 1 > tick[Op("F", s, m)]
      if name == "1f1b":
        assert all(len(ops) <= 1 for row in table.ops for ops in row)
        assert len(ticks) == 2 * (M + S - 1)


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



def _equations(jaxpr, name: str) -> int:
  """How many equations of primitive `name` a jaxpr holds, each inner jaxpr counted where it is used."""
  total = 0
  for eqn in jaxpr.eqns:
    total += eqn.primitive.name == name
    for value in eqn.params.values():
      for v in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(v, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)):
          total += _equations(getattr(v, "jaxpr", v), name)
  return total


def test_a_device_encodes_each_tick_once_whatever_the_stage_count():
  """A device sends at most one message per tick, so a tick's boundaries share one encode (only their collectives
  are per boundary): GPipe's program holds as many TopK selections for each tick body that sends (unrolled, or
  a scan's period), whatever S. One encode per boundary at every tick grew as S^2 and ran every boundary's codec
  on every device wherever the sender's conditional could not skip it (TPU)."""
  per_body = {}
  for S in (2, 4, 8):
    pipe = mlp_pipe("topk:0.5:sort", "none", stages=mlp_stages(16, 2, S), m=2 * S)
    ex = sharded.ShardedExecutor(sharded.make_mesh(S, 1))
    state = ex.state_shapes(pipe, optax.sgd(0.1), BATCH)
    selections = _equations(ex.trace_step(pipe, optax.sgd(0.1), Mode.TRAIN, state, BATCH).jaxpr.jaxpr, "top_k")
    segments = Plan(schedules.GPipe().train_table(S, 2 * S)).compiled().segments
    per_body[S] = selections / sum(1 for _, tick_plans in segments for tick_plan in tick_plans if tick_plan.fwd_sends)
  assert len(set(per_body.values())) == 1, per_body
