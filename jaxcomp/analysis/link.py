"""A network link: its bandwidth and the one-way latency each message pays, as `--link 100mbit:20ms` writes it.

A message of n bytes takes ``latency_s + 8 n / bandwidth_bps`` seconds from its first byte leaving to its last
arriving. The rate is written as `tc` writes it (``10mbit``, ``1gbit``; ``unshaped``: no limit), the latency as
``20ms``, ``50us`` or ``0.05s`` (none given: 0).
"""
import math
import re
from dataclasses import dataclass

RATE = re.compile(r"(?P<value>\d+(?:\.\d+)?)(?P<unit>bit|kbit|mbit|gbit)", re.IGNORECASE)
RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
LATENCY = re.compile(r"(?P<value>\d+(?:\.\d+)?)(?P<unit>us|ms|s)")
LATENCY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
UNSHAPED = "unshaped"


def parse_rate(rate: str) -> float:
  """'100mbit' -> 1e8 bits/s, 'unshaped' -> inf; a ValueError naming the bad value and the form otherwise."""
  if rate == UNSHAPED:
    return math.inf
  m = RATE.fullmatch(rate)
  if not m or not float(m["value"]) > 0:
    raise ValueError(f"link rate {rate!r}: give bits per second as tc writes them (e.g. 10mbit, 100mbit, 1gbit) "
                     f"or {UNSHAPED!r}")
  return float(m["value"]) * RATE_UNITS[m["unit"].lower()]


def parse_latency(latency: str) -> float:
  """'20ms' -> 0.02 s; a ValueError naming the bad value and the form otherwise."""
  m = LATENCY.fullmatch(latency)
  if not m:
    raise ValueError(f"link latency {latency!r}: give the one-way latency of a message with its unit (e.g. 20ms, "
                     f"500us, 0.05s)")
  return float(m["value"]) * LATENCY_UNITS[m["unit"]]


def format_rate(bandwidth_bps: float) -> str:
  """1e8 -> '100mbit' (tc's units; inf -> 'unshaped')."""
  if math.isinf(bandwidth_bps):
    return UNSHAPED
  for unit in ("gbit", "mbit", "kbit"):
    if bandwidth_bps >= RATE_UNITS[unit] and (bandwidth_bps / RATE_UNITS[unit]).is_integer():
      return f"{bandwidth_bps / RATE_UNITS[unit]:g}{unit}"
  return f"{bandwidth_bps:g}bit"


def format_latency(latency_s: float) -> str:
  """0.02 -> '20ms', 5e-4 -> '500us'."""
  if latency_s >= 1:
    return f"{latency_s:g}s"
  return f"{latency_s * 1e3:g}ms" if latency_s >= 1e-3 or latency_s == 0 else f"{latency_s * 1e6:g}us"


@dataclass(frozen=True)
class Link:
  """`bandwidth_bps` bits per second (inf: unshaped) and `latency_s`, the one-way latency of each message."""
  bandwidth_bps: float
  latency_s: float = 0.0

  def __post_init__(self):
    if not self.bandwidth_bps > 0:  # also rejects NaN; inf is an unshaped link
      raise ValueError(f"a link's bandwidth must be > 0 bits/s, got {self.bandwidth_bps!r}")
    if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
      raise ValueError(f"a link's latency must be a finite number of seconds >= 0, got {self.latency_s!r}")

  @classmethod
  def parse(cls, text: str) -> "Link":
    """'100mbit:20ms' -> Link(1e8, 0.02); '1gbit' -> Link(1e9, 0.0); a ValueError naming the bad part."""
    rate, _, latency = text.partition(":")
    return cls(parse_rate(rate), parse_latency(latency) if latency else 0.0)

  @property
  def rate(self) -> str:
    """The bandwidth as tc writes it ('100mbit', 'unshaped')."""
    return format_rate(self.bandwidth_bps)

  def __str__(self) -> str:
    return self.rate + (f":{format_latency(self.latency_s)}" if self.latency_s else "")

  def seconds(self, nbytes: float, messages: int = 1) -> float:
    """Seconds to move `nbytes` in `messages` messages one after another: ``messages * latency_s + 8 * nbytes /
    bandwidth_bps``."""
    return messages * self.latency_s + 8.0 * nbytes / self.bandwidth_bps
