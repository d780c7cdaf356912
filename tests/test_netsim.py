"""netsim: the executor's schedules, hand-computed timelines, closed forms, the meters and protocols, tied exchanges."""
import math
import random

import pytest

from jaxcomp.analysis import netsim
from jaxcomp.analysis.events import Event
from jaxcomp.analysis.link import Link
from jaxcomp.analysis.netsim import Collective, Exchange, Tied, simulate_step
from jaxcomp.parallel import plan, schedules, timetable
from netsim_cases import at_least, executor_orders, gapless

# With bandwidth_bps = 8, sending n bytes takes n seconds: hand timelines stay readable.
BW8 = 8.0


def _sorted(events):
  return sorted(events, key=lambda e: (e.kind, e.index, e.microbatch))


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
  # 1f1b, S=2: stage 0 runs f0 f1 b0 b1, stage 1 f0 b0 f1 b1. Messages hold their link direction for their
  # bytes (1 s forward, 2 s backward) and land 0.5 s later. Exchange: 2 messages, stage 0 sends 4 bytes (5 s),
  # stage 1 1 byte (2 s), each after the stage's last op and its last message's last byte.
  tl = simulate_step([1, 2], [2, 3], [1], [2], 2, BW8, latency_s=0.5, exchange=Exchange([4, 1], 2), schedule="1f1b")
  expected = [
      Event("fwd", 0, 0, 0, 1), Event("fwd", 0, 1, 1, 2),
      Event("send_fwd", 0, 0, 1, 2.5), Event("send_fwd", 0, 1, 2, 3.5),  # leaves behind the first's last byte
      Event("fwd", 1, 0, 2.5, 4.5), Event("bwd", 1, 0, 4.5, 7.5),
      Event("fwd", 1, 1, 7.5, 9.5),  # arrived at 3.5, waits for the stage
      Event("bwd", 1, 1, 9.5, 12.5),
      Event("send_bwd", 0, 0, 7.5, 10), Event("send_bwd", 0, 1, 12.5, 15),
      Event("bwd", 0, 0, 10, 12), Event("bwd", 0, 1, 15, 17),
  ]
  assert _sorted(tl.events) == _sorted(expected)
  assert tl.pipeline_end == 17
  # stage 1's last message's last byte left at 14.5 (it lands at 15)
  assert tl.exchanges == (Event("exchange", 0, -1, 17, 22), Event("exchange", 1, -1, 14.5, 16.5))
  assert tl.makespan == 22
  # each event waits last for the one before it: stage 1's work, then the gradient's way back
  assert [(e.kind, e.index, e.microbatch) for e in tl.critical_path] == [
      ("fwd", 0, 0), ("send_fwd", 0, 0), ("fwd", 1, 0), ("bwd", 1, 0), ("fwd", 1, 1), ("bwd", 1, 1),
      ("send_bwd", 0, 1), ("bwd", 0, 1), ("exchange", 0, -1)]
  assert tl.critical_seconds() == {"compute": 13, "link": 4, "exchange": 5}


def test_latency_does_not_hold_the_link():
  """Three 1 s messages behind one another on a link with 10 s latency: each leaves when the one before has sent
  its last byte (a wire holds bytes in flight, not the sender), so they land 1 s apart, not 11 s."""
  tl = simulate_step([0.0, 0.0], [0.0, 0.0], [8.0], [0.0], 3, 64.0, latency_s=10.0)
  ev = _starts(tl)
  assert [ev["send_fwd", 0, m] for m in range(3)] == [(0.0, 11.0), (1.0, 12.0), (2.0, 13.0)]
  assert tl.makespan == 23.0  # the last forward lands at 13, its gradient (no bytes) 10 s later
  # without overlapped sends the stage waits for each last byte to leave, not for each landing
  waiting = _starts(simulate_step([0.0, 0.0], [0.0, 0.0], [8.0], [0.0], 3, 64.0, latency_s=10.0,
                                  overlap_sends=False))
  assert [waiting["fwd", 0, m][0] for m in range(3)] == [0.0, 1.0, 2.0]


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
  # Each message holds its link 9 s (its bytes) and lands 1 s later, far more than compute, so the link
  # sends back to back: makespan = f0 + M*T + L + f1 + b1 + M*T + L + b0 (the latency paid once each way).
  fwd, bwd, t, lat, m = (1, 1), (2, 2), 9, 1, 3
  tl = simulate_step(fwd, bwd, [9], [9], m, BW8, latency_s=lat)
  expected = [
      Event("fwd", 0, 0, 0, 1), Event("fwd", 0, 1, 1, 2), Event("fwd", 0, 2, 2, 3),
      Event("send_fwd", 0, 0, 1, 11), Event("send_fwd", 0, 1, 10, 20),
      Event("send_fwd", 0, 2, 19, 29),
      Event("fwd", 1, 0, 11, 12), Event("fwd", 1, 1, 20, 21), Event("fwd", 1, 2, 29, 30),
      Event("bwd", 1, 0, 30, 32), Event("bwd", 1, 1, 32, 34), Event("bwd", 1, 2, 34, 36),
      Event("send_bwd", 0, 0, 32, 42), Event("send_bwd", 0, 1, 41, 51),
      Event("send_bwd", 0, 2, 50, 60),
      Event("bwd", 0, 0, 42, 44), Event("bwd", 0, 1, 51, 53), Event("bwd", 0, 2, 60, 62),
  ]
  assert _sorted(tl.events) == _sorted(expected)
  assert tl.makespan == fwd[0] + m * t + lat + fwd[1] + bwd[1] + m * t + lat + bwd[0] == 62
  # on the path, a message that held up the next one on its link counts until its last byte left
  assert tl.critical_seconds() == {"compute": 6, "link": 56, "exchange": 0}


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


def test_a_link_gives_bandwidth_and_latency():
  args = ([1, 3], [2, 4], [1], [2], 2)
  assert simulate_step(*args, Link(8.0, 0.5)) == simulate_step(*args, 8.0, 0.5)
  with pytest.raises(ValueError, match=r"give the latency once: bandwidth_bps is 8bit:500ms .* got 0\.5"):
    simulate_step(*args, Link(8.0, 0.5), 0.5)


# --- the receiver's meter (Protocol NanoGPT) ------------------------------------------------------


def test_inbound_meter_shares_each_stages_wire_in_its_consumption_order():
  """1F1B, 3 stages, 3 microbatches: stage 0's forwards 2 s, every other op 0 s, every message 1 s of bytes plus
  1 s latency. Stage 1 consumes a0 a1 g0 a2 g1 g2 (activations from stage 0, gradients from stage 2) and its one
  wire bills them in that order, each at max(wire free, sent) + bytes + latency (hand timeline)."""
  tl = simulate_step([2, 0, 0], [0, 0, 0], [1, 1], [1, 1], 3, BW8, latency_s=1.0, schedule="1f1b", meter="inbound")
  ev = _starts(tl)
  # stage 1's wire: a0 sent at 2, a1 at 4, g0 at 6 and a2 at 6 (sent together: g0, consumed first, lands
  # first), g1 at 8 (waits for a2 to land), g2 at 12
  assert [ev["send_fwd", 0, m] for m in range(3)] == [(2, 4), (4, 6), (8, 10)]
  assert [ev["send_bwd", 1, m] for m in range(3)] == [(6, 8), (10, 12), (12, 14)]
  # stage 2's wire: a'0 sent at 4, a'1 at 6, a'2 at 10; stage 0's: g'0 at 8, g'1 at 12, g'2 at 14
  assert [ev["send_fwd", 1, m] for m in range(3)] == [(4, 6), (6, 8), (10, 12)]
  assert [ev["send_bwd", 0, m] for m in range(3)] == [(8, 10), (12, 14), (14, 16)]
  assert ev["fwd", 1, 2] == (10, 10) and ev["bwd", 1, 1] == (12, 12) and ev["bwd", 0, 2] == (16, 16)
  assert tl.makespan == 16
  # per direction, a2 (link 0 forward) and g0 (link 1 backward) cross side by side: both land at 8
  per_direction = _starts(simulate_step([2, 0, 0], [0, 0, 0], [1, 1], [1, 1], 3, BW8, latency_s=1.0, schedule="1f1b"))
  assert per_direction["send_fwd", 0, 2] == (6, 8) and per_direction["send_bwd", 1, 0] == (6, 8)


def test_inbound_meter_holds_the_wire_for_the_latency_too():
  """Two stages, three microbatches, nothing but 1 s of bytes and 10 s of latency per activation: the receiver's
  wire bills each message from the end of the one before (arrives = max(arrives, sent) + bits/bandwidth +
  latency), so they land 11 s apart; per direction they land 1 s apart."""
  args = ([0.0, 0.0], [0.0, 0.0], [1.0], [0.0], 3, BW8, 10.0)
  inbound, per_direction = _starts(simulate_step(*args, meter="inbound")), _starts(simulate_step(*args))
  assert [inbound["send_fwd", 0, m] for m in range(3)] == [(0, 11), (11, 22), (22, 33)]
  assert [per_direction["send_fwd", 0, m] for m in range(3)] == [(0, 11), (1, 12), (2, 13)]
  # the sender never waits for the meter, with or without overlapped sends
  waiting = _starts(simulate_step(*args, meter="inbound", overlap_sends=False))
  assert [waiting["fwd", 0, m][0] for m in range(3)] == [0, 0, 0]


def test_inbound_meter_on_the_executors_ticks():
  """1F1B-fused ticks (hop 1), 3 stages, 3 microbatches, 0 s ops, messages 1 s of bytes + 1 s latency. At tick 2
  stage 1 receives a2 from stage 0 and g0 from stage 2: its one wire bills them in the table's order, so g0 lands
  2 s after a2 (per direction they cross side by side), and the step takes 14 s instead of 12 (hand timelines)."""
  args = ([0] * 3, [0] * 3, [1, 1], [1, 1], 3, BW8, 1.0)
  kw = dict(schedule="1f1b-fused", ticks=True, overlap_sends=False)
  inbound = simulate_step(*args, meter="inbound", **kw)
  ev = _starts(inbound)
  assert ev["send_fwd", 0, 0] == (0, 2) and ev["send_fwd", 0, 1] == (2, 4) and ev["send_fwd", 0, 2] == (4, 6)
  assert ev["send_bwd", 1, 0] == (6, 8) and ev["fwd", 1, 2] == (8, 8)
  assert [ev["send_bwd", 0, m] for m in range(3)] == [(8, 10), (10, 12), (12, 14)] and inbound.makespan == 14
  per_direction = simulate_step(*args, **kw)
  ev = _starts(per_direction)
  assert ev["send_fwd", 0, 2] == ev["send_bwd", 1, 0] == (4, 6) and ev["fwd", 1, 2] == (6, 6)
  assert per_direction.makespan == 12


# --- the rendezvous protocol (XLA:CPU's gloo) --------------------------------------------------


def test_rendezvous_messages_wait_for_the_receivers_notice():
  """GPipe ticks, 2 stages, 2 microbatches, 1 s ops, messages 1 s of bytes + 1 s latency (hand timeline). a1
  leaves at 5, not 4: stage 1 posts its receive when its tick 1 ends (4) and the notice takes 1 s; the sender is
  done as its bytes leave (F(0, 1) starts at 1, not at a0's last byte). g1 leaves at 13: stage 0 posts at 12."""
  args = ([1, 1], [1, 1], [1], [1], 2, BW8, 1.0)
  kw = dict(ticks=True, overlap_sends=False)
  tl = simulate_step(*args, protocol="rendezvous", **kw)
  ev = _starts(tl)
  assert ev["send_fwd", 0, 0] == (1, 3) and ev["fwd", 0, 1] == (1, 2) and ev["fwd", 1, 0] == (3, 4)
  assert ev["send_fwd", 0, 1] == (5, 7) and ev["fwd", 1, 1] == (7, 8) and ev["bwd", 1, 0] == (8, 9)
  assert ev["send_bwd", 0, 0] == (9, 11) and ev["bwd", 0, 0] == (11, 12) and ev["bwd", 1, 1] == (9, 10)
  assert ev["send_bwd", 0, 1] == (13, 15) and ev["bwd", 0, 1] == (15, 16) and tl.makespan == 16
  assert tl.critical_seconds() == {"compute": 6, "link": 10, "exchange": 0}  # two notices on the path
  eager = _starts(simulate_step(*args, **kw))
  assert eager["send_fwd", 0, 1] == (4, 6) and eager["send_bwd", 0, 1] == (11, 13)


def test_rendezvous_all_reduce_is_gloos_ring():
  """An all-reduce of nothing over 3 stages at tick 0 (stage 0 computes 1 s; latency 1 s; hand timeline).
  Reduce-scatter 2 -> 1 -> 0: hop 0 leaves at 1 (stage 1's notice), hop 1 at 2 (stage 0's: it entered at 1);
  allgather 0 -> 2 -> 1: hop 2 at 3, hop 3 at 4. Stage 0 leaves at 3 (its send left), stage 2 at 4, stage 1 at
  5 (its receive landed); tick 0's activation then leaves at 6, once stage 1's notice has crossed. Eager: a
  barrier at 1, four hops, all leave at 5, the activation leaves at 5."""
  args = ([1, 1, 1], [1, 1, 1], [0, 0], [0, 0], 1, BW8, 1.0)
  kw = dict(ticks=True, overlap_sends=False, collectives=[Collective(0, nbytes=0)])
  tl = simulate_step(*args, protocol="rendezvous", **kw)
  assert [(e.microbatch, e.start, e.end) for e in tl.collectives] == [(0, 1, 2), (1, 2, 3), (2, 3, 4), (3, 4, 5)]
  assert _starts(tl)["send_fwd", 0, 0] == (6, 7) and _starts(tl)["fwd", 1, 0] == (7, 8)
  eager = simulate_step(*args, **kw)
  assert eager.collectives == (Event("collective", 0, -1, 1, 5),) and _starts(eager)["send_fwd", 0, 0] == (5, 6)


# --- collectives ----------------------------------------------------------------------------------


def test_collectives_at_a_tick_before_and_after_the_update():
  """GPipe ticks, 2 stages, 1 microbatch, messages 1 s of bytes + 0.5 s latency; an all-reduce of nothing (2 hops
  of 0.5 s) at tick 2 (the last stage's loss, before that tick's gradient message), one before the update (the
  clipping norm) and one after it (the driver's check): each waits for every device, then holds them all."""
  tl = simulate_step([1, 2], [3, 4], [1], [1], 1, BW8, latency_s=0.5, ticks=True, overlap_sends=False,
                     update_s=[0.25, 0.25], collectives=[Collective(2, nbytes=0), Collective("before_update", nbytes=0),
                                                         Collective("after_update", nbytes=0)])
  ev = _starts(tl)
  assert ev["send_fwd", 0, 0] == (1, 2.5) and ev["fwd", 1, 0] == (2.5, 4.5) and ev["bwd", 1, 0] == (4.5, 8.5)
  assert tl.collectives[0] == Event("collective", 0, -1, 8.5, 9.5)
  assert ev["send_bwd", 0, 0] == (9.5, 11) and ev["bwd", 0, 0] == (11, 14)
  assert tl.collectives[1:] == (Event("collective", 1, -1, 14, 15), Event("collective", 2, -1, 15.25, 16.25))
  assert [(u.start, u.end) for u in tl.updates] == [(15, 15.25)] * 2
  assert tl.makespan == 16.25
  assert [e.kind for e in tl.critical_path] == ["fwd", "send_fwd", "fwd", "bwd", "collective", "send_bwd", "bwd",
                                               "collective", "update", "collective"]
  assert tl.critical_seconds() == {"compute": 10.25, "link": 6, "exchange": 0}
  # the bytes of a collective cross at the bandwidth, after its rounds
  heavy = simulate_step([1, 2], [3, 4], [1], [1], 1, BW8, latency_s=0.5, ticks=True, overlap_sends=False,
                        collectives=[Collective("after_update", ranks=3, nbytes=16)])
  assert heavy.collectives[0].end - heavy.collectives[0].start == 4 * (0.5 + 16)  # 2 (3 - 1) hops: the replicas' ring


# --- closed form ---------------------------------------------------------------------------


# --- properties ------------------------------------------------------------------------


# --- input validation ---------------------------------------------------------------------


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


def test_ticks_run_a_given_tables_own_sends_unless_told():
  """With ticks and overlap_sends left out, a schedule, table or plan given runs as its forwarding delay says
  (`overlapped_sends`), and a name runs its plain table: a caller timing a run's table does not say it twice."""
  args = ([1.0, 1.0], [1.0, 1.0], [2.0], [2.0], 4, BW8)
  told = {}
  for overlap in (False, True):
    schedule = schedules.parse("gpipe", overlap)
    told[overlap] = simulate_step(*args, ticks=True, overlap_sends=overlap).makespan
    for passed in (schedule, schedule.train_table(2, 4), plan.Plan(schedule.train_table(2, 4))):
      assert simulate_step(*args, schedule=passed, ticks=True).makespan == told[overlap], (overlap, passed)
  assert told[True] != told[False]
  assert simulate_step(*args, ticks=True).makespan == told[False]


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
      assert at_least(tl.makespan, simulate_step(*args, schedule=table, exchange=Exchange([4.0] * S, 1)).makespan)
      path = tl.critical_path
      assert path[0].start == 0 and path[-1].end == tl.makespan
      assert gapless(path, args[-1])


def test_tied_exchange_after_and_before_the_data_parallel_exchange():
  """The 1f1b timeline above (stage 0 done at 17, stage 1 at 14.5: its last message has left) with a tied pair on
  devices 0 and 1: 3 bytes each way (3 s), one message (0.5 s latency), 0.25 s of codec work. After the exchanges (the dense or compressed mean:
  ties after it) it starts when both exchanges have ended; before them (QuantizedAdam) when both stages are done,
  and the exchanges wait for it. The updates wait for each device's last event."""
  run = lambda before: simulate_step([1, 2], [2, 3], [1], [2], 2, BW8, latency_s=0.5, exchange=Exchange([4, 1], 2),
                                     schedule="1f1b", update_s=[1, 2],
                                     tied=Tied([(0, 1)], [3], 1, [0.25], before_exchange=before))
  after = run(False)
  assert after.exchanges == (Event("exchange", 0, -1, 17, 22), Event("exchange", 1, -1, 14.5, 16.5))
  assert after.tied == (Event("tied", 0, -1, 22, 25.75),)
  assert after.updates == (Event("update", 0, -1, 25.75, 26.75), Event("update", 1, -1, 25.75, 27.75))
  assert after.makespan == 27.75
  assert [e.kind for e in after.critical_path[-3:]] == ["exchange", "tied", "update"]
  assert after.critical_seconds() == {"compute": 15, "link": 4, "exchange": 5, "tied": 3.75}
  before = run(True)
  assert before.tied == (Event("tied", 0, -1, 17, 20.75),)
  assert before.exchanges == (Event("exchange", 0, -1, 20.75, 25.75), Event("exchange", 1, -1, 20.75, 22.75))
  assert before.updates == (Event("update", 0, -1, 25.75, 26.75), Event("update", 1, -1, 22.75, 24.75))
  assert before.makespan == 26.75
  no_tie = simulate_step([1, 2], [2, 3], [1], [2], 2, BW8, latency_s=0.5, exchange=Exchange([4, 1], 2),
                         schedule="1f1b", update_s=[1, 2])
  assert no_tie.makespan == 23 and no_tie.tied == () and "tied" not in no_tie.critical_seconds()


def test_a_tied_pair_couples_only_its_two_devices():
  """3 stages, GPipe, the pair on devices 0 and 2: device 1 updates right after its own last op."""
  tl = simulate_step([1, 1, 1], [1, 1, 1], [0, 0], [0, 0], 1, BW8, update_s=[0, 0, 0], tied=Tied([(0, 2)], [8]))
  assert tl.pipeline_end == 6 and tl.tied == (Event("tied", 0, -1, 6, 14),)
  assert [u.start for u in tl.updates] == [14, 5, 14]
  for bad, match in [(Tied([(0, 0)], [1]), r"tied.ends\[0\] must be two different devices"),
                     (Tied([(0, 3)], [1]), r"tied.ends\[0\] must be two different devices in 0..2"),
                     (Tied([(0, 2)], [1, 2]), "tied.sent_bytes has 2 entries but tied.ends has 1"),
                     (Tied([(0, 2)], [-1]), r"tied.sent_bytes\[0\] must be a finite number of bytes")]:
    with pytest.raises(ValueError, match=match):
      simulate_step([1, 1, 1], [1, 1, 1], [0, 0], [0, 0], 1, BW8, tied=bad)
