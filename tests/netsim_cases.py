"""What the netsim tests share: event orders, the wire's accounting, and hypothesis's strategies for times and bytes."""
import pytest
from hypothesis import strategies as st
from jaxcomp.analysis import netsim
from jaxcomp.parallel import plan, schedules


FUSED = [name for name in schedules.SCHEDULES if not schedules.parse(name).splits_backward]  # fused backwards


def sent_at(e, latency_s):
  """When an event frees what waits for it on its resource: a message its link direction once its last byte has
  left (it lands `latency_s` later); anything else at its end."""
  return e.end - latency_s if e.kind.startswith("send") else e.end


def gapless(path, latency_s):
  """The critical path runs from t = 0 to its last event without gaps: each event starts when the one before it
  ended, or (a message held up by the one before it on its link direction, or a sender without overlapped sends)
  when that one's last byte left."""
  return path[0].start == 0 and all(after.start in (before.end, pytest.approx(sent_at(before, latency_s), abs=1e-9))
                                    for before, after in zip(path, path[1:]))


def executor_orders(name, num_stages, microbatches):
  """Each stage's ops as the executor runs them, tick by tick (`StageRunner.run_explicit`, reading the table's
  `plan.Lookup`): at a tick, `stage_ops` runs the stage's ops in `plan.ORDER`."""
  ops = plan.lookup_of(schedules.parse(name).train_table(num_stages, microbatches)).ops
  return [[(netsim.COMPUTE[kind], int(ops[kind][tick, s])) for tick in range(len(ops["F"]))
           for kind in plan.ORDER if ops[kind][tick, s] >= 0] for s in range(num_stages)]


seconds = st.floats(0, 10, allow_nan=False)


message_bytes = st.floats(0, 1e4, allow_nan=False)


def at_least(value, bound):
  return value >= bound - 1e-9 * max(1.0, bound)

