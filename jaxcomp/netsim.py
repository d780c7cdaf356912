"""Timeline simulator for one GPipe training step over a chain of pipeline stages.

Pure Python; no JAX. It turns measured
per-stage compute times and exact per-boundary wire bytes into a step time at a given
link bandwidth and latency, which is how AQ-SGD's Table 2 (throughput vs bandwidth)
is reproduced from single-machine measurements.

Model
-----
``S`` stages in a chain, ``M`` microbatches. Boundary (link) ``b`` joins stage ``b`` and
stage ``b + 1``; there are ``S - 1`` links. Per microbatch, stage ``s`` spends
``fwd_s[s]`` seconds on its forward and ``bwd_s[s]`` on its backward; link ``b`` carries
``fwd_bytes[b]`` bytes forward (activation) and ``bwd_bytes[b]`` bytes backward
(activation-gradient). One message takes::

    T_f[b] = latency_s + 8 * fwd_bytes[b] / bandwidth_bps
    T_b[b] = latency_s + 8 * bwd_bytes[b] / bandwidth_bps

Resources and their fixed operation order (GPipe with a flush):

* stage ``s`` (one op at a time): ``fwd(s, 0), ..., fwd(s, M-1)``, then
  ``bwd(s, M-1), ..., bwd(s, 0)``;
* forward direction of link ``b`` (one message at a time, occupied for the whole
  ``T_f[b]``, latency included): ``send_fwd(b, 0), ..., send_fwd(b, M-1)``;
* backward direction of link ``b`` (independent of the forward direction: full duplex):
  ``send_bwd(b, M-1), ..., send_bwd(b, 0)``.

Both link directions are FIFO in the order the messages are produced. Every op starts as
soon as its resource has finished the previous op in its order and its input has arrived::

    fwd(s, m).start      = max(stage s free, send_fwd(s-1, m).end)  # s = 0: input at t = 0
    send_fwd(b, m).start = max(link b fwd free, fwd(b, m).end)
    bwd(s, m).start      = max(stage s free, send_bwd(s, m).end)    # s = S-1: no input
    send_bwd(b, m).start = max(link b bwd free, bwd(b+1, m).end)
    end = start + duration

Because stage ``s`` runs all its forwards before any backward, the last stage starts
``bwd(S-1, M-1)`` right after ``fwd(S-1, M-1)`` (its loss is part of its compute), and no
backward anywhere starts before that last forward has ended. The step makespan is the end
of the last op (``bwd(0, 0)``) plus ``dp_allreduce_s``, a data-parallel gradient
all-reduce modelled as starting only after the whole pipeline has drained (no overlap).

With zero communication and uniform stages (``t_f``, ``t_b``) this gives the classic
GPipe step time ``(M + S - 1) * (t_f + t_b)``. Since every time is built from ``max`` and
``+`` over a fixed order, the makespan never decreases when any duration grows: more
bandwidth or fewer bytes never slow a step.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Kind = Literal["fwd", "bwd", "send_fwd", "send_bwd"]

# The bandwidths of AQ-SGD's Table 2.
DEFAULT_BANDWIDTHS_BPS = (10e9, 1e9, 500e6, 300e6, 100e6)


@dataclass(frozen=True)
class Event:
    """One compute op or one message.

    ``index`` is the stage for ``fwd``/``bwd`` and the link ``b`` (stage ``b`` to ``b + 1``)
    for ``send_fwd``/``send_bwd``. Times are seconds from the start of the step.
    """

    kind: Kind
    index: int
    microbatch: int
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """All events of one step, listed stage by stage in evaluation order (not by time)."""

    events: tuple[Event, ...]
    pipeline_end: float  # end of the last compute op
    dp_allreduce_s: float

    @property
    def makespan(self) -> float:
        """Step time in seconds: pipeline drain plus the data-parallel all-reduce."""
        return self.pipeline_end + self.dp_allreduce_s


@dataclass(frozen=True)
class SweepRow:
    config: str
    bandwidth_bps: float
    makespan_s: float
    samples_per_s: float


def _check_time(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _check_bandwidth(bandwidth_bps: float) -> None:
    if not bandwidth_bps > 0:  # also rejects NaN; +inf means free transfers
        raise ValueError(f"bandwidth_bps must be > 0, got {bandwidth_bps!r}")


def _check_microbatches(microbatches: int) -> None:
    if (
        not isinstance(microbatches, numbers.Integral)
        or isinstance(microbatches, bool)
        or microbatches < 1
    ):
        raise ValueError(f"microbatches must be an integer >= 1, got {microbatches!r}")


def _check_stage_times(fwd_s: Sequence[float], bwd_s: Sequence[float]) -> None:
    if len(fwd_s) == 0:
        raise ValueError("fwd_s must list at least one stage, got an empty sequence")
    if len(bwd_s) != len(fwd_s):
        raise ValueError(
            f"bwd_s has {len(bwd_s)} entries but fwd_s has {len(fwd_s)} (one per stage)"
        )
    for name, values in (("fwd_s", fwd_s), ("bwd_s", bwd_s)):
        for i, v in enumerate(values):
            _check_time(f"{name}[{i}]", v)


def _check_link_bytes(name: str, values: Sequence[float], num_stages: int) -> None:
    if len(values) != num_stages - 1:
        raise ValueError(
            f"{name} has {len(values)} entries but {num_stages} stages have "
            f"{num_stages - 1} links (one entry per link)"
        )
    for i, v in enumerate(values):
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{name}[{i}] must be a finite number of bytes >= 0, got {v!r}")


def transfer_time(nbytes: float, bandwidth_bps: float, latency_s: float) -> float:
    """Seconds to send one message: ``latency_s + 8 * nbytes / bandwidth_bps``."""
    _check_time("nbytes", nbytes)
    _check_bandwidth(bandwidth_bps)
    _check_time("latency_s", latency_s)
    return latency_s + 8.0 * nbytes / bandwidth_bps


def simulate_step(
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
    fwd_bytes: Sequence[float],
    bwd_bytes: Sequence[float],
    microbatches: int,
    bandwidth_bps: float,
    latency_s: float = 0.0,
    dp_allreduce_s: float = 0.0,
) -> Timeline:
    """Event timeline of one GPipe step (rule in the module docstring).

    ``fwd_s``/``bwd_s``: per-stage compute seconds per microbatch (length ``S``).
    ``fwd_bytes``/``bwd_bytes``: per-link bytes per microbatch (length ``S - 1``).
    """
    _check_stage_times(fwd_s, bwd_s)
    num_stages = len(fwd_s)
    _check_link_bytes("fwd_bytes", fwd_bytes, num_stages)
    _check_link_bytes("bwd_bytes", bwd_bytes, num_stages)
    _check_microbatches(microbatches)
    _check_bandwidth(bandwidth_bps)
    _check_time("latency_s", latency_s)
    _check_time("dp_allreduce_s", dp_allreduce_s)

    t_fwd = [transfer_time(n, bandwidth_bps, latency_s) for n in fwd_bytes]
    t_bwd = [transfer_time(n, bandwidth_bps, latency_s) for n in bwd_bytes]
    stage_free = [0.0] * num_stages
    link_fwd_free = [0.0] * (num_stages - 1)
    link_bwd_free = [0.0] * (num_stages - 1)
    events: list[Event] = []

    # Forward phase. Data only flows from stage s to s + 1, so stage by stage is a valid
    # evaluation order of the recurrence.
    arrived = [0.0] * microbatches  # when microbatch m's input is at the current stage
    for s in range(num_stages):
        for m in range(microbatches):
            start = max(stage_free[s], arrived[m])
            stage_free[s] = start + fwd_s[s]
            events.append(Event("fwd", s, m, start, stage_free[s]))
            if s < num_stages - 1:
                send = max(link_fwd_free[s], stage_free[s])
                link_fwd_free[s] = send + t_fwd[s]
                events.append(Event("send_fwd", s, m, send, link_fwd_free[s]))
                arrived[m] = link_fwd_free[s]

    # Backward phase: last stage first, microbatches in reverse. stage_free carries each
    # stage's end of forwards, which enforces the GPipe flush.
    arrived = [0.0] * microbatches
    for s in reversed(range(num_stages)):
        for m in reversed(range(microbatches)):
            start = max(stage_free[s], arrived[m])
            stage_free[s] = start + bwd_s[s]
            events.append(Event("bwd", s, m, start, stage_free[s]))
            if s > 0:
                send = max(link_bwd_free[s - 1], stage_free[s])
                link_bwd_free[s - 1] = send + t_bwd[s - 1]
                events.append(Event("send_bwd", s - 1, m, send, link_bwd_free[s - 1]))
                arrived[m] = link_bwd_free[s - 1]

    return Timeline(tuple(events), max(e.end for e in events), float(dp_allreduce_s))


def throughput(samples_per_step: float, timeline: Timeline) -> float:
    """Training throughput in samples per second."""
    if not (math.isfinite(samples_per_step) and samples_per_step > 0):
        raise ValueError(f"samples_per_step must be a finite number > 0, got {samples_per_step!r}")
    if timeline.makespan <= 0:
        raise ValueError(f"throughput is undefined for a makespan of {timeline.makespan!r} s")
    return samples_per_step / timeline.makespan


def sweep(
    bandwidths_bps: Sequence[float],
    configs: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
    microbatches: int,
    latency_s: float = 0.0,
    *,
    samples_per_step: float,
    dp_allreduce_s: float = 0.0,
) -> list[SweepRow]:
    """Simulate every ``(config, bandwidth)`` pair; ``configs`` maps a name to
    ``(fwd_bytes, bwd_bytes)``. Rows come config-major, in the given orders."""
    if not configs:
        raise ValueError("configs must name at least one (fwd_bytes, bwd_bytes) pair")
    if len(bandwidths_bps) == 0:
        raise ValueError("bandwidths_bps must list at least one bandwidth")
    rows = []
    for name, (fwd_bytes, bwd_bytes) in configs.items():
        for bandwidth in bandwidths_bps:
            try:
                timeline = simulate_step(
                    fwd_s, bwd_s, fwd_bytes, bwd_bytes, microbatches, bandwidth,
                    latency_s, dp_allreduce_s,
                )
            except ValueError as err:
                raise ValueError(f"config {name!r}: {err}") from err
            rows.append(
                SweepRow(name, bandwidth, timeline.makespan, throughput(samples_per_step, timeline))
            )
    return rows


def format_bandwidth(bandwidth_bps: float) -> str:
    """``10e9 -> '10 Gbps'``, ``300e6 -> '300 Mbps'``."""
    for scale, unit in ((1e9, "Gbps"), (1e6, "Mbps"), (1e3, "kbps")):
        if bandwidth_bps >= scale:
            return f"{bandwidth_bps / scale:g} {unit}"
    return f"{bandwidth_bps:g} bps"


def render_markdown(rows: Sequence[SweepRow], baseline: str | None = None) -> str:
    """Markdown table of samples/s: one row per config, one column per bandwidth.

    With ``baseline`` (a config name), each cell also shows the speedup over it.
    """
    configs = list(dict.fromkeys(r.config for r in rows))
    bandwidths = list(dict.fromkeys(r.bandwidth_bps for r in rows))
    cell = {(r.config, r.bandwidth_bps): r.samples_per_s for r in rows}
    if baseline is not None and baseline not in configs:
        raise ValueError(f"baseline {baseline!r} is not one of the configs {configs}")
    lines = [
        "| config | " + " | ".join(format_bandwidth(b) for b in bandwidths) + " |",
        "|---|" + "---:|" * len(bandwidths),
    ]
    for name in configs:
        cells = []
        for bw in bandwidths:
            if (name, bw) not in cell:
                raise ValueError(f"no row for config {name!r} at {format_bandwidth(bw)}")
            text = f"{cell[name, bw]:.2f}"
            if baseline is not None:
                text += f" ({cell[name, bw] / cell[baseline, bw]:.1f}x)"
            cells.append(text)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
