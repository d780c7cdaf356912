"""Shared by the benchmarks: timing (warm-up, then the median of synchronised runs), flags, tables."""
import argparse
import os
import re
import time

import jax

from jaxcomp.analysis.step_cost import median_seconds


def use_fake_cpu_devices(count: int) -> None:
  """Sets XLA_FLAGS (unless already set) so that the CPU backend, when it starts, makes `count` fake devices:
  call it before anything touches a JAX backend (a script's `__main__`)."""
  os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={count}")


def xla_flags_with_devices(devices: int) -> str:
  """This process's XLA_FLAGS with `devices` fake CPU devices in place of any count they name: the flags of a
  subprocess (a real-link stage process, a test's worker) that should compile as this process does."""
  others = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")).split()
  return " ".join([f"--xla_force_host_platform_device_count={devices}", *others])


def interleaved_medians(runs: dict, rounds: int, repeats: int = 3) -> dict[str, float]:
  """Median seconds of each zero-argument run, timed in `rounds` interleaved rounds: machine drift hits all
  alike, and each round starts one run later, so none always runs first. A sample is `median_seconds` of
  `repeats` calls after one warm-up call."""
  samples = {name: [] for name in runs}
  names = list(runs)
  for r in range(rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
      samples[name].append(median_seconds(runs[name], repeats=repeats, warmup=1))
  return {name: sorted(v)[len(v) // 2] for name, v in samples.items()}


def pipelined_seconds(fn, *args, calls: int = 10, repeats: int = 5, warmup: int = 2) -> float:
  """Seconds per call of fn(*args) when `calls` run back to back, synchronised once at the end: an
  accelerator's time for work shorter than a synchronisation's round trip (a GPU copy of 25 MB takes
  ~15 us). The median over `repeats` such runs."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = [fn(*args) for _ in range(calls)]
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / calls)
    del out
  return sorted(times)[len(times) // 2]


def gpt2_parser(doc: str, microbatches: int, models=("tiny", "small"), seq: int | None = 128) -> argparse.ArgumentParser:
  """The flags every GPT-2 benchmark shares: model size, batch, sequence (`seq` None: the benchmark picks it),
  microbatches."""
  parser = argparse.ArgumentParser(description=doc.splitlines()[0])
  parser.add_argument("--model", choices=models, default="tiny")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=seq)
  parser.add_argument("--microbatches", type=int, default=microbatches)
  return parser


def gpt2_config(name: str):
  """GPT-2 of size `name` (tiny, small, medium, large, xl) without dropout (timings of deterministic steps)."""
  from jaxcomp.models import gpt2
  return getattr(gpt2.GPT2Config, name)(dropout=0.0)


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
