"""Compile a run's train and eval steps for a target accelerator and report what its compiler says; run nothing.

    report = dryrun.compile_for(targets.target("v5e-1"), pipe, optimizer, batch_shapes)
    print(report.text()); report.fits

The train state and the batch are abstract (`jax.eval_shape`: no parameter is allocated, no data
read) and placed on the target's compile-only devices (`targets.compile_only_devices`). Per
device, for each step:
  memory   XLA's memory analysis of the compiled program: arguments + outputs - donated
           (aliased) + temporaries = the step's peak, against the chip's HBM;
  FLOPs    matrix FLOPs of the step's jaxpr (`flops.count`: per device, loop bodies x trips,
           a switch's costliest branch, so every pipeline tick counts as its busiest stage);
  traffic  HBM bytes read and written by the compiled program (`hlo_bytes.memory_bytes`);
  time     an estimate, not a measurement: max(FLOPs / the chip's published peak for the
           operand type, traffic / its HBM bandwidth);
and the bytes the target's compiled collectives send (`hlo_bytes.collective_bytes`) next to
what the boundaries count (`Executor.wire_bytes_per_step`).
"""
import dataclasses
import re
import time
from typing import Any

import jax
import optax
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import pipeline
from jaxcomp.compress import schemes
from jaxcomp.compress.boundary import LinkState, Mode
from jaxcomp.parallel import flops, hlo_bytes, hostbuffer, sharded, simulate
from jaxcomp.runtime import targets

EXECUTORS = ("simulate", "gpipe")


@dataclasses.dataclass(frozen=True)
class Plan:
  """How the run is laid out on the target's devices (the experiment CLIs' flags of the same names)."""
  executor: str = "simulate"  # one device, or stages across devices (`sharded.ShardedExecutor`)
  data: int = 1  # data-parallel replicas (gpipe)
  schedule: str = "gpipe"  # gpipe | 1f1b | 1f1b-fused (gpipe executor)
  grad_scheme: Any = None  # data-parallel gradient compression (gpipe)
  aqsgd_buffers: str = "device"  # "device" | "host": AQ-SGD tables in host memory (simulate)

  def __post_init__(self):
    if self.executor not in EXECUTORS:
      raise ValueError(f"executor must be one of {EXECUTORS}, got {self.executor!r}")
    if self.aqsgd_buffers not in ("device", "host"):
      raise ValueError(f"aqsgd_buffers must be 'device' or 'host' for a compile, got {self.aqsgd_buffers!r}")


@dataclasses.dataclass(frozen=True)
class Step:
  """What the target's compiler says of one step, per device."""
  name: str
  compile_s: float
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  flops: flops.Flops
  traffic_bytes: int
  collectives: dict  # bytes the compiled collectives send per step, all devices: fwd, bwd, data

  @property
  def peak_bytes(self) -> int:
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

  def compute_s(self, chip: targets.Chip) -> float:
    peak = lambda dtype: chip.peak_flops.get(dtype, chip.peak_flops["bfloat16" if "16" in dtype else "float32"])
    return sum(f / peak(dtype) for dtype, f in self.flops.by_dtype.items())

  def memory_s(self, chip: targets.Chip) -> float:
    return self.traffic_bytes / chip.hbm_bytes_per_s

  def estimated_s(self, chip: targets.Chip) -> float:
    return max(self.compute_s(chip), self.memory_s(chip))


@dataclasses.dataclass(frozen=True)
class DryRun:
  target: targets.Target
  plan: Plan
  layout: str  # "simulate on 1 of 8 chips", "gpipe: 4 stages x 2 data, 1f1b"
  steps: tuple  # Step per compiled step (train, eval); empty when the compiler ran out of memory
  counted: dict  # wire_bytes_per_step: fwd, bwd (and data) the boundaries count
  aqsgd_table_bytes: int  # per device, in the train state (0: none or in host memory)
  error: str = ""  # the compiler's RESOURCE_EXHAUSTED message, when it refused

  @property
  def peak_bytes(self) -> int:
    if self.error:  # what the compiler says it needed: "57.30G" (libtpu 0.0.42), or one allocation's bytes,
      # "Allocation (size=65536000000) would exceed memory" (libtpu 0.0.23, jax 0.7)
      needed = re.findall(r"([\d.]+)([GM])\b", self.error)
      allocation = re.search(r"Allocation \(size=(\d+)\)", self.error)
      if needed:
        return int(float(needed[0][0]) * (2**30 if needed[0][1] == "G" else 2**20))
      return int(allocation.group(1)) if allocation else 0
    return max(s.peak_bytes for s in self.steps)

  @property
  def fits(self) -> bool:
    return not self.error and self.peak_bytes <= self.target.chip.hbm_bytes

  def suggestions(self) -> list[str]:
    """Flags that would lower the peak, for a run that does not fit."""
    out = []
    hbm, plan = self.target.chip.hbm_bytes, self.plan
    if self.aqsgd_table_bytes > hbm / 4:
      out.append(f"--aqsgd-buffers host (the AQ-SGD tables take {self.aqsgd_table_bytes / 2**30:.1f} GiB per device;"
                 " host buffers need --executor simulate)")
    if plan.executor == "simulate" and self.target.devices > 1:
      out.append(f"--executor gpipe (each of the {self.target.devices} chips holds its stage only)")
    if plan.executor == "gpipe":
      if plan.schedule == "gpipe":
        out.append("--schedule 1f1b (a stage stashes at most S-s microbatch inputs, not M)")
      out.append("more --stages (fewer blocks per chip), or more --microbatches (smaller activations per tick)")
    out.append("a smaller --batch-size")
    return out

  def text(self) -> str:
    chip, lines = self.target.chip, [f"compile for {self.target.describe()}", f"layout: {self.layout}"]
    if self.steps:
      lines += ["| step | compile s | arguments GiB | outputs GiB | donated GiB | temporaries GiB | peak GiB / HBM "
                "| matrix TFLOP | HBM traffic GB | est. ms (compute / memory) |", "|---|---:|" + "---:|" * 8]
      gib = lambda b: f"{b / 2**30:.2f}"
      for s in self.steps:
        lines.append(f"| {s.name} | {s.compile_s:.1f} | {gib(s.argument_bytes)} | {gib(s.output_bytes)} "
                     f"| {gib(s.alias_bytes)} | {gib(s.temp_bytes)} | {gib(s.peak_bytes)} / {gib(chip.hbm_bytes)} "
                     f"| {s.flops.matmul / 1e12:.3f}{'' if s.flops.exact else '+'} | {s.traffic_bytes / 1e9:.2f} "
                     f"| {1e3 * s.estimated_s(chip):.1f} ({1e3 * s.compute_s(chip):.1f} / {1e3 * s.memory_s(chip):.1f}) |")
    if self.fits:
      lines.append(f"fits: peak {self.peak_bytes / 2**30:.2f} GiB of {chip.hbm_bytes / 2**30:g} GiB HBM per device")
    else:
      missing = max(self.peak_bytes - chip.hbm_bytes, 0)
      why = f" (the compiler: {self.error})" if self.error else ""
      lines.append(f"does not fit: needs {self.peak_bytes / 2**30:.2f} GiB of {chip.hbm_bytes / 2**30:g} GiB HBM per "
                   f"device, {missing / 2**30:.2f} GiB missing{why}; try: " + "; ".join(self.suggestions()))
    if self.steps:
      train = self.steps[0]
      lines.append(f"estimated train step: {1e3 * train.estimated_s(chip):.1f} ms per device "
                   f"({'compute' if train.compute_s(chip) >= train.memory_s(chip) else 'memory'}-bound) - an "
                   f"estimate from {chip.name}'s published peaks ({chip.source}), not a measurement")
      lines.append("wire bytes per train step: " + self.wire_text())
    return "\n".join(lines)

  def wire_text(self) -> str:
    counted = ", ".join(f"{k} {v:,}" for k, v in self.counted.items())
    if self.plan.executor == "simulate":
      return f"counted {counted} (simulate: one device, no link in the program)"
    sent = self.steps[0].collectives
    ways = ("fwd", "bwd") + (("data",) if self.plan.grad_scheme is not None and self.plan.data > 1 else ())
    same = all(sent[k] == self.counted.get(k) for k in ways)
    return (f"counted {counted}; the target's compiled collectives send " + ", ".join(f"{k} {sent[k]:,}" for k in ways)
            + (" (equal)" if same else " (DIFFERENT)"))


def _abstract(tree, sharding):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def compile_step(name, jitted, *args, platform: str, num_stages: int | None = None):
  """(what the compiler says of `jitted(*args)` as a `Step`, the compiled program). The arguments may be
  abstract, on compile-only devices, or real arrays: the program then runs (`benchmarks.device_check` sets the
  dry run's figures beside a run of the very program they describe). `platform`: what `flops.count` counts
  for ("tpu", "cuda", "cpu"); `num_stages`: for the collectives' fwd/bwd split (None: no collectives)."""
  start = time.perf_counter()
  traced = jitted.trace(*args)
  compiled = traced.lower().compile()
  seconds = time.perf_counter() - start
  memory, text = compiled.memory_analysis(), compiled.as_text()
  return Step(name, seconds, memory.argument_size_in_bytes, memory.output_size_in_bytes, memory.alias_size_in_bytes,
              memory.temp_size_in_bytes, flops.count(traced.jaxpr, platform), hlo_bytes.memory_bytes(text),
              hlo_bytes.collective_bytes(text, num_stages)), compiled


def compile_op(target: targets.Target, name: str, fn, *args, devices=None) -> Step:
  """One function compiled for one device of `target`, its arguments abstract (arrays or ShapeDtypeStructs,
  placed on that device): what the target's compiler says of it, as a `Step` (`Step.estimated_s` is its roofline
  time). `devices`: the target's compile-only devices, when the caller already has them."""
  device = (devices or targets.compile_only_devices(target))[0]
  args = _abstract(args, SingleDeviceSharding(device))
  return compile_step(name, jax.jit(fn), *args, platform=target.platform)[0]


def _table_bytes(pipe: pipeline.Pipeline, links) -> int:
  """Bytes of the per-example AQ-SGD tables in a train state's links (a LinkState per boundary, or
  the sharded executor's one LinkState of stacked tables)."""
  if not isinstance(pipe.boundary.fwd, schemes.AQSGD):
    return 0
  links = [links] if isinstance(links, LinkState) else links
  return sum(a.size * a.dtype.itemsize for link in links for a in jax.tree.leaves((link.fwd_send, link.fwd_recv)))


def compile_for(target: targets.Target, pipe: pipeline.Pipeline, optimizer: optax.GradientTransformation, batch,
                plan: Plan = Plan(), steps=("train", "eval")) -> DryRun:
  """Compiles the train step (Mode.TRAIN) and the compressed eval step for `target`; `batch` is a
  tree of arrays or ShapeDtypeStructs (the global batch). A compiler that runs out of device memory
  gives a DryRun with `error` set and `fits` False; other failures raise."""
  devices = targets.compile_only_devices(target)
  if plan.aqsgd_buffers == "host":
    if plan.executor != "simulate" or not isinstance(pipe.boundary.fwd, schemes.AQSGD):
      raise ValueError("host AQ-SGD buffers need the simulate executor and an aqsgd+ forward spec")
    pipe = hostbuffer.device_pipeline(pipe, jax.tree.leaves(batch)[0].shape[0])
  if plan.executor == "simulate":
    place = SingleDeviceSharding(devices[0])
    abstract_state = jax.eval_shape(lambda b: pipeline.init_state(pipe, optimizer, jax.random.key(0), b), batch)
    state = _abstract(abstract_state, place)
    batch = _abstract(batch, place)
    build = {"train": lambda: simulate.make_train_step(pipe, optimizer, Mode.TRAIN),
             "eval": lambda: simulate.make_eval_step(pipe, True)}
    layout = f"simulate on one {target.chip.name}" + (f" of {len(devices)}" if len(devices) > 1 else "")
    counted = simulate.wire_bytes_per_step(pipe, batch)
    tables = _table_bytes(pipe, state.links)
  else:
    ex = sharded.ShardedExecutor(sharded.make_mesh(pipe.num_stages, plan.data, devices), plan.grad_scheme, schedule=plan.schedule)
    state = ex.state_shapes(pipe, optimizer, batch)
    batch = _abstract(batch, NamedSharding(ex.mesh, P(sharded.DATA)))
    build = {"train": lambda: ex.build_step(pipe, optimizer, Mode.TRAIN, True, state, batch),
             "eval": lambda: ex.build_step(pipe, None, Mode.EVAL_COMPRESSED, False, state, batch)}
    layout = (f"gpipe: {pipe.num_stages} stages x {plan.data} data on {pipe.num_stages * plan.data} of "
              f"{len(devices)} chips, schedule {plan.schedule}, {pipe.microbatches} microbatches")
    counted = ex.wire_bytes_per_step(pipe, batch)
    tables = _table_bytes(pipe, state.links) // (pipe.num_stages * plan.data)
  try:
    stages = pipe.num_stages if plan.executor == "gpipe" else None
    compiled = tuple(compile_step(name, build[name](), state, batch, platform=target.platform, num_stages=stages)[0]
                     for name in steps)
  except jax.errors.JaxRuntimeError as err:
    if "RESOURCE_EXHAUSTED" not in str(err):
      raise
    message = re.sub(r"\s+", " ", str(err).split("RESOURCE_EXHAUSTED:", 1)[1]).strip()
    return DryRun(target, plan, layout, (), counted, tables, message[:300])
  return DryRun(target, plan, layout, compiled, counted, tables)
