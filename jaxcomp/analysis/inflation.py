"""Step inflation's fitted model: how a method's steps to a target, over the dense run's, grow with the horizon
(the dense run's steps to the target) and the model's width.

    log inflation = a + b log(H / 100) + c log(W / 128)         (c only when two or more widths were measured)

is least squares over measured points; its uncertainty is the coefficients' covariance (residual variance x
(X^T X)^-1), carried to a projection by the delta method (`project`: the inflation at (H, W) with one standard
error either side). A projection outside the horizons and widths measured says so (`extrapolated`); a trend that
bends (the slopes of the lower and upper halves of the horizons differ by more than twice their combined standard
error) is flagged (`bends`): projecting it says nothing.
"""
import math

import numpy as np

H0, W0 = 100, 128  # the fit's reference horizon and width


def fit(points: list[tuple[float, float, float]]) -> dict | None:
  """Least squares of log inflation on log(H/100) [and log(W/128)] over (H, W, inflation) points; None with too
  few points to fit (fewer than the coefficients + 1)."""
  hs, ws, ys = (np.array(v, float) for v in zip(*points)) if points else ([], [], [])
  if len(points) == 0:
    return None
  columns = [np.ones(len(hs))]
  names = ["a"]
  if len(set(hs)) > 1:
    columns.append(np.log(hs / H0))
    names.append("b")
  if len(set(ws)) > 1:
    columns.append(np.log(ws / W0))
    names.append("c")
  x, y = np.stack(columns, 1), np.log(ys)
  if len(y) <= len(names):
    return None
  coef, *_ = np.linalg.lstsq(x, y, rcond=None)
  residual = y - x @ coef
  variance = float(residual @ residual) / (len(y) - len(names))
  cov = variance * np.linalg.inv(x.T @ x)
  return {"coef": dict(zip(names, coef.tolist())), "cov": cov.tolist(), "names": names, "points": len(y),
          "horizons": sorted(set(hs.tolist())), "widths": sorted(set(ws.tolist())),
          "residual_sd": math.sqrt(variance)}


def bends(points: list[tuple[float, float, float]]) -> bool:
  """Whether the horizon trend bends: with three or more horizons, the slopes of log inflation on log H over the
  lower and the upper horizons differ by more than twice their combined standard error."""
  horizons = sorted({h for h, _, _ in points})
  if len(horizons) < 3:
    return False
  mid = horizons[len(horizons) // 2]
  low = fit([p for p in points if p[0] <= mid])
  high = fit([p for p in points if p[0] >= mid])
  if not low or not high or "b" not in low["coef"] or "b" not in high["coef"]:
    return False
  se = math.sqrt(low["cov"][1][1] + high["cov"][1][1])
  return abs(low["coef"]["b"] - high["coef"]["b"]) > 2 * se


def project(model: dict, horizon: float, width: float) -> dict:
  """The fitted inflation at (`horizon`, `width`) with one standard error either side (`low`, `high`), and whether
  it lies outside what was measured (`extrapolated`)."""
  row = {"a": 1.0, "b": math.log(horizon / H0), "c": math.log(width / W0)}
  v = np.array([row[n] for n in model["names"]])
  mean = float(v @ np.array([model["coef"][n] for n in model["names"]]))
  se = math.sqrt(max(float(v @ np.array(model["cov"]) @ v), 0.0))
  measured_h, measured_w = model["horizons"], model["widths"]
  outside = not (measured_h[0] <= horizon <= measured_h[-1]) or not (measured_w[0] <= width <= measured_w[-1])
  return {"inflation": math.exp(mean), "low": math.exp(mean - se), "high": math.exp(mean + se),
          "extrapolated": outside}
