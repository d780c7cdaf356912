"""netsim: hand-computed GPipe schedules, schedule invariants and monotonicity."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcomp import netsim
from jaxcomp.netsim import Event, simulate_step

# With bandwidth_bps = 8, sending n bytes takes n seconds: hand timelines stay readable.
BW8 = 8.0


def _sorted(events):
    return sorted(events, key=lambda e: (e.kind, e.index, e.microbatch))


# --- hand-computed schedules -------------------------------------------------------------


def test_one_microbatch_two_stages_is_a_chain():
    # transfer = latency + 8 * bytes / bandwidth: 0.25 + 1 forward, 0.25 + 3 backward.
    tl = simulate_step([1.5, 2.0], [3.0, 4.0], [100], [300], 1, 800.0, latency_s=0.25)
    assert tl.makespan == 1.5 + 1.25 + 2.0 + 4.0 + 3.25 + 3.0


@pytest.mark.parametrize("stages,microbatches", [(2, 2), (2, 1), (3, 5), (4, 8)])
def test_uniform_stages_without_communication_give_gpipe_formula(stages, microbatches):
    t_f, t_b = 1.0, 2.0
    tl = simulate_step(
        [t_f] * stages, [t_b] * stages, [1e9] * (stages - 1), [1e9] * (stages - 1),
        microbatches, math.inf,
    )
    assert tl.makespan == (microbatches + stages - 1) * (t_f + t_b)


def test_busy_stage_delays_arrived_input():
    # Stage 1 is slow: microbatch 1 arrives at t=3 but waits until stage 1 is free at 5.
    tl = simulate_step([1, 3], [2, 4], [1], [2], 2, BW8)
    expected = [
        Event("fwd", 0, 0, 0, 1), Event("fwd", 0, 1, 1, 2),
        Event("send_fwd", 0, 0, 1, 2), Event("send_fwd", 0, 1, 2, 3),
        Event("fwd", 1, 0, 2, 5), Event("fwd", 1, 1, 5, 8),
        Event("bwd", 1, 1, 8, 12), Event("bwd", 1, 0, 12, 16),
        Event("send_bwd", 0, 1, 12, 14), Event("send_bwd", 0, 0, 16, 18),
        Event("bwd", 0, 1, 14, 16), Event("bwd", 0, 0, 18, 20),
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
        Event("bwd", 1, 2, 32, 34), Event("bwd", 1, 1, 34, 36), Event("bwd", 1, 0, 36, 38),
        Event("send_bwd", 0, 2, 34, 44), Event("send_bwd", 0, 1, 44, 54),
        Event("send_bwd", 0, 0, 54, 64),
        Event("bwd", 0, 2, 44, 46), Event("bwd", 0, 1, 54, 56), Event("bwd", 0, 0, 64, 66),
    ]
    assert _sorted(tl.events) == _sorted(expected)
    assert tl.makespan == fwd[0] + m * t + fwd[1] + bwd[1] + m * t + bwd[0] == 66


def test_single_stage_has_no_links():
    tl = simulate_step([1.0], [2.0], [], [], 4, BW8)
    assert {e.kind for e in tl.events} == {"fwd", "bwd"}
    assert tl.makespan == 4 * 3.0


def test_dp_allreduce_is_added_after_the_pipeline_drains():
    args = ([1, 3], [2, 4], [1], [2], 2, BW8)
    plain = simulate_step(*args)
    with_dp = simulate_step(*args, dp_allreduce_s=2.5)
    assert with_dp.events == plain.events
    assert with_dp.pipeline_end == plain.makespan == 20
    assert with_dp.makespan == 22.5


def test_throughput_is_samples_over_makespan():
    tl = simulate_step([1, 3], [2, 4], [1], [2], 2, BW8, dp_allreduce_s=5)
    assert netsim.throughput(50, tl) == 2.0


def test_transfer_time():
    assert netsim.transfer_time(125_000, 1e9, 0.5) == 0.5 + 1e-3


# --- properties ------------------------------------------------------------------------

_time = st.floats(0, 10, allow_nan=False)
_bytes = st.floats(0, 1e4, allow_nan=False)


@st.composite
def pipelines(draw):
    s = draw(st.integers(1, 5))
    return dict(
        fwd_s=draw(st.lists(_time, min_size=s, max_size=s)),
        bwd_s=draw(st.lists(_time, min_size=s, max_size=s)),
        fwd_bytes=draw(st.lists(_bytes, min_size=s - 1, max_size=s - 1)),
        bwd_bytes=draw(st.lists(_bytes, min_size=s - 1, max_size=s - 1)),
        microbatches=draw(st.integers(1, 6)),
        bandwidth_bps=draw(st.floats(1.0, 1e5)),
        latency_s=draw(_time),
    )


def _at_least(value, bound):
    return value >= bound - 1e-9 * max(1.0, bound)


@settings(deadline=None, max_examples=60)
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
    # Each resource runs its ops one at a time in the GPipe order.
    orders = [
        [ev["fwd", s, m] for m in mbs] + [ev["bwd", s, m] for m in reversed(mbs)]
        for s in range(s_count)
    ]
    orders += [[ev["send_fwd", b, m] for m in mbs] for b in range(s_count - 1)]
    orders += [[ev["send_bwd", b, m] for m in reversed(mbs)] for b in range(s_count - 1)]
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
        assert ev["bwd", s_count - 1, m].start >= ev["fwd", s_count - 1, m_count - 1].end
    for after, before in needs.items():
        assert after.start >= before.end

    # Nothing waits longer than it has to.
    for e in tl.events:
        ready = [x.end for x in (previous.get(e), needs.get(e)) if x is not None]
        assert e.start == max(ready, default=0.0)


# --- input validation ---------------------------------------------------------------------

GOOD = dict(
    fwd_s=[1.0, 1.0], bwd_s=[2.0, 2.0], fwd_bytes=[10], bwd_bytes=[10],
    microbatches=2, bandwidth_bps=1e6, latency_s=0.0, dp_allreduce_s=0.0,
)


@pytest.mark.parametrize(
    "override,message",
    [
        (dict(fwd_s=[1.0, -1.0]), r"fwd_s\[1\].*-1\.0"),
        (dict(bwd_s=[2.0, math.nan]), r"bwd_s\[1\].*nan"),
        (dict(fwd_s=[], bwd_s=[], fwd_bytes=[], bwd_bytes=[]), r"fwd_s .*empty"),
        (dict(bwd_s=[2.0]), r"bwd_s has 1 entries but fwd_s has 2"),
        (dict(fwd_bytes=[-5]), r"fwd_bytes\[0\].*-5"),
        (dict(bwd_bytes=[10, 10]), r"bwd_bytes has 2 entries.*2 stages have 1 links"),
        (dict(fwd_bytes=[math.inf]), r"fwd_bytes\[0\].*inf"),
        (dict(bandwidth_bps=0), r"bandwidth_bps must be > 0, got 0"),
        (dict(bandwidth_bps=-1e9), r"bandwidth_bps.*-1000000000\.0"),
        (dict(bandwidth_bps=math.nan), r"bandwidth_bps.*nan"),
        (dict(latency_s=-0.1), r"latency_s.*-0\.1"),
        (dict(dp_allreduce_s=-2.0), r"dp_allreduce_s.*-2\.0"),
        (dict(microbatches=0), r"microbatches.*got 0"),
        (dict(microbatches=1.5), r"microbatches.*got 1\.5"),
        (dict(microbatches=True), r"microbatches.*got True"),
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


# --- sweep and table -----------------------------------------------------------------------

# 125 MB takes 1 s at 1 Gbps and 10 s at 100 Mbps; 12.5 MB a tenth of that.
CONFIGS = {"big": ([125e6], [125e6]), "small": ([12.5e6], [12.5e6])}


def test_sweep_rows_match_individual_simulations():
    rows = netsim.sweep([1e9, 100e6], CONFIGS, [1, 1], [1, 1], 1, samples_per_step=12)
    assert [(r.config, r.bandwidth_bps) for r in rows] == [
        ("big", 1e9), ("big", 100e6), ("small", 1e9), ("small", 100e6),
    ]
    # compute 4 s + one message each way
    assert [r.makespan_s for r in rows] == pytest.approx([6, 24, 4.2, 6])
    assert [r.samples_per_s for r in rows] == pytest.approx([2, 0.5, 12 / 4.2, 2])


def test_sweep_rejects_empty_inputs():
    with pytest.raises(ValueError, match="configs"):
        netsim.sweep([1e9], {}, [1], [1], 1, samples_per_step=1)
    with pytest.raises(ValueError, match="bandwidths_bps"):
        netsim.sweep([], CONFIGS, [1, 1], [1, 1], 1, samples_per_step=1)
    with pytest.raises(ValueError, match=r"config 'bad': bwd_bytes\[0\].*-1"):
        netsim.sweep([1e9], {"bad": ([1], [-1])}, [1, 1], [1, 1], 1, samples_per_step=1)


def test_render_markdown_with_speedups():
    rows = netsim.sweep([1e9, 100e6], CONFIGS, [1, 1], [1, 1], 1, samples_per_step=12)
    assert netsim.render_markdown(rows, baseline="big") == "\n".join([
        "| config | 1 Gbps | 100 Mbps |",
        "|---|---:|---:|",
        "| big | 2.00 (1.0x) | 0.50 (1.0x) |",
        "| small | 2.86 (1.4x) | 2.00 (4.0x) |",
    ])
    assert netsim.render_markdown(rows).splitlines()[3] == "| small | 2.86 | 2.00 |"


def test_render_markdown_rejects_unknown_baseline_and_missing_cells():
    rows = netsim.sweep([1e9, 100e6], CONFIGS, [1, 1], [1, 1], 1, samples_per_step=12)
    with pytest.raises(ValueError, match="baseline 'fp32'"):
        netsim.render_markdown(rows, baseline="fp32")
    with pytest.raises(ValueError, match="'small' at 100 Mbps"):
        netsim.render_markdown(rows[:-1])


@pytest.mark.parametrize(
    "bps,text",
    [(10e9, "10 Gbps"), (1.5e9, "1.5 Gbps"), (500e6, "500 Mbps"), (2e3, "2 kbps"), (8, "8 bps")],
)
def test_format_bandwidth(bps, text):
    assert netsim.format_bandwidth(bps) == text
