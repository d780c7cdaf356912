"""Max-abs quantizers side by side: relative MSE and mean bias on ReLU and Gaussian activations.

`python -m benchmarks.quantizer_error` prints one table per input at 2, 3, 4 and 8 bits:
* the AQ-SGD authors' quantizer, written in numpy from its formula (../shared/SPEC.md):
  s = fp16(max|x| over all axes but the last), q = clip(round(x / (s + 1e-6) 2^(B-1)),
  -2^(B-1), 2^(B-1) - 1), x_hat = q / 2^(B-1) s;
* an ideal symmetric grid: float64 nearest rounding to {-L..L} s / L, L = 2^(B-1) - 1,
  with the same per-channel scales s = max|x|;
* jaxcomp's `maxabs:B` with its default grid and clip for B, then each grid (`grid=zero`:
  the grid above; `grid=midrise`: +-(2j-1) s/(2^B-1), all 2^B codes) with no clip, a fixed
  clip ratio and the per-channel MSE-optimal clip (`clip=mse`).
Relative MSE = mean (x_hat - x)^2 / mean x^2; bias = mean(x_hat - x) / mean|x|.
Inputs: ReLU(N(0,1)) [100,8,8,256] (NHWC: [100,256,8,8] NCHW with one scale per channel)
and N(0,1) [8,128,768] (one scale per feature).
"""
import argparse

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


def table(name: str, x: np.ndarray, clip_ratio: float, bits) -> str:
  """One row per quantizer, one column per bit width."""
  columns = {"authors (SPEC)": authors_quantizer, "ideal symmetric": ideal_symmetric}
  specs = ["maxabs:{b}"] + [f"maxabs:{{b}}:grid={grid}{clip}" for grid in codecs.MAXABS_GRIDS
                            for clip in (":clip=1", f":clip={clip_ratio}", ":clip=mse")]
  for codec_spec in specs:
    codec_fn = lambda x, b, s=codec_spec: np.asarray(jax.jit(spec.parse_codec(s.format(b=b)))(x))
    columns[f"`{codec_spec.replace('{b}', 'B')}`"] = codec_fn
  lines = [f"**{name}** {list(x.shape)}: relative MSE (bias)", "",
           "| quantizer | " + " | ".join(f"{b} bits" for b in bits) + " |", "|---|" + "---:|" * len(bits)]
  def cell(fn, b):
    try:
      m, bias = errors(x, fn(x, b))
    except ValueError:  # no such grid at this width (the zero grid below 2 bits)
      return "-"
    return f"{m:.4g} ({bias:+.2g})"
  for column, fn in columns.items():
    lines.append(f"| {column} | " + " | ".join(cell(fn, b) for b in bits) + " |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--relu-shape", default="100,8,8,256")
  parser.add_argument("--gauss-shape", default="8,128,768")
  parser.add_argument("--clip", type=float, default=0.9, help="the fixed clip ratio column")
  parser.add_argument("--bits", default="2,3,4,8")
  args = parser.parse_args(argv)
  bits = [int(b) for b in args.bits.split(",")]
  shape = lambda text: tuple(int(d) for d in text.split(","))
  relu = np.maximum(np.asarray(jax.random.normal(jax.random.key(0), shape(args.relu_shape))), 0)
  gauss = np.asarray(jax.random.normal(jax.random.key(1), shape(args.gauss_shape)))
  print(table("ReLU(N(0,1)), per-channel scales", relu, args.clip, bits))
  print()
  print(table("N(0,1), per-feature scales", gauss, args.clip, bits))


if __name__ == "__main__":
  main()
