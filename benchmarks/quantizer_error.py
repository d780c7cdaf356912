"""Max-abs quantizers side by side: relative MSE and mean bias, on synthetic and recorded activations.

`python -m benchmarks.quantizer_error` prints one table per input at 2, 3, 4 and 8 bits:
* the AQ-SGD authors' quantizer, written in numpy from its formula (../shared/SPEC.md):
  s = fp16(max|x| over all axes but the last), q = clip(round(x / (s + 1e-6) 2^(B-1)),
  -2^(B-1), 2^(B-1) - 1), x_hat = q / 2^(B-1) s;
* an ideal symmetric grid: float64 nearest rounding to {-L..L} s / L, L = 2^(B-1) - 1,
  with the same per-channel scales s = max|x|;
* jaxcomp's `maxabs:B` with its default grid and clip for B, then each grid (`grid=zero`:
  the grid above; `grid=midrise`: +-(2j-1) s/(2^B-1), all 2^B codes; `grid=auto`: per scale the one
  of the two that errs least) with no clip, a fixed clip ratio and the per-scale MSE-optimal clip
  (`clip=mse`).
The Gaussian, the tensors with outliers and the recorded ones add the same with `--group` features
per scale (`maxabs:B:group=G`, by default per message the per-channel code or each channel's RMS times
one scale per group, `scales=group` the groups alone, `scales=both` the latter always), the Hadamard rotation before it (and its
round trip alone, `hadamard+none`), both defaults with stochastic rounding (one draw), two lower
bounds of any code with one scale per group (the least error of a symmetric uniform grid of any
scale, either grid, per group; and of 2^B free levels per group, exact 1-D k-means), and ratios:
grouped over per-channel error (defaults of both, and each bound over the per-channel default), and
each default over the better of the zero and midrise grids (at the default clip); and the defaults'
error averaged over channels (each channel's relative MSE, so a small channel counts as much as an
outlier channel, as it does to a next layer that rescales its channels).
Relative MSE = mean (x_hat - x)^2 / mean x^2; bias = mean(x_hat - x) / mean|x|.
Inputs: ReLU(N(0,1)) [100,8,8,256] (NHWC: [100,256,8,8] NCHW with one scale per channel),
N(0,1) [8,128,768] (one scale per feature), the same with 4 random features times 50 ("outliers",
pretrained GPT-2's pattern: a few channels tens of times the rest), and those plus 1000 at the first
token of each sequence in two of them ("massive activations", Sun et al. 2024), and every array of
`--recorded FILE.npz` (boundary activations `fwd_b` and gradients `bwd_b` that
`python -m experiments.boundary_error --save FILE.npz` records from a training run).
"""
import argparse
import functools
import pathlib

import jax
import numpy as np

from jaxcomp.compress import codecs, spec


def authors_quantizer(x: np.ndarray, bits: int) -> np.ndarray:
  """The AQ-SGD authors' max-abs quantizer (SPEC.md formula): fp16 scales, codes -2^(B-1)..2^(B-1)-1."""
  s = np.abs(x).reshape(-1, x.shape[-1]).max(0).astype(np.float16).astype(np.float32)
  half = 2 ** (bits - 1)
  q = np.clip(np.round(x / (s + 1e-6) * half), -half, half - 1)
  return (q / half * s).astype(np.float32)


def ideal_symmetric(x: np.ndarray, bits: int) -> np.ndarray:
  """float64 nearest rounding to the symmetric grid {-L..L} s / L with per-channel s = max|x|."""
  if bits < 2:
    raise ValueError(f"the symmetric grid with 0 needs bits >= 2, got {bits}")
  x64 = x.astype(np.float64)
  s = np.abs(x64).reshape(-1, x.shape[-1]).max(0)
  levels = 2 ** (bits - 1) - 1
  return np.round(x64 / np.where(s > 0, s, 1) * levels) * s / levels


def errors(x: np.ndarray, x_hat: np.ndarray) -> tuple[float, float]:
  """(relative MSE, mean bias / mean|x|), in float64."""
  d = np.asarray(x_hat, np.float64) - x.astype(np.float64)
  return float(np.mean(d ** 2) / np.mean(x.astype(np.float64) ** 2)), float(d.mean() / np.abs(x).mean())


def groups_of(x: np.ndarray, group: int) -> np.ndarray:
  """[N / group, group] float64: `group` consecutive features of each token per row."""
  return x.astype(np.float64).reshape(-1, x.shape[-1]).reshape(-1, group)


def best_uniform_error(x: np.ndarray, bits: int, group: int, ratios=np.linspace(0.02, 1.0, 197)) -> float:
  """Relative MSE of the best symmetric uniform grid per group: scale r max|x| for the best r of
  `ratios`, the zero or the midrise grid, nearest rounding (a lower bound of `maxabs:B:group=G` under
  every grid and clip rule, to the ratios' resolution)."""
  rows = groups_of(x, group)
  top = np.abs(rows).max(1, keepdims=True)
  top = np.where(top > 0, top, 1.0)
  levels, codes = 2 ** (bits - 1) - 1, 2 ** bits - 1
  best = np.full(rows.shape[0], np.inf)
  for r in ratios:
    s = r * top
    zero = np.clip(np.round(rows / s * levels), -levels, levels) * s / levels
    cell = np.clip(np.floor(rows / s * codes / 2), -(codes + 1) / 2, (codes - 1) / 2)
    for x_hat in (zero, (2 * cell + 1) * s / codes):
      best = np.minimum(best, ((x_hat - rows) ** 2).sum(1))
  return float(best.sum() / (rows ** 2).sum())


def free_levels_error(x: np.ndarray, bits: int, group: int, chunk: int = 512) -> float:
  """Relative MSE of the best 2^B levels chosen freely per group (exact 1-D k-means by dynamic
  programming over the sorted values): a lower bound of any B-bit code with one codebook per group,
  whatever side information it sends."""
  rows = np.sort(groups_of(x, group), 1)
  k, n = 2 ** bits, rows.shape[1]
  if k >= n:
    return 0.0
  first, last = np.arange(n)[:, None], np.arange(n)[None, :]
  total = 0.0
  for part in np.split(rows, range(chunk, len(rows), chunk)):
    sums = np.concatenate([np.zeros((len(part), 1)), np.cumsum(part, 1)], 1)
    squares = np.concatenate([np.zeros((len(part), 1)), np.cumsum(part ** 2, 1)], 1)
    s, q = sums[:, last + 1] - sums[:, first], squares[:, last + 1] - squares[:, first]
    cost = np.where(last >= first, q - s * s / np.maximum(last - first + 1, 1), np.inf)  # SSE of part[i..j]
    best = cost[:, 0, :]  # one level for values 0..j
    for _ in range(k - 1):  # best[j] with one more level: the last level covers i..j
      before = np.concatenate([np.full((len(part), 1), np.inf), best[:, :-1]], 1)
      best = np.minimum(best, np.min(before[:, :, None] + cost, 1))
    total += best[:, -1].sum()
  return float(total / (rows ** 2).sum())


def channel_error(x: np.ndarray, x_hat: np.ndarray) -> float:
  """Mean over channels (the last axis) of each channel's relative MSE: every channel weighs the same,
  however large, as for a next layer that rescales its channels (a model's outlier channels)."""
  x64 = x.astype(np.float64).reshape(-1, x.shape[-1])
  d = np.asarray(x_hat, np.float64).reshape(x64.shape) - x64
  energy = (x64 ** 2).sum(0)
  return float(np.mean((d ** 2).sum(0)[energy > 0] / energy[energy > 0]))


def decoded(codec_spec: str, x: np.ndarray, bits: int) -> np.ndarray:
  """x through `codec_spec` with {b} set to `bits`; ValueError where no such codec exists."""
  codec = spec.parse_codec(codec_spec.format(b=bits))
  return np.asarray(jax.jit(codec)(x, jax.random.key(0)))  # the key: stochastic rounding's


def codec_error(codec_spec: str, x: np.ndarray, bits: int) -> tuple[float, float]:
  """(relative MSE, bias) of `codec_spec` with {b} set to `bits`; ValueError where no such codec exists."""
  return errors(x, decoded(codec_spec, x, bits))


GRIDS = (*codecs.MAXABS_GRIDS, codecs.AUTO_GRID)


def table(name: str, x: np.ndarray, clip_ratio: float, bits, group: int | None = None) -> str:
  """One row per quantizer, one column per bit width; with `group`, the grouped rows and ratios too."""
  rows = {"authors (SPEC)": lambda b: errors(x, authors_quantizer(x, b)),
          "ideal symmetric": lambda b: errors(x, ideal_symmetric(x, b))}
  specs = ["maxabs:{b}"] + [f"maxabs:{{b}}:grid={grid}{clip}" for grid in GRIDS
                            for clip in (":clip=1", f":clip={clip_ratio}", ":clip=mse")]
  if group is not None:
    specs += [f"maxabs:{{b}}:group={group}"] + [f"maxabs:{{b}}:group={group}:grid={grid}{clip}" for grid in GRIDS
                                                for clip in ("", ":clip=1", ":clip=mse")]
    specs += [f"maxabs:{{b}}:group={group}:scales={scales}" for scales in ("group", "both")]
    specs += [f"hadamard+maxabs:{{b}}:group={group}", "hadamard+none", "maxabs:{b}:stoch",
              f"maxabs:{{b}}:group={group}:stoch"]
  for codec_spec in specs:
    rows[f"`{codec_spec.replace('{b}', 'B')}`"] = lambda b, s=codec_spec: codec_error(s, x, b)
  lines = [f"**{name}** {list(x.shape)}: relative MSE (bias)", "",
           "| quantizer | " + " | ".join(f"{b} bits" for b in bits) + " |", "|---|" + "---:|" * len(bits)]

  def cell(fn, b):
    try:
      m, bias = fn(b)
    except ValueError:  # no such grid at this width (the zero grid below 2 bits)
      return "-"
    return f"{m:.4g} ({bias:+.2g})"
  for row, fn in rows.items():
    lines.append(f"| {row} | " + " | ".join(cell(fn, b) for b in bits) + " |")
  if group is not None:
    mse = functools.lru_cache(maxsize=None)(lambda codec_spec, b: codec_error(codec_spec, x, b)[0])
    grouped, channel = f"maxabs:{{b}}:group={group}", "maxabs:{b}"
    better = lambda default, b: mse(default, b) / min(mse(f"{default}:grid={g}", b) for g in codecs.MAXABS_GRIDS)
    ratios = {f"grouped / per channel (`maxabs:B:group={group}` / `maxabs:B`)":
              lambda b: mse(grouped, b) / mse(channel, b),
              "per channel: `maxabs:B` / better of `grid=zero`, `grid=midrise`": lambda b: better(channel, b),
              "grouped: default / better of the two grids": lambda b: better(grouped, b),
              f"per {group} features, best uniform grid (any clip, either grid) / `maxabs:B`":
              lambda b: best_uniform_error(x, b, group) / mse(channel, b),
              f"per {group} features, 2^B free levels (exact k-means) / `maxabs:B`":
              lambda b: free_levels_error(x, b, group) / mse(channel, b),
              f"groups alone / per channel (`maxabs:B:group={group}:scales=group` / `maxabs:B`)":
              lambda b: mse(f"{grouped}:scales=group", b) / mse(channel, b),
              f"channel-scaled groups / per channel (`maxabs:B:group={group}:scales=both` / `maxabs:B`)":
              lambda b: mse(f"{grouped}:scales=both", b) / mse(channel, b)}
    for codec_spec in (channel, grouped, f"{grouped}:scales=group", f"{grouped}:scales=both", f"{channel}:stoch",
                       f"{grouped}:stoch", f"{grouped}:scales=group:stoch", f"{grouped}:scales=both:stoch",
                       f"hadamard+{grouped}", f"hadamard+{grouped}:stoch", f"channel+hadamard+{grouped}",
                       f"channel+hadamard+{grouped}:stoch"):
      ratios[f"`{codec_spec.replace('{b}', 'B')}`, mean of each channel's relative MSE"] = (
          lambda b, s=codec_spec: channel_error(x, decoded(s, x, b)))
    for row, fn in ratios.items():
      lines.append(f"| {row} | " + " | ".join(_ratio_cell(fn, b) for b in bits) + " |")
  return "\n".join(lines)


def _ratio_cell(fn, b) -> str:
  try:
    return f"{fn(b):.3g}"
  except ValueError:
    return "-"


def outlier_tensors(shape) -> dict[str, np.ndarray]:
  """N(0,1) of `shape` (key 1) with 4 random features (key 2) times 50; and that with 1000 at token 0 of
  every sequence in two of those features."""
  x = np.array(jax.random.normal(jax.random.key(1), shape))
  channels = np.asarray(jax.random.choice(jax.random.key(2), shape[-1], (4,), replace=False))
  x[..., channels] *= 50
  massive = x.copy()
  massive[:, 0, channels[:2]] = 1000.0
  return {"outliers": x, "massive": massive}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--relu-shape", default="100,8,8,256")
  parser.add_argument("--gauss-shape", default="8,128,768")
  parser.add_argument("--clip", type=float, default=0.9, help="the fixed clip ratio column")
  parser.add_argument("--bits", default="2,3,4,8")
  parser.add_argument("--group", type=int, default=64, help="features per scale of the grouped rows")
  parser.add_argument("--recorded", type=pathlib.Path, nargs="*", default=[],
                      help=".npz files of activations (experiments.boundary_error --save)")
  parser.add_argument("--only-recorded", action="store_true", help="skip the synthetic tensors")
  args = parser.parse_args(argv)
  bits = [int(b) for b in args.bits.split(",")]
  shape = lambda text: tuple(int(d) for d in text.split(","))
  tables = []
  if not args.only_recorded:
    relu = np.maximum(np.asarray(jax.random.normal(jax.random.key(0), shape(args.relu_shape))), 0)
    gauss = np.asarray(jax.random.normal(jax.random.key(1), shape(args.gauss_shape)))
    tables.append(table("ReLU(N(0,1)), per-channel scales", relu, args.clip, bits))
    tables.append(table("N(0,1), per-feature scales", gauss, args.clip, bits, args.group))
    for name, x in outlier_tensors(shape(args.gauss_shape)).items():
      described = {"outliers": "N(0,1), 4 features x 50",
                   "massive": "N(0,1), 4 features x 50, 1000 at token 0 in two of them"}[name]
      tables.append(table(described, x, args.clip, bits, args.group))
  for path in args.recorded:
    with np.load(path) as recorded:
      for key in sorted(recorded):
        tables.append(table(f"{path.name}: {key}", recorded[key], args.clip, bits, args.group))
  print("\n\n".join(tables))


if __name__ == "__main__":
  main()
