"""Bytes that the collectives of a compiled XLA program send, read from its HLO text.

A collective inside a `while` body (a scanned schedule) runs once per iteration: its bytes
are multiplied by the loop's `known_trip_count`, through nested loops and called
computations.
"""
import re

import numpy as np

_ARRAY = re.compile(r"(pred|[suf]\d+|bf16|f8e4m3fn|f8e5m2)\[([\d,]*)\]")
_BYTES = {"pred": 1, "bf16": 2, "f8e4m3fn": 1, "f8e5m2": 1}
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_CALLED = re.compile(r"\b(?:body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def array_bytes(text: str) -> int:
  """Bytes of every array type (`f32[2,3]`, ...) written in `text`."""
  total = 0
  for dtype, dims in _ARRAY.findall(text):
    size = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
    total += size * _BYTES.get(dtype, int(dtype[1:]) // 8 if dtype[0] in "suf" else 0)
  return total


def _group_size_and_count(line):
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
  if iota:
    return int(iota.group(2)), int(iota.group(1))
  groups = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line).group(1)
  members = re.findall(r"\{([\d,]*)\}", groups)
  return len(members[0].split(",")), len(members)


def computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
  """({computation name: instruction lines}, name of the entry computation)."""
  comps, entry, current = {}, None, None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header and not line.startswith(" "):
      current = header.group(1)
      comps[current] = []
      if line.startswith("ENTRY"):
        entry = current
    elif current is not None and line.startswith(" "):
      comps[current].append(line)
  return comps, entry


def executions(hlo_text: str) -> dict[str, int]:
  """How many times each computation runs per call of the program (while bodies x trip count)."""
  comps, entry = computations(hlo_text)
  counts: dict[str, int] = {}

  def visit(name, times):
    counts[name] = counts.get(name, 0) + times
    for line in comps.get(name, ()):
      trip = _TRIP.search(line)
      for callee in _CALLED.findall(line):
        is_body = f"body=%{callee}" in line or f"body={callee}" in line
        if is_body and " while(" in line and trip is None:
          raise ValueError(f"while loop without a known trip count in the compiled program: {line.strip()[:120]}")
        visit(callee, times * (int(trip.group(1)) if is_body and trip else 1))
      for group in _BRANCHES.findall(line):  # a conditional runs one branch: count each as once
        for callee in re.findall(r"%?([\w.\-]+)", group):
          visit(callee, times)

  visit(entry, 1)
  return counts


def collective_bytes(hlo_text: str) -> dict[str, int]:
  """Bytes the collectives of a compiled program send per call, summed over all devices.

  fwd/bwd: each collective-permute moves its operand once per source->target pair; a pair
  (a, a+1) is forward (activations), (a+1, a) backward (gradients). data: each all-gather
  over a group of n sends every member's operand (result / n) to the n-1 others.
  """
  totals = {"fwd": 0, "bwd": 0, "data": 0}
  comps, _ = computations(hlo_text)
  for name, times in executions(hlo_text).items():
    for line in comps.get(name, ()):
      if " all-gather(" in line or " all-gather-start(" in line:
        size, count = _group_size_and_count(line)
        result = line.split("=", 1)[1].split("all-gather", 1)[0]
        totals["data"] += times * (array_bytes(_ARRAY.search(result).group(0)) // size * (size - 1) * size * count)
        continue
      if "collective-permute(" not in line and "collective-permute-start(" not in line:
        continue
      result = line.split("=", 1)[1].split("collective-permute", 1)[0]
      if "collective-permute-start(" in line:  # start returns (operand, result, ...): count one
        result = _ARRAY.search(result).group(0)
      pairs = re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=", 1)[1])
      for src, dst in pairs:
        totals["fwd" if int(dst) > int(src) else "bwd"] += times * array_bytes(result)
  return totals
