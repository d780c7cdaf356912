"""The steps half of T: each method's step inflation (its steps to a target over the dense run's), from measured
points, projected to a user's horizon and width.

A table is a ladder's report (`python -m experiments.ladder`, its ladder.json: per rung of width W and horizon H,
per method, every seed's inflation) with its provenance (command, commit, machine, date) and the regime it was
measured in (`scratch`: trained from scratch; `finetune`: fine-tuning a pretrained model). The shipped table,
`jaxcomp/data/step_inflation.json`, is the one the planner uses unless given another (`load(path)`).

`inflation(table, method, horizon, width)`: the fitted model's projection (`analysis.inflation`) with one
standard error either side, or, where a method has too few points to fit, the span of its measured points; each
says where it comes from and whether it leaves what was measured.

Calibration. A table may carry a method measured at scale too (`calibration`: Protocol NanoGPT's ReparamSSN
record against its dense record, inflation at dense steps D, from their loss logs). Where a projection leaves the
horizons measured, its range widens by how far the table understates that method at scale, on the log scale: k(D)
= log(the record's inflation at D) / log(the table's own projection of the same method at D) (the record linear in
log D between its points, its nearest end outside them; k >= 1: a proxy that overstated it leaves ranges as they
are), and `high` becomes high^k: a method with no inflation keeps none, one with a little gains in proportion. The
one method measured both ways sets every method's transfer uncertainty; said in the source.
"""
import json
import math
import pathlib
from typing import NamedTuple

import numpy as np

from jaxcomp.analysis import inflation as model

SHIPPED = pathlib.Path(__file__).parent.parent / "data" / "step_inflation.json"
REGIMES = ("scratch", "finetune")


class Inflation(NamedTuple):
  """A method's step inflation at the user's horizon and width: `value` and its range [`low`, `high`], `source`
  (how it was obtained), `extrapolated` (outside the horizons or widths measured)."""
  value: float
  low: float
  high: float
  source: str
  extrapolated: bool


def load(path=None, regime: str = "scratch") -> dict:
  """The table at `path` (a ladder.json, or a folder holding one; None: the shipped table) for `regime`;
  ValueError naming what is missing."""
  if regime not in REGIMES:
    raise ValueError(f"--regime {regime!r}: choose one of {', '.join(REGIMES)}")
  file = SHIPPED if path is None else pathlib.Path(path)
  if file.is_dir():
    file = file / "ladder.json"
  if not file.is_file():
    raise ValueError(f"--steps-from {path}: no ladder.json there (python -m experiments.ladder writes one in its "
                     "--out folder)")
  data = json.loads(file.read_text())
  tables = data.get("regimes", {"scratch": data})  # a ladder's own report is one regime's table
  if regime not in tables or not tables[regime].get("rungs"):
    raise ValueError(f"--regime {regime}: {file} holds no {regime} measurements (it has: "
                     f"{', '.join(k for k, t in tables.items() if t.get('rungs')) or 'none'}); measure them with "
                     "python -m experiments.ladder (scratch) or experiments.finetune (finetune) and pass --steps-from")
  provenance = tables[regime].get("provenance") or data.get("provenance", {"file": str(file)})  # a regime's own first
  return {**tables[regime], "provenance": provenance, "regime": regime}


def points(table: dict, method: str) -> list[tuple[float, float, float]]:
  """(horizon, width, inflation) of every seed of `method` that reached its target."""
  return [(r["horizon"], r["width"], p["inflation"]) for r in table["rungs"].values()
          for p in r["methods"].get(method, []) if not p["censored"]]


def censored(table: dict, method: str) -> list[tuple[float, float, float]]:
  """(horizon, width, bound) of every seed of `method` that did not reach its target within the cap: its
  inflation is above the bound."""
  return [(r["horizon"], r["width"], p["inflation"]) for r in table["rungs"].values()
          for p in r["methods"].get(method, []) if p["censored"]]


def recorded(curve: dict, steps: float) -> float:
  """A recorded inflation curve {dense steps D: inflation} at `steps`: linear in log D between its points, the
  nearest end's value outside them."""
  ds = sorted(float(d) for d in curve)
  values = [curve[k] for k in sorted(curve, key=float)]
  return float(np.interp(math.log(steps), [math.log(d) for d in ds], values))


def transfer_factor(table: dict, horizon: float, width: float) -> tuple[float, str] | None:
  """(k, what it is) at `horizon`: log of the calibration method's recorded inflation over log of the table's
  projection of it (>= 1); None without a calibration, or a projection of its method above 1."""
  cal = table.get("calibration")
  if not cal:
    return None
  own = inflation({**table, "calibration": None}, cal["method"], horizon, width)
  if own is None or not math.isfinite(own.value) or own.value <= 1.0:
    return None
  at_scale = recorded(cal["record"], horizon)
  k = max(math.log(at_scale) / math.log(own.value), 1.0)
  return k, (f"high end raised to the power {k:.2f}: {cal['name']} {at_scale:.2f} at D {int(horizon)} against this "
             f"table's {own.value:.2f} (log ratio)")


def inflation(table: dict, method: str, horizon: float, width: float, dense: str = "fp32",
              stages: int | None = None) -> Inflation | None:
  """`method`'s inflation at (`horizon`, `width`) (`dense`: exactly 1); None when the table has no point of it. A
  method that missed its target within the cap at the longest horizon measured has only a lower bound there and
  beyond (`low` = that bound, `high` = inf: no T can be given, only a bound), and no upper bound between it and the
  longest horizon it reached; at horizons it reached, its points give it. A projection beyond the horizons
  measured has its `high` widened by the table's calibration (`transfer_factor`). On other `stages` than the
  table's (its `stages`; None: not checked) it is extrapolated too: each compressed boundary costs steps."""
  found = _inflation(table, method, horizon, width, dense)
  if found is not None and method != dense and stages is not None and table.get("stages", stages) != stages:
    measured = table["stages"]
    found = found._replace(extrapolated=True, source=f"{found.source}; measured on {measured} stages "
                           f"({measured - 1} compressed boundaries), here {stages}")
  if found is None or not found.extrapolated or not math.isfinite(found.high) or method == dense:
    return found
  measured = [h for h, _, _ in points(table, method)]
  factor = transfer_factor(table, horizon, width) if measured and horizon > max(measured) else None
  if factor is None:
    return found
  return found._replace(high=found.high ** factor[0], source=f"{found.source}; {factor[1]}")


def _inflation(table: dict, method: str, horizon: float, width: float, dense: str) -> Inflation | None:
  if method == dense:
    return Inflation(1.0, 1.0, 1.0, "the dense run (by definition)", False)
  pts, missed = points(table, method), censored(table, method)
  reached = max((h for h, _, _ in pts), default=0.0)
  beyond = [m for m in missed if m[0] >= reached]  # missed where no seed reached its target at a longer horizon
  if beyond and horizon > reached:
    h, _, bound = max(beyond)
    seeds = sum(m[0] == h for m in beyond)
    missed_at = f"did not reach the target within the cap at H {int(h)} ({seeds} seed(s))"
    if not pts or horizon >= h:
      return Inflation(bound, bound, math.inf, f"{missed_at}: above {bound:.2f} there", True)
    values = [v for _, _, v in pts]  # between the last horizon reached and the one missed: no upper bound
    return Inflation(float(np.mean(values)), min(values), math.inf,
                     f"measured to H {int(reached)}, {missed_at}: no upper bound between", True)
  if not pts:
    return None
  fitted = model.fit(pts)
  measured = f"{len(pts)} points at H {sorted({int(h) for h, _, _ in pts})}, W {sorted({int(w) for _, w, _ in pts})}"
  if fitted is None or "b" not in fitted["coef"] or model.bends(pts):
    values = [v for _, _, v in pts]
    why = "trend bends" if fitted is not None and model.bends(pts) else "too few horizons to fit"
    hs, ws = [h for h, _, _ in pts], [w for _, w, _ in pts]
    outside = not (min(hs) <= horizon <= max(hs)) or not (min(ws) <= width <= max(ws))
    return Inflation(float(np.mean(values)), min(values), max(values), f"measured ({why}): {measured}", outside)
  p = model.project(fitted, horizon, width)
  width_note = "" if "c" in fitted["coef"] else f"; width not varied (measured at {int(pts[0][1])})"
  return Inflation(p["inflation"], p["low"], p["high"], f"fitted to {measured}{width_note}",
                   p["extrapolated"] or ("c" not in fitted["coef"] and width != pts[0][1]))


def provenance(table: dict) -> str:
  """One line: where the table's measurements come from."""
  p = table["provenance"]
  return ", ".join(f"{k} {v}" for k, v in p.items()) + f"; regime {table['regime']}"
