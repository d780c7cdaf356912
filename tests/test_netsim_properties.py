"""netsim's invariants on random pipelines (more bandwidth or fewer bytes never slow a step; lower bounds; every
event in order), GPipe's formula, and its refusals of bad inputs."""
import math
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jaxcomp.analysis import netsim
from jaxcomp.analysis.netsim import Collective, Exchange, simulate_step
from jaxcomp.parallel import schedules
from netsim_cases import FUSED, at_least, executor_orders, gapless, message_bytes, seconds, sent_at


@pytest.mark.parametrize("name", FUSED)  # the fused-backward schedules (ZB-H1's bubble is smaller)
@pytest.mark.parametrize("stages,microbatches", [(2, 2), (2, 1), (3, 5), (4, 8), (8, 3)])
@pytest.mark.parametrize("t_f,t_b", [(1.0, 2.0), (2.0, 1.0)])
def test_uniform_stages_without_communication_give_gpipe_formula(name, stages, microbatches, t_f, t_b):
  # (M + S - 1)(t_f + t_b); the 1F1B schedules have GPipe's bubble (they save memory, not time)
  tl = simulate_step([t_f] * stages, [t_b] * stages, [1e9] * (stages - 1), [1e9] * (stages - 1), microbatches,
                     math.inf, schedule=name)
  assert tl.makespan == (microbatches + stages - 1) * (t_f + t_b)


@st.composite
def pipelines(draw):
  s = draw(st.integers(1, 5))
  exchange = draw(st.none() | st.builds(Exchange, st.lists(message_bytes, min_size=s, max_size=s), st.integers(0, 6)))
  return dict(
      fwd_s=draw(st.lists(seconds, min_size=s, max_size=s)),
      bwd_s=draw(st.lists(seconds, min_size=s, max_size=s)),
      fwd_bytes=draw(st.lists(message_bytes, min_size=s - 1, max_size=s - 1)),
      bwd_bytes=draw(st.lists(message_bytes, min_size=s - 1, max_size=s - 1)),
      microbatches=draw(st.integers(1, 6)),
      bandwidth_bps=draw(st.floats(1.0, 1e5)),
      latency_s=draw(seconds),
      exchange=exchange,
      schedule=draw(st.sampled_from(FUSED)),  # fused backwards: the invariants count F and BW events
  )


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
    assert at_least(tl.makespan, m * (f + b))
  for nf, nb in zip(p["fwd_bytes"], p["bwd_bytes"]):  # a link direction sends bytes serially; the last lands L later
    assert at_least(tl.makespan, m * t(nf) - (m - 1) * p["latency_s"])
    assert at_least(tl.makespan, m * t(nb) - (m - 1) * p["latency_s"])
  one_microbatch_path = (
      sum(p["fwd_s"]) + sum(p["bwd_s"])
      + sum(map(t, p["fwd_bytes"])) + sum(map(t, p["bwd_bytes"]))
  )
  assert at_least(tl.makespan, one_microbatch_path)


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
  # FIFO in production order (microbatch order, under every schedule), a message leaving once the one before
  # has sent its last byte (the latency holds no link).
  sent = lambda e: sent_at(e, p["latency_s"])
  orders = [[ev[kind, s, m] for kind, m in ops]
            for s, ops in enumerate(executor_orders(p["schedule"], s_count, m_count))]
  orders += [[ev[kind, b, m] for m in mbs] for kind in ("send_fwd", "send_bwd") for b in range(s_count - 1)]
  previous = {}
  for order in orders:
    for before, after in zip(order, order[1:]):
      assert after.start >= sent(before) - 1e-9
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
    ready = [x for x in (sent(previous[e]) if e in previous else None, needs[e].end if e in needs else None)
             if x is not None]
    assert e.start == pytest.approx(max(ready, default=0.0), abs=1e-9)

  # Each stage's exchange starts once the stage and its outgoing links are done.
  waits_for = {e: [x for x in (previous.get(e), needs.get(e)) if x is not None] for e in tl.events}
  if p["exchange"] is None:
    assert tl.exchanges == () and tl.makespan == tl.pipeline_end
  for s, x in enumerate(tl.exchanges):
    waits_for[x] = [e for e in tl.events if (e.kind in ("fwd", "bwd") and e.index == s)
                    or (e.kind == "send_fwd" and e.index == s) or (e.kind == "send_bwd" and e.index == s - 1)]
    assert (x.kind, x.index) == ("exchange", s)
    assert x.start == pytest.approx(max(sent(e) for e in waits_for[x]), abs=1e-9)
    assert x.end - x.start == pytest.approx(netsim.transfer_time(
        p["exchange"].sent_bytes[s], p["bandwidth_bps"], p["latency_s"], p["exchange"].messages), abs=1e-9)

  # The critical path runs from t = 0 to the makespan along dependencies, without gaps.
  path = tl.critical_path
  assert path[0].start == 0 and path[-1].end == tl.makespan
  for before, after in zip(path, path[1:]):
    assert before in waits_for[after]
  assert gapless(path, p["latency_s"])
  assert sum(tl.critical_seconds().values()) == pytest.approx(tl.makespan, rel=1e-9, abs=1e-9)


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
        (dict(schedule=schedules.GPipe().train_table(2, 2), ticks=True, overlap_sends=True),
         r"schedule 'gpipe' has forwarding delay 1, so with ticks=True overlap_sends must be False .*got True"),
        (dict(exchange=Exchange([1.0], 2)), r"exchange.sent_bytes has 1 entries but the pipeline has 2 stages"),
        (dict(exchange=Exchange([1.0, -2.0], 2)), r"exchange.sent_bytes\[1\].*-2\.0"),
        (dict(exchange=Exchange([1.0, 1.0], -1)), r"exchange.messages must be an integer >= 0, got -1"),
        (dict(meter="outbound"), r"meter must be one of \['per_direction', 'inbound'\], got 'outbound'"),
        (dict(collectives=[Collective(1)]), r"collectives\[0\] runs at tick 1: a collective at a tick needs "
                                            r"ticks=True"),
        (dict(collectives=[Collective(6)], ticks=True, overlap_sends=False),
         r"collectives\[0\].at must be a tick in \[0, 6\) or 'before_update' or 'after_update', got 6"),
        (dict(collectives=[Collective("after_update", 0)]), r"collectives\[0\].ranks must be an integer >= 1, got 0"),
        (dict(protocol="lazy"), r"protocol must be one of \['eager', 'rendezvous'\], got 'lazy'"),
        (dict(protocol="rendezvous"), r"protocol 'rendezvous' is the executor's \(ticks=True, meter='per_direction'\), "
                                      r"got ticks=False"),
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

