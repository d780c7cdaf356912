"""Shared by the benchmarks: timing (warm-up, then the median of synchronised runs; a codec's encode and decode), the
methods they run, flags, tables."""
import argparse
import os
import re
import time

import jax

from experiments import gpt2_wikitext
from jaxcomp import methods as registry
from jaxcomp.analysis.step_cost import median_seconds
from jaxcomp.compress import codecs, spec


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


REUSE = "reuse"
REUSE_OF = "topk:0.1"  # the forward codec whose positions `reuse` sends the gradient at


def copy_seconds(x, repeats: int) -> float:
  """Seconds of x + 1 (one read and one write of x)."""
  return pipelined_seconds(jax.jit(lambda x: x + 1), x, repeats=repeats)


def codec_seconds(text: str, x, repeats: int) -> tuple[float, float, int]:
  """(encode seconds, decode seconds, payload bytes) of the codec `text` (or `reuse`) on x."""
  key = jax.random.key(1)
  if text == REUSE:
    topk = spec.parse_codec(REUSE_OF)
    idx = jax.jit(lambda x: topk.where(topk.encode(x, key)))(x)
    encode, decode = jax.jit(topk.values_at), jax.jit(topk.scatter)
    args = (x, idx)
    payload = encode(*args)
    return (pipelined_seconds(encode, *args, repeats=repeats), pipelined_seconds(decode, payload, idx, repeats=repeats),
            codecs.nbytes(payload))
  codec = spec.parse_codec(text)
  encode = jax.jit(lambda x, k: codec.encode(x, k))
  decode = jax.jit(codec.decode)
  payload = encode(x, key)
  return (pipelined_seconds(encode, x, key, repeats=repeats), pipelined_seconds(decode, payload, repeats=repeats),
          codecs.nbytes(payload))


def method_specs() -> dict[str, tuple[str, str]]:
  """(forward, backward) spec of every named method: the GPT-2 presets and the frontier's (but its learned
  bottlenecks, which change the model, not only what the boundary sends)."""
  presets = {name: (p["fwd"], p["bwd"]) for name, p in gpt2_wikitext.PRESETS.items() if "fwd" in p}
  return {**presets, **{m.name: (m.fwd, m.bwd) for m in registry.METHODS.values() if not m.changes_model}}
