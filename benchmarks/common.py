"""Shared by the benchmarks: timing (warm-up, then the median of synchronised runs), flags, tables."""
import argparse
import time

import jax


def median_seconds(fn, *args, repeats: int = 10, warmup: int = 2) -> float:
  """Median wall time of fn(*args) with every output ready (device work included)."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return sorted(times)[len(times) // 2]


def gpt2_parser(doc: str, microbatches: int) -> argparse.ArgumentParser:
  """The flags every GPT-2 benchmark shares: model size, batch, sequence, microbatches."""
  parser = argparse.ArgumentParser(description=doc.splitlines()[0])
  parser.add_argument("--model", choices=["tiny", "small"], default="tiny")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=128)
  parser.add_argument("--microbatches", type=int, default=microbatches)
  return parser


def gpt2_config(name: str):
  """GPT-2 tiny or small without dropout (timings of deterministic steps)."""
  from jaxcomp.models import gpt2
  return (gpt2.GPT2Config.tiny if name == "tiny" else gpt2.GPT2Config.small)(dropout=0.0)


def ratio_table(label: str, times: dict[str, float], base: str) -> str:
  """Markdown rows: milliseconds and the ratio to `base`."""
  lines = [f"| {label} | ms | / {base} |", "|---|---:|---:|"]
  lines += [f"| {name} | {t * 1e3:.2f} | {t / times[base]:.3f} |" for name, t in times.items()]
  return "\n".join(lines)


def select(table: dict, names: str, baseline: str) -> dict:
  """The entries of `table` named in comma-separated `names`, baseline first; SystemExit naming a bad one."""
  wanted = [n.strip() for n in names.split(",") if n.strip()]
  unknown = [n for n in wanted if n not in table]
  if unknown:
    raise SystemExit(f"error: unknown {unknown}; choose from {list(table)}")
  return {n: table[n] for n in dict.fromkeys([baseline, *wanted])}
