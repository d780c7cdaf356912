"""netsim: the executor's schedules, hand-computed timelines, closed forms, monotonicity."""
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcomp.analysis import netsim
from jaxcomp.analysis.netsim import Event, Exchange, simulate_step
from jaxcomp.parallel import plan, schedules, timetable

# With bandwidth_bps = 8, sending n bytes takes n seconds: hand timelines stay readable.
BW8 = 8.0
FUSED = [name for name in schedules.SCHEDULES if not schedules.parse(name).splits_backward]  # fused backwards


def _sorted(events):
  return sorted(events, key=lambda e: (e.kind, e.index, e.microbatch))


def executor_orders(name, num_stages, microbatches):
  """Each stage's ops as the executor runs them, tick by tick (`StageRunner.run_explicit`, reading the table's
  `plan.Lookup`): at a tick, `stage_ops` runs the stage's ops in `plan.ORDER`."""
  ops = plan.lookup_of(schedules.parse(name).train_table(num_stages, microbatches)).ops
  return [[(netsim.COMPUTE[kind], int(ops[kind][tick, s])) for tick in range(len(ops["F"]))
           for kind in plan.ORDER if ops[kind][tick, s] >= 0] for s in range(num_stages)]


def simulated_orders(timeline, num_stages):
  """Each stage's compute ops in the order they start."""
  ops = [e for e in timeline.events if e.kind in netsim.COMPUTE.values()]
  return [[(e.kind, e.microbatch) for e in sorted(ops, key=lambda e: e.start) if e.index == s]
          for s in range(num_stages)]


# --- the executor's schedule -----------------------------------------------------------------


@pytest.mark.parametrize("name", schedules.SCHEDULES)
def test_each_stage_runs_the_executors_order(name):
  for s_count in range(1, 9):
    for m_count in range(1, 20):
      rng = random.Random(100 * s_count + m_count)
      times = lambda n, low: [rng.uniform(low, 1.0) for _ in range(n)]
      # compute > 0, so a stage's ops start strictly one after another
      tl = simulate_step(times(s_count, 0.1), times(s_count, 0.1), times(s_count - 1, 0.0),
                         times(s_count - 1, 0.0), m_count, BW8, latency_s=0.05, schedule=name)
      expected = executor_orders(name, s_count, m_count)
      kinds = ("fwd", "bwd_input", "bwd_weight") if name == "zb-h1" else ("fwd", "bwd")
      assert all(sorted(ops) == sorted((k, m) for k in kinds for m in range(m_count)) for ops in expected)
      assert simulated_orders(tl, s_count) == expected, (name, s_count, m_count)


def test_schedules_differ_where_the_executor_differs():
  # 3 stages, 3 microbatches, stage 1: GPipe runs every forward first, 1F1B interleaves,
  # 1f1b-fused's tick 3 holds forward 2 and backward 0 (forward first).
  tl = {n: simulate_step([1.0] * 3, [1.0] * 3, [0, 0], [0, 0], 3, BW8, schedule=n) for n in schedules.SCHEDULES}
  assert simulated_orders(tl["gpipe"], 3)[1] == [("fwd", 0), ("fwd", 1), ("fwd", 2), ("bwd", 0), ("bwd", 1), ("bwd", 2)]
  assert simulated_orders(tl["1f1b"], 3)[1] == [("fwd", 0), ("fwd", 1), ("bwd", 0), ("fwd", 2), ("bwd", 1), ("bwd", 2)]
  assert simulated_orders(tl["1f1b-fused"], 3)[1] == simulated_orders(tl["gpipe"], 3)[1]
  assert simulated_orders(tl["1f1b-fused"], 3)[2] == [("fwd", 0), ("bwd", 0), ("fwd", 1), ("bwd", 1), ("fwd", 2),
                                                      ("bwd", 2)]


# --- hand-computed timelines -------------------------------------------------------------------


def test_1f1b_two_stages_with_links_and_exchange():
  # 1f1b, S=2: stage 0 runs f0 f1 b0 b1, stage 1 f0 b0 f1 b1. Messages: 0.5 s latency + bytes,
  # 1.5 s forward, 2.5 s backward. Exchange: 2 messages, stage 0 sends 4 bytes (5 s), stage 1
  # 1 byte (2 s), each after the stage's last op and its last message.
  tl = simulate_step([1, 2], [2, 3], [1], [2], 2, BW8, latency_s=0.5, exchange=Exchange([4, 1], 2), schedule="1f1b")
  expected = [
      Event("fwd", 0, 0, 0, 1), Event("fwd", 0, 1, 1, 2),
      Event("send_fwd", 0, 0, 1, 2.5), Event("send_fwd", 0, 1, 2.5, 4),  # waits for the link
      Event("fwd", 1, 0, 2.5, 4.5), Event("bwd", 1, 0, 4.5, 7.5),
      Event("fwd", 1, 1, 7.5, 9.5),  # arrived at 4, waits for the stage
      Event("bwd", 1, 1, 9.5, 12.5),
      Event("send_bwd", 0, 0, 7.5, 10), Event("send_bwd", 0, 1, 12.5, 15),
      Event("bwd", 0, 0, 10, 12), Event("bwd", 0, 1, 15, 17),
  ]
  assert _sorted(tl.events) == _sorted(expected)
  assert tl.pipeline_end == 17
  assert tl.exchanges == (Event("exchange", 0, -1, 17, 22), Event("exchange", 1, -1, 15, 17))
  assert tl.makespan == 22
  # each event waits last for the one before it: stage 1's work, then the gradient's way back
  assert [(e.kind, e.index, e.microbatch) for e in tl.critical_path] == [
      ("fwd", 0, 0), ("send_fwd", 0, 0), ("fwd", 1, 0), ("bwd", 1, 0), ("fwd", 1, 1), ("bwd", 1, 1),
      ("send_bwd", 0, 1), ("bwd", 0, 1), ("exchange", 0, -1)]
  assert tl.critical_seconds() == {"compute": 13, "link": 4, "exchange": 5}


def test_one_microbatch_two_stages_is_a_chain():
  # transfer = latency + 8 * bytes / bandwidth: 0.25 + 1 forward, 0.25 + 3 backward.
  tl = simulate_step([1.5, 2.0], [3.0, 4.0], [100], [300], 1, 800.0, latency_s=0.25)
  assert tl.makespan == 1.5 + 1.25 + 2.0 + 4.0 + 3.25 + 3.0


def test_busy_stage_delays_arrived_input():
  # GPipe as the executor runs it (backwards in microbatch order). Stage 1 is slow:
  # microbatch 1 arrives at t=3 but waits until stage 1 is free at 5.
  tl = simulate_step([1, 3], [2, 4], [1], [2], 2, BW8)
  expected = [
      Event("fwd", 0, 0, 0, 1), Event("fwd", 0, 1, 1, 2),
      Event("send_fwd", 0, 0, 1, 2), Event("send_fwd", 0, 1, 2, 3),
      Event("fwd", 1, 0, 2, 5), Event("fwd", 1, 1, 5, 8),
      Event("bwd", 1, 0, 8, 12), Event("bwd", 1, 1, 12, 16),
      Event("send_bwd", 0, 0, 12, 14), Event("send_bwd", 0, 1, 16, 18),
      Event("bwd", 0, 0, 14, 16), Event("bwd", 0, 1, 18, 20),
  ]
  assert _sorted(tl.events) == _sorted(expected)
  assert tl.makespan == 20


def test_communication_bound_link_serialises_messages():
  # Each message takes 1 s latency + 9 s on the wire = 10 s, far more than compute, so
  # the link runs back to back: makespan = f0 + M*T + f1 + b1 + M*T + b0.
  fwd, bwd, t, m = (1, 1), (2, 2), 10, 3
  tl = simulate_step(fwd, bwd, [9], [9], m, BW8, latency_s=1)
  expected = [
      Event("fwd", 0, 0, 0, 1), Event("fwd", 0, 1, 1, 2), Event("fwd", 0, 2, 2, 3),
      Event("send_fwd", 0, 0, 1, 11), Event("send_fwd", 0, 1, 11, 21),
      Event("send_fwd", 0, 2, 21, 31),
      Event("fwd", 1, 0, 11, 12), Event("fwd", 1, 1, 21, 22), Event("fwd", 1, 2, 31, 32),
      Event("bwd", 1, 0, 32, 34), Event("bwd", 1, 1, 34, 36), Event("bwd", 1, 2, 36, 38),
      Event("send_bwd", 0, 0, 34, 44), Event("send_bwd", 0, 1, 44, 54),
      Event("send_bwd", 0, 2, 54, 64),
      Event("bwd", 0, 0, 44, 46), Event("bwd", 0, 1, 54, 56), Event("bwd", 0, 2, 64, 66),
  ]
  assert _sorted(tl.events) == _sorted(expected)
  assert tl.makespan == fwd[0] + m * t + fwd[1] + bwd[1] + m * t + bwd[0] == 66
  assert tl.critical_seconds() == {"compute": 6, "link": 60, "exchange": 0}


def test_single_stage_has_no_links():
  tl = simulate_step([1.0], [2.0], [], [], 4, BW8)
  assert {e.kind for e in tl.events} == {"fwd", "bwd"}
  assert tl.makespan == 4 * 3.0


def test_exchange_follows_each_stage_and_counts_latency_per_message():
  args = ([1, 3], [2, 4], [1], [2], 2, BW8)
  plain = simulate_step(*args)
  # stage 1 is done at 16 (last backward) and its last message has left at 18
  tl = simulate_step(*args, latency_s=0.0, exchange=Exchange([2.5, 24.0], 0))
  assert tl.events == plain.events and tl.pipeline_end == plain.makespan == 20
  assert tl.exchanges == (Event("exchange", 0, -1, 20, 22.5), Event("exchange", 1, -1, 18, 42))
  assert tl.makespan == 42 and tl.critical_path[-2:] == (Event("send_bwd", 0, 1, 16, 18), tl.exchanges[1])
  assert netsim.transfer_time(16, BW8, 0.5, messages=6) == 3 + 16


def test_throughput_is_samples_over_makespan():
  tl = simulate_step([1, 3], [2, 4], [1], [2], 2, BW8, exchange=Exchange([5, 0], 1))
  assert netsim.throughput(50, tl) == 2.0


def test_transfer_time():
  assert netsim.transfer_time(125_000, 1e9, 0.5) == 0.5 + 1e-3


# --- closed form ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", FUSED)  # the fused-backward schedules (ZB-H1's bubble is smaller)
@pytest.mark.parametrize("stages,microbatches", [(2, 2), (2, 1), (3, 5), (4, 8), (8, 3)])
@pytest.mark.parametrize("t_f,t_b", [(1.0, 2.0), (2.0, 1.0)])
def test_uniform_stages_without_communication_give_gpipe_formula(name, stages, microbatches, t_f, t_b):
  # (M + S - 1)(t_f + t_b); the 1F1B schedules have GPipe's bubble (they save memory, not time)
  tl = simulate_step([t_f] * stages, [t_b] * stages, [1e9] * (stages - 1), [1e9] * (stages - 1), microbatches,
                     math.inf, schedule=name)
  assert tl.makespan == (microbatches + stages - 1) * (t_f + t_b)


# --- properties ------------------------------------------------------------------------

_time = st.floats(0, 10, allow_nan=False)
_bytes = st.floats(0, 1e4, allow_nan=False)


@st.composite
def pipelines(draw):
  s = draw(st.integers(1, 5))
  exchange = draw(st.none() | st.builds(Exchange, st.lists(_bytes, min_size=s, max_size=s), st.integers(0, 6)))
  return dict(
      fwd_s=draw(st.lists(_time, min_size=s, max_size=s)),
      bwd_s=draw(st.lists(_time, min_size=s, max_size=s)),
      fwd_bytes=draw(st.lists(_bytes, min_size=s - 1, max_size=s - 1)),
      bwd_bytes=draw(st.lists(_bytes, min_size=s - 1, max_size=s - 1)),
      microbatches=draw(st.integers(1, 6)),
      bandwidth_bps=draw(st.floats(1.0, 1e5)),
      latency_s=draw(_time),
      exchange=exchange,
      schedule=draw(st.sampled_from(FUSED)),  # fused backwards: the invariants count F and BW events
  )


def _at_least(value, bound):
  return value >= bound - 1e-9 * max(1.0, bound)


@settings(deadline=None, max_examples=100)
@given(pipelines(), st.floats(1.0, 100.0))
def test_more_bandwidth_never_slows_a_step(p, factor):
  faster = dict(p, bandwidth_bps=p["bandwidth_bps"] * factor)
  assert simulate_step(**faster).makespan <= simulate_step(**p).makespan


@settings(deadline=None, max_examples=60)
@given(pipelines(), st.data())
def test_fewer_bytes_never_slow_a_step(p, data):
  def shrink(sizes):
    scales = data.draw(st.lists(st.floats(0, 1), min_size=len(sizes), max_size=len(sizes)))
    return [n * k for n, k in zip(sizes, scales)]

  smaller = dict(p, fwd_bytes=shrink(p["fwd_bytes"]), bwd_bytes=shrink(p["bwd_bytes"]))
  if p["exchange"] is not None:
    smaller["exchange"] = p["exchange"]._replace(sent_bytes=shrink(p["exchange"].sent_bytes))
  assert simulate_step(**smaller).makespan <= simulate_step(**p).makespan


@settings(deadline=None, max_examples=60)
@given(pipelines())
def test_makespan_respects_lower_bounds(p):
  tl = simulate_step(**p)
  m = p["microbatches"]

  def t(n):
    return netsim.transfer_time(n, p["bandwidth_bps"], p["latency_s"])

  for f, b in zip(p["fwd_s"], p["bwd_s"]):  # a stage does all its work serially
    assert _at_least(tl.makespan, m * (f + b))
  for nf, nb in zip(p["fwd_bytes"], p["bwd_bytes"]):  # a link direction is serial too
    assert _at_least(tl.makespan, m * t(nf))
    assert _at_least(tl.makespan, m * t(nb))
  one_microbatch_path = (
      sum(p["fwd_s"]) + sum(p["bwd_s"])
      + sum(map(t, p["fwd_bytes"])) + sum(map(t, p["bwd_bytes"]))
  )
  assert _at_least(tl.makespan, one_microbatch_path)


@settings(deadline=None, max_examples=60)
@given(pipelines())
def test_timeline_invariants(p):
  tl = simulate_step(**p)
  s_count, m_count = len(p["fwd_s"]), p["microbatches"]
  ev = {(e.kind, e.index, e.microbatch): e for e in tl.events}
  assert len(ev) == len(tl.events) == 2 * m_count * (2 * s_count - 1)
  assert tl.pipeline_end == max(e.end for e in tl.events)

  def transfer(n):
    return netsim.transfer_time(n, p["bandwidth_bps"], p["latency_s"])

  duration = {
      "fwd": p["fwd_s"], "bwd": p["bwd_s"],
      "send_fwd": [transfer(n) for n in p["fwd_bytes"]],
      "send_bwd": [transfer(n) for n in p["bwd_bytes"]],
  }
  for e in tl.events:
    assert e.start >= 0
    assert e.end - e.start == pytest.approx(duration[e.kind][e.index], abs=1e-9)

  mbs = range(m_count)
  # Each stage runs its ops one at a time in the executor's order; each link direction is
  # FIFO in production order (microbatch order, under every schedule).
  orders = [[ev[kind, s, m] for kind, m in ops]
            for s, ops in enumerate(executor_orders(p["schedule"], s_count, m_count))]
  orders += [[ev[kind, b, m] for m in mbs] for kind in ("send_fwd", "send_bwd") for b in range(s_count - 1)]
  previous = {}
  for order in orders:
    for before, after in zip(order, order[1:]):
      assert after.start >= before.end
      previous[after] = before

  # Data dependencies.
  needs = {}
  for m in mbs:
    for s in range(1, s_count):
      needs[ev["send_fwd", s - 1, m]] = ev["fwd", s - 1, m]
      needs[ev["fwd", s, m]] = ev["send_fwd", s - 1, m]
      needs[ev["send_bwd", s - 1, m]] = ev["bwd", s, m]
      needs[ev["bwd", s - 1, m]] = ev["send_bwd", s - 1, m]
  for after, before in needs.items():
    assert after.start >= before.end

  # Nothing waits longer than it has to.
  for e in tl.events:
    ready = [x.end for x in (previous.get(e), needs.get(e)) if x is not None]
    assert e.start == max(ready, default=0.0)

  # Each stage's exchange starts once the stage and its outgoing links are done.
  waits_for = {e: [x for x in (previous.get(e), needs.get(e)) if x is not None] for e in tl.events}
  if p["exchange"] is None:
    assert tl.exchanges == () and tl.makespan == tl.pipeline_end
  for s, x in enumerate(tl.exchanges):
    waits_for[x] = [e for e in tl.events if (e.kind in ("fwd", "bwd") and e.index == s)
                    or (e.kind == "send_fwd" and e.index == s) or (e.kind == "send_bwd" and e.index == s - 1)]
    assert (x.kind, x.index, x.start) == ("exchange", s, max(e.end for e in waits_for[x]))
    assert x.end - x.start == pytest.approx(netsim.transfer_time(
        p["exchange"].sent_bytes[s], p["bandwidth_bps"], p["latency_s"], p["exchange"].messages), abs=1e-9)

  # The critical path runs from t = 0 to the makespan along dependencies, without gaps.
  path = tl.critical_path
  assert path[0].start == 0 and path[-1].end == tl.makespan
  for before, after in zip(path, path[1:]):
    assert before in waits_for[after] and before.end == after.start
  assert sum(tl.critical_seconds().values()) == pytest.approx(tl.makespan, rel=1e-9, abs=1e-9)


# --- input validation ---------------------------------------------------------------------

GOOD = dict(
    fwd_s=[1.0, 1.0], bwd_s=[2.0, 2.0], fwd_bytes=[10], bwd_bytes=[10],
    microbatches=2, bandwidth_bps=1e6, latency_s=0.0, exchange=None, schedule="gpipe",
)


@pytest.mark.parametrize(
    "override,message",
    [
        (dict(fwd_s=[1.0, -1.0]), r"fwd_s\[1\].*-1\.0"),
        (dict(bwd_s=[2.0, math.nan]), r"bwd_s\[1\].*nan"),
        (dict(fwd_s=[], bwd_s=[], fwd_bytes=[], bwd_bytes=[]), r"fwd_s .*empty"),
        (dict(bwd_s=[2.0]), r"bwd_s has 1 entries but fwd_s has 2"),
        (dict(fwd_bytes=[-5]), r"fwd_bytes\[0\].*-5"),
        (dict(bwd_bytes=[10, 10]), r"bwd_bytes has 2 entries but the pipeline has 1 links"),
        (dict(fwd_bytes=[math.inf]), r"fwd_bytes\[0\].*inf"),
        (dict(bandwidth_bps=0), r"bandwidth_bps must be > 0, got 0"),
        (dict(bandwidth_bps=-1e9), r"bandwidth_bps.*-1000000000\.0"),
        (dict(bandwidth_bps=math.nan), r"bandwidth_bps.*nan"),
        (dict(latency_s=-0.1), r"latency_s.*-0\.1"),
        (dict(microbatches=0), r"microbatches.*got 0"),
        (dict(microbatches=1.5), r"microbatches.*got 1\.5"),
        (dict(microbatches=True), r"microbatches.*got True"),
        (dict(schedule="pipedream"), r"schedule must be one of \['gpipe', '1f1b', '1f1b-fused', 'zb-h1'\] or "
                                     r"interleaved:V \(V >= 1 chunks per device\), got 'pipedream'"),
        (dict(schedule="interleaved:3"), r"schedule 'interleaved:3' places 3 chunks on each device; netsim was given "
                                         r"times for 2 chunks"),
        (dict(schedule=schedules.GPipe().train_table(2, 2), ticks=True),
         r"schedule 'gpipe' has forwarding delay 1, so with ticks=True overlap_sends must be False"),
        (dict(exchange=Exchange([1.0], 2)), r"exchange.sent_bytes has 1 entries but the pipeline has 2 stages"),
        (dict(exchange=Exchange([1.0, -2.0], 2)), r"exchange.sent_bytes\[1\].*-2\.0"),
        (dict(exchange=Exchange([1.0, 1.0], -1)), r"exchange.messages must be an integer >= 0, got -1"),
    ],
)
def test_bad_inputs_raise_naming_the_value(override, message):
  with pytest.raises(ValueError, match=message):
    simulate_step(**dict(GOOD, **override))


def test_throughput_rejects_bad_samples_and_empty_step():
  tl = simulate_step(**GOOD)
  with pytest.raises(ValueError, match=r"samples_per_step.*got 0"):
    netsim.throughput(0, tl)
  empty = simulate_step([0.0], [0.0], [], [], 1, 1.0)
  with pytest.raises(ValueError, match="makespan of 0.0"):
    netsim.throughput(8, empty)


# --- bandwidths and exchanges ------------------------------------------------------------------

# 125 MB takes 1 s at 1 Gbps and 10 s at 100 Mbps; 12.5 MB a tenth of that.
CONFIGS = {"big": ([125e6], [125e6]), "small": ([12.5e6], [12.5e6])}


def test_step_times_over_bandwidths_and_with_an_exchange():
  def rows(**kw):
    return [simulate_step([1, 1], [1, 1], fwd, bwd, 1, bw, **kw) for fwd, bwd in CONFIGS.values() for bw in (1e9, 100e6)]
  # compute 4 s + one message each way
  assert [tl.makespan for tl in rows()] == pytest.approx([6, 24, 4.2, 6])
  assert [netsim.throughput(12, tl) for tl in rows()] == pytest.approx([2, 0.5, 12 / 4.2, 2])
  # an exchange of 12.5 MB per stage adds 0.1 s / 1 s after stage 0, the last to finish
  exchanged = rows(exchange=Exchange([12.5e6, 12.5e6], 1), schedule="1f1b")
  assert [tl.makespan for tl in exchanged] == pytest.approx([6.1, 25, 4.3, 7])


@pytest.mark.parametrize(
    "bps,text",
    [(10e9, "10 Gbps"), (1.5e9, "1.5 Gbps"), (500e6, "500 Mbps"), (2e3, "2 kbps"), (8, "8 bps")],
)
def test_format_bandwidth(bps, text):
  assert netsim.format_bandwidth(bps) == text


# --- split backwards and chunks -----------------------------------------------------------


def test_zero_bubble_h1_is_no_slower_than_1f1b_when_b_plus_w_is_the_backward():
  """Same fwd_s, bwd_s and bytes: ZB-H1's table (B + W = bwd_s) never takes longer than 1F1B's, with
  uniform or uneven stages, free or slow links, and is shorter with the uniform stages and free links."""
  rng = random.Random(39)
  for S, M in ((2, 4), (4, 8), (4, 16), (8, 16)):
    for trial in range(4):
      uniform = trial == 0
      f = [1.0] * S if uniform else [rng.uniform(0.5, 1.5) for _ in range(S)]
      b = [2.0] * S if uniform else [rng.uniform(1.0, 3.0) for _ in range(S)]
      nbytes = [0.0] * (S - 1) if trial < 2 else [rng.uniform(0, 1e3) for _ in range(S - 1)]
      args = (f, b, nbytes, nbytes, M, 8e3)
      zb = simulate_step(*args, schedule=schedules.parse("zb-h1").train_table(S, M)).makespan
      ref = simulate_step(*args, schedule="1f1b").makespan
      assert zb <= ref + 1e-9, (S, M, trial)
      if uniform:
        assert zb == pytest.approx((3 * M + S - 1) * 1.0) and ref == pytest.approx((M + S - 1) * 3.0)


def test_split_backward_times_and_messages():
  """B takes input_grad_share of the backward and sends the gradient as it ends; W the rest, after it."""
  t = schedules.parse("zb-h1").train_table(2, 1)
  tl = simulate_step([1.0, 1.0], [4.0, 4.0], [0.0], [0.0], 1, math.inf, schedule=t, input_grad_share=0.25)
  ev = {(e.kind, e.index, e.microbatch): e for e in tl.events}
  assert (ev["bwd_input", 1, 0].start, ev["bwd_input", 1, 0].end) == (2.0, 3.0)
  assert ev["send_bwd", 0, 0].start == 3.0 and ev["bwd_input", 0, 0].start == 3.0
  assert (ev["bwd_weight", 1, 0].start, ev["bwd_weight", 1, 0].end) == (3.0, 6.0)
  assert tl.makespan == 7.0 and tl.critical_seconds()["compute"] == 7.0
  with pytest.raises(ValueError, match=r"input_grad_share must be in \[0, 1\].*got 1.5"):
    simulate_step([1.0], [1.0], [], [], 1, math.inf, schedule=schedules.ZeroBubbleH1().train_table(1, 1),
                  input_grad_share=1.5)


def test_interleaved_table_uses_each_chunks_times_and_the_ring():
  """Chunk c's times; boundary b crosses link b mod S (boundary 1: device 1 to device 0, the wrap-around),
  boundaries 0 and 2 share link 0. With free links and uniform chunks the step is the table's (F 1, BW 2)."""
  S, V, M = 2, 2, 4
  t = schedules.Interleaved(V).train_table(S, M)
  free = simulate_step([1.0] * 4, [2.0] * 4, [0.0] * 3, [0.0] * 3, M, math.inf, schedule=t)
  assert free.makespan == pytest.approx(3 * V * M / (1 - timetable.bubble_fraction(t)))
  tl = simulate_step([1.0, 1.0, 5.0, 1.0], [2.0] * 4, [8.0] * 3, [8.0] * 3, M, 8.0, schedule=t)
  ev = {(e.kind, e.index, e.microbatch): e for e in tl.events}
  assert all(ev["fwd", 2, m].end - ev["fwd", 2, m].start == 5.0 for m in range(M))
  assert all(ev["fwd", 2, m].start >= ev["send_fwd", 1, m].end for m in range(M))
  link0 = sorted((ev["send_fwd", b, m].start, ev["send_fwd", b, m].end) for b in (0, 2) for m in range(M))
  assert all(end - start == 8.0 for start, end in link0)
  assert all(later[0] >= earlier[1] for earlier, later in zip(link0, link0[1:]))  # one message at a time
  assert sum(tl.critical_seconds().values()) == pytest.approx(tl.makespan)


# --- the executor's ticks (ticks=True) ------------------------------------------------------------


def _starts(tl):
  return {(e.kind, e.index, e.microbatch): (e.start, e.end) for e in tl.events}


def test_every_table_by_name():
  """The name path builds what `schedules.parse(name).train_table` builds: every schedule (interleaved:V from
  C = S*V chunk times), and with ticks and overlap_sends the overlapped table (forwarding delay 2; dataflow: the
  table of delay 1)."""
  rng = random.Random(7)
  for name, chunks, overlap in (("gpipe", 4, False), ("1f1b-fused", 4, True), ("zb-h1", 4, False), ("zb-h1", 4, True),
                                ("interleaved:2", 8, False), ("interleaved:2", 8, True)):
    times = [[rng.uniform(0.5, 2.0) for _ in range(chunks)] for _ in range(2)]
    nbytes = [rng.uniform(1.0, 9.0) for _ in range(chunks - 1)]
    args = (*times, nbytes, nbytes[::-1], 8, BW8)
    for ticks in (False, True):
      table = schedules.parse(name, ticks and overlap).train_table(4, 8)
      kw = dict(ticks=ticks, overlap_sends=ticks and overlap)
      assert simulate_step(*args, schedule=name, **kw) == simulate_step(*args, schedule=table, **kw), (name, ticks)


def test_plain_ticks_compute_then_send_then_wait():
  """GPipe, 2 stages, 2 microbatches, stage 1's forward 3 s, messages 2 s. Tick 1 runs F(0, 1) (3-4) and
  F(1, 0) (3-6); the message F(0, 1) made waits for stage 1 to end its tick (6-8, a collective needs both
  ends), so F(1, 1) starts at 8; dataflow lets it cross at 4-6 and F(1, 1) start at 6."""
  args = ([1.0, 3.0], [1.0, 1.0], [2.0], [2.0], 2, BW8)
  ticks = _starts(simulate_step(*args, ticks=True, overlap_sends=False))
  assert ticks["send_fwd", 0, 0] == (1.0, 3.0) and ticks["fwd", 0, 1] == (3.0, 4.0)
  assert ticks["fwd", 1, 0] == (3.0, 6.0) and ticks["send_fwd", 0, 1] == (6.0, 8.0) and ticks["fwd", 1, 1] == (8.0, 11.0)
  dataflow = _starts(simulate_step(*args, overlap_sends=False))
  assert dataflow["send_fwd", 0, 1] == (4.0, 6.0) and dataflow["fwd", 1, 1] == (6.0, 9.0)


def test_overlapped_ticks_cross_during_the_next_tick():
  """GPipe with --overlap (forwarding delay 2), 2 stages, 4 microbatches, 1 s ops, 2 s messages (hand timeline): the
  message made at tick t starts with tick t+1 and crosses while both stages compute it, and each stage
  starts tick t+2 once it has crossed."""
  tl = simulate_step([1.0, 1.0], [1.0, 1.0], [2.0], [2.0], 4, BW8, ticks=True, overlap_sends=True)
  ev = _starts(tl)
  assert [ev["send_fwd", 0, m] for m in range(4)] == [(1.0, 3.0), (3.0, 5.0), (5.0, 7.0), (7.0, 9.0)]
  assert ev["fwd", 0, 1] == (1.0, 2.0) and ev["fwd", 0, 2] == ev["fwd", 1, 0] == (3.0, 4.0)
  assert [ev["fwd", 1, m][0] for m in range(4)] == [3.0, 5.0, 7.0, 9.0]
  assert [ev["send_bwd", 0, m] for m in range(4)] == [(11.0, 13.0), (13.0, 15.0), (15.0, 17.0), (17.0, 19.0)]
  assert ev["bwd", 0, 0] == (13.0, 14.0) and ev["bwd", 0, 3] == (19.0, 20.0) and tl.makespan == 20.0


@pytest.mark.parametrize("name", [*schedules.SCHEDULES, "interleaved:2"])
def test_ticks_are_never_faster_than_dataflow(name):
  """For the same table, the executor's ticks only add waits to the dataflow timing with overlapping sends;
  the ticks' critical path runs from 0 to the makespan without gaps. Random stages and links."""
  rng = random.Random(name)
  per_device = 2 if name.startswith("interleaved") else 1
  for S, M in ((2, 4), (3, 6), (4, 8)):
    for overlap in (False, True):
      table, chunks = schedules.parse(name, overlap).train_table(S, M), S * per_device
      times = [[rng.uniform(0.1, 2.0) for _ in range(chunks)] for _ in range(2)]
      nbytes = [[rng.uniform(0.0, 16.0) for _ in range(chunks - 1)] for _ in range(2)]
      args = (*times, *nbytes, M, BW8, rng.uniform(0, 0.5))
      tl = simulate_step(*args, schedule=table, ticks=True, overlap_sends=overlap, exchange=Exchange([4.0] * S, 1))
      assert _at_least(tl.makespan, simulate_step(*args, schedule=table, exchange=Exchange([4.0] * S, 1)).makespan)
      path = tl.critical_path
      assert path[0].start == 0 and path[-1].end == tl.makespan
      assert all(before.end == after.start for before, after in zip(path, path[1:]))
