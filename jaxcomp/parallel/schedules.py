"""Pipeline schedules as typed values: each builds its train timetable and its forward-only eval timetable.

A schedule is a frozen dataclass (`GPipe()`, `OneFOneB(fused=False)`, `ZeroBubbleH1()`,
`Interleaved(chunks=V)`) whose `train_table(S, M)` is the `timetable.Timetable` of its ops for S stage devices
and M microbatches, and whose `eval_table(S, M)` is the forward pass eval steps run. Its one knob beside its own
fields is `forwarding_delay`: the ticks from the end of the tick a message is sent to the tick it is used
(MaxText's `forwarding_delay`): 1, or 2 with overlapped sends (`timetable.OVERLAPPED_SENDS`: the message
crosses its link during the tick between, while both ends compute; S-1 more ticks each way, M >= 2S).

`parse` reads the command line's spelling ("1f1b", "interleaved:2", with `--overlap`) into one: the one place
a schedule's name is read. The sharded executor, the network simulator and the bubble table take the value.
"""
import abc
import dataclasses
import functools

from jaxcomp.arguments import is_integer
from jaxcomp.parallel import timetable
from jaxcomp.parallel.timetable import Op, Timetable


@dataclasses.dataclass(frozen=True)
class Schedule(abc.ABC):
  """A schedule: its train and eval timetables for S stage devices and M microbatches."""
  forwarding_delay: int = dataclasses.field(default=1, kw_only=True)

  splits_backward = False  # whether its backwards are split into B (input gradient) and W (weight gradient)

  def __post_init__(self):
    if self.forwarding_delay not in timetable.FORWARDING_DELAYS:
      raise ValueError(f"forwarding_delay must be one of {timetable.FORWARDING_DELAYS} ticks (2: overlapped "
                       f"sends), got {self.forwarding_delay!r}")

  @property
  def overlapped_sends(self) -> bool:
    """Whether its messages cross their links while both ends compute (`timetable.Timetable.overlapped_sends`)."""
    return self.forwarding_delay == timetable.OVERLAPPED_SENDS

  @property
  @abc.abstractmethod
  def name(self) -> str:
    """Its command-line spelling (`parse` reads it back), without the forwarding delay."""

  @property
  def chunks_per_device(self) -> int:
    """V: the chunks (consecutive stages of the model) each device holds, chunk c on device c mod S."""
    return 1

  def model_stages(self, stage_devices: int) -> int:
    """The stages a model is cut into for `stage_devices` devices: S V."""
    return stage_devices * self.chunks_per_device

  def with_overlapped_sends(self) -> "Schedule":
    """This schedule with overlapped sends: a forwarding delay of `timetable.OVERLAPPED_SENDS` ticks."""
    return dataclasses.replace(self, forwarding_delay=timetable.OVERLAPPED_SENDS)

  def check(self, num_stages: int, microbatches: int) -> None:
    """The ValueErrors `train_table` raises for these sizes, without building it (`check_overlap`)."""
    self.check_overlap(num_stages, microbatches)

  def check_overlap(self, num_stages: int, microbatches: int) -> None:
    """Overlapped sends need M >= 2S: each message then takes two ticks, and with fewer microbatches the
    pipeline never has every stage computing while every link carries a message (no steady ticks), so the S-1
    extra ticks each way cost more than the overlap can hide. A ValueError naming the values and the fix."""
    if self.overlapped_sends and microbatches < 2 * num_stages:
      raise ValueError(f"overlapped sends (--overlap) need at least 2S microbatches per data shard: got M="
                       f"{microbatches} for S={num_stages} stages; use --microbatches {2 * num_stages} (or more), "
                       "or drop --overlap")

  @abc.abstractmethod
  def train_table(self, num_stages: int, microbatches: int) -> Timetable:
    """The timetable a train step runs (`check`ed first)."""

  def eval_table(self, num_stages: int, microbatches: int) -> Timetable:
    """The forward pass an eval step runs: GPipe's forward ticks (F(s, m) at tick m + s), messages the tick
    after they are sent."""
    return GPipe().train_table(num_stages, microbatches)


def fused_backward(num_stages: int, microbatches: int, forward_tick, backward_tick) -> dict[Op, int]:
  """F(s, m) at forward_tick(s, m) and BW(s, m) at backward_tick(s, m) for every stage and microbatch."""
  ticks = {}
  for s in range(num_stages):
    for m in range(microbatches):
      ticks[Op("F", s, m)], ticks[Op("BW", s, m)] = forward_tick(s, m), backward_tick(s, m)
  return ticks


@dataclasses.dataclass(frozen=True)
class GPipe(Schedule):
  """Every forward, then every backward: F(s, m) at tick m + hs, BW(s, m) at m + M + 2h(S-1) - hs, h the
  forwarding delay (2M+2h(S-1) ticks, M inputs held per stage)."""

  @property
  def name(self) -> str:
    return "gpipe"

  def train_table(self, num_stages: int, microbatches: int) -> Timetable:
    self.check(num_stages, microbatches)
    S, M, h = num_stages, microbatches, self.forwarding_delay
    return timetable.at_ticks(self.name, S, M, fused_backward(S, M, lambda s, m: m + h * s,
                                                              lambda s, m: m + M + 2 * h * (S - 1) - h * s), h)


@dataclasses.dataclass(frozen=True)
class OneFOneB(Schedule):
  """PipeDream-flush (1F1B), h the forwarding delay. `fused=False`: one op per device per tick, F(s, m) at
  2m + hs, BW(s, m) at 2m + 2h(S-1)+1 - hs (2M+2h(S-1) ticks; min(M, S-s) inputs held on stage s for h = 1,
  about twice that for h = 2). `fused=True`: a forward and a backward per tick, F(s, m) at m + hs, BW(s, m)
  at m + 2h(S-1) - hs (M+2h(S-1) ticks; min(M, 2(S-s)-1) inputs held on stage s for h = 1)."""
  fused: bool = False

  @property
  def name(self) -> str:
    return "1f1b-fused" if self.fused else "1f1b"

  def train_table(self, num_stages: int, microbatches: int) -> Timetable:
    self.check(num_stages, microbatches)
    S, M, h = num_stages, microbatches, self.forwarding_delay
    if self.fused:
      ticks = fused_backward(S, M, lambda s, m: m + h * s, lambda s, m: m + 2 * h * (S - 1) - h * s)
    else:
      ticks = fused_backward(S, M, lambda s, m: 2 * m + h * s, lambda s, m: 2 * m + 2 * h * (S - 1) + 1 - h * s)
    return timetable.at_ticks(self.name, S, M, ticks, h)


@dataclasses.dataclass(frozen=True)
class ZeroBubbleH1(Schedule):
  """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B's order of forwards and input
  gradients, each backward split into B (its input gradient, sent upstream as soon as B ends) and W (its
  weight gradient), stage s deferring its W by hs microbatches to fill the bubbles (h the forwarding delay).
  Device s runs F(s, 0..w-1), w = min(M, h(S-s-1)+1) (1F1B's warm-up at that delay); then for j = 0..M-1:
  B(s, j), W(s, j-hs) if j >= hs, F(s, j+w) if any is left; then the W's still owed. `as_soon_as_ready`
  places them, one op per tick: 3M+S-1 ticks for h = 1 and M >= S, 3M+2(S-1) for h = 2 and M >= 2S (the
  deferred W's fill half of the S-1 extra ticks each way that overlapped sends cost 1F1B).

  Memory (h = 1): W(s, m) runs before F(s, m+S), so a device holds at most min(M, S) inputs (from F to W):
  the peak of 1F1B's first stage, now on every stage (stage s holds min(M, S) - min(M, S-s) more inputs than
  under 1F1B). With F, B and W of 1 unit and M >= S the bubble is (S-1)/(3M+S-1) (the paper's
  (S-1)(T_F+T_B-T_W) idle per device), against 1F1B's (S-1)/(M+S-1): a third of it as M/S grows (more for
  M < S, still below 1F1B's)."""

  splits_backward = True

  @property
  def name(self) -> str:
    return "zb-h1"

  def train_table(self, num_stages: int, microbatches: int) -> Timetable:
    self.check(num_stages, microbatches)
    S, M, h = num_stages, microbatches, self.forwarding_delay
    if min(S, M) < 1:
      raise ValueError(f"ZB-H1 needs S, M >= 1, got S={S}, M={M}")

    def order(s):
      warmup = min(M, h * (S - s - 1) + 1)
      ops = [Op("F", s, m) for m in range(warmup)]
      for j in range(M):
        ops += [Op("B", s, j), *([Op("W", s, j - h * s)] if j >= h * s else []),
                *([Op("F", s, j + warmup)] if j + warmup < M else [])]
      return ops + [Op("W", s, m) for m in range(max(0, M - h * s), M)]
    return timetable.as_soon_as_ready(self.name, S, M, [order(s) for s in range(S)], h)


@dataclasses.dataclass(frozen=True)
class Interleaved(Schedule):
  """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): `chunks` = V chunks per device, chunk c on device
  c mod S (its activation goes on to device (c+1) mod S: a ring). Device d's k-th forward is chunk
  (k mod SV) // S of its device on microbatch S (k // SV) + k mod S (backwards take the chunks in reverse):
  (S-d-1)*2 + (V-1)*S forwards first, then one F and one BW in turn, then the remaining BWs;
  `as_soon_as_ready` places them (forwarding delay 2: overlapped sends). Needs M a multiple of S. Bubble
  (S-1)/(VM+S-1) (F 1, BW 2). Its eval table runs all V M forwards before any backward (interleaved GPipe's
  forward pass, VM+S-1 ticks)."""
  chunks: int

  def __post_init__(self):
    super().__post_init__()
    if not is_integer(self.chunks) or self.chunks < 1:
      raise ValueError(f"interleaved 1F1B needs V >= 1 chunks per device, got {self.chunks!r}")

  @property
  def name(self) -> str:
    return f"interleaved:{self.chunks}"

  @property
  def chunks_per_device(self) -> int:
    return self.chunks

  def check(self, num_stages: int, microbatches: int) -> None:
    """`Schedule.check`, and M a multiple of S (interleaved 1F1B takes the microbatches S at a time)."""
    S, M = num_stages, microbatches
    if M % S:
      raise ValueError(f"interleaved 1F1B needs the microbatches a multiple of the stages, got M={M} for S={S} "
                       f"(use M = {M + S - M % S})")
    super().check(num_stages, microbatches)

  def train_table(self, num_stages: int, microbatches: int) -> Timetable:
    self.check(num_stages, microbatches)
    return self._table(num_stages, microbatches, forwards_first=False, delay=self.forwarding_delay)

  def eval_table(self, num_stages: int, microbatches: int) -> Timetable:
    Interleaved(self.chunks).check(num_stages, microbatches)
    return self._table(num_stages, microbatches, forwards_first=True, delay=1)

  def _table(self, num_stages: int, microbatches: int, forwards_first: bool, delay: int) -> Timetable:
    S, M, V = num_stages, microbatches, self.chunks
    if min(S, M) < 1:
      raise ValueError(f"interleaved 1F1B needs S, M, V >= 1, got S={S}, M={M}, V={V}")

    def order(d):
      def op(kind, k):
        group, r = divmod(k, S * V)
        return Op(kind, (r // S if kind == "F" else V - 1 - r // S) * S + d, group * S + r % S)
      total = V * M
      warmup = total if forwards_first else min(total, (S - d - 1) * 2 + (V - 1) * S)
      steady = [o for k in range(total - warmup) for o in (op("F", warmup + k), op("BW", k))]
      return [op("F", k) for k in range(warmup)] + steady + [op("BW", k) for k in range(total - warmup, total)]
    return timetable.as_soon_as_ready(self.name, S * V, M, [order(d) for d in range(S)], delay)


# The schedules `parse` knows by name (what `--schedule` lists), and those named NAME:V (V >= 1 chunks per
# device): adding a schedule is its class above and its entry here.
NAMED = {"gpipe": GPipe, "1f1b": OneFOneB, "1f1b-fused": functools.partial(OneFOneB, fused=True),
         "zb-h1": ZeroBubbleH1}
PER_DEVICE_CHUNKS = {"interleaved": Interleaved}
SCHEDULES = tuple(NAMED)


def parse(text: str, overlap: bool = False) -> Schedule:
  """The schedule `text` names: one of SCHEDULES, or interleaved:V (V >= 1 chunks per device); `overlap`:
  with overlapped sends (`Schedule.with_overlapped_sends`). A ValueError naming the choices otherwise. The
  one place a schedule's name is read."""
  kind, _, count = text.partition(":")
  if text in NAMED:
    schedule = NAMED[text]()
  elif kind in PER_DEVICE_CHUNKS and count.isdigit() and int(count) >= 1:
    schedule = PER_DEVICE_CHUNKS[kind](int(count))
  else:
    counted = " or ".join(f"{name}:V" for name in PER_DEVICE_CHUNKS)
    raise ValueError(f"schedule must be one of {list(SCHEDULES)} or {counted} (V >= 1 chunks per device), got "
                     f"{text!r}")
  return schedule.with_overlapped_sends() if overlap else schedule
