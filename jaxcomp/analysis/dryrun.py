"""Compile a run's train and eval steps for a target accelerator and report what its compiler says; run nothing.

    target = targets.target("v5e-1")
    targets.prepare_host(target)  # this process: before any JAX backend starts
    executor = simulate.Simulate(device=targets.compile_only_devices(target)[0])
    report = dryrun.compile_for(target, executor, pipe, optimizer, batch_shapes)
    print(report.text()); report.fits

The executor is built for the target's compile-only devices (`targets.compile_only_devices`) and used
through its contract alone (`pipeline.Executor`): the train state and the batch are abstract
(`state_shapes`, `batch_shapes`: no parameter is allocated, no data read) and the steps are its
`trace_step`s. Per device, for each step:
  memory   XLA's memory analysis of the compiled program: arguments + outputs - donated
           (aliased) + temporaries = the step's peak, against the chip's HBM;
  FLOPs    matrix FLOPs of the step's jaxpr (`flops.count`: per device, loop bodies x trips,
           a switch's costliest branch, so every pipeline tick counts as its busiest stage);
  traffic  HBM bytes read and written by the compiled program (`hlo_bytes.memory_bytes`);
  time     an estimate, not a measurement: max(FLOPs / the chip's published peak for the
           operand type, traffic / its HBM bandwidth);
and the bytes the target's compiled collectives send (`hlo_bytes.collective_bytes`) next to
what the boundaries count (`Executor.wire_bytes_per_step`), and how many boundary messages the compiled
train step sends while it computes (`overlap.overlap`). A report states facts (what fits, how
much the AQ-SGD tables take); what to change is the caller's to say (`DryRun.text(advice)`).
"""
import dataclasses
import re
import time

import jax
import numpy as np
import optax
from jax.sharding import SingleDeviceSharding

from jaxcomp import pipeline
from jaxcomp.analysis import flops, hlo_bytes, overlap, targets
from jaxcomp.compress import schemes
from jaxcomp.compress.boundary import LinkState, Mode
from jaxcomp.parallel.mesh import STAGE


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
  overlap: overlap.Overlap  # boundary permutes with compute scheduled between start and done

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
  layout: str  # "sharded: 4 stages x 2 data, schedule 1f1b; 2 microbatches; on 8 TPU v5e chips"
  steps: tuple  # Step per compiled step (train, eval); empty when the compiler ran out of memory
  counted: dict  # wire_bytes_per_step: fwd, bwd (and data) the boundaries count
  compared: tuple  # the ways of `counted` the compiled collectives carry (`Executor.collective_ways`)
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

  def text(self, advice=()) -> str:
    """The report; `advice` (what the caller would change, e.g. flags) follows a step that does not fit."""
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
                   f"device, {missing / 2**30:.2f} GiB missing{why}" + ("; try: " + "; ".join(advice) if advice else ""))
    if self.steps:
      train = self.steps[0]
      lines.append(f"estimated train step: {1e3 * train.estimated_s(chip):.1f} ms per device "
                   f"({'compute' if train.compute_s(chip) >= train.memory_s(chip) else 'memory'}-bound) - an "
                   f"estimate from {chip.name}'s published peaks ({chip.source}), not a measurement")
      lines.append("wire bytes per train step: " + self.wire_text())
      if self.compared:
        lines.append(train.overlap.text())
    return "\n".join(lines)

  def wire_text(self) -> str:
    counted = ", ".join(f"{k} {v:,}" for k, v in self.counted.items())
    if not self.compared:
      return f"counted {counted} (one device: no link in the program)"
    sent = self.steps[0].collectives
    ways = [k for k in self.compared if k in sent or k in self.counted]  # a way neither has is not in this run
    same = all(sent.get(k, 0) == self.counted.get(k, 0) for k in ways)
    return (f"counted {counted}; the target's compiled collectives send "
            + ", ".join(f"{k} {sent.get(k, 0):,}" for k in ways) + (" (equal)" if same else " (DIFFERENT)"))


def _abstract(tree, sharding):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def compile_step(name, trace, platform: str, num_stages: int | None = None):
  """(what the compiler says of the program `trace()` returns, a `jax.stages.Traced`, as a `Step`; the compiled
  program). Tracing, lowering and compiling are timed together. The traced arguments may be abstract, on
  compile-only devices, or those of real arrays: the program then runs (`benchmarks.device_check` sets the dry
  run's figures beside a run of the very program they describe). `platform`: what `flops.count` counts for
  ("tpu", "cuda", "cpu"); `num_stages`: for the collectives' fwd/bwd split (None: no collectives)."""
  start = time.perf_counter()
  traced = trace()
  compiled = traced.lower().compile()
  seconds = time.perf_counter() - start
  memory, module = compiled.memory_analysis(), hlo_bytes.Module(compiled.as_text())  # parsed once, read three times
  return Step(name, seconds, memory.argument_size_in_bytes, memory.output_size_in_bytes, memory.alias_size_in_bytes,
              memory.temp_size_in_bytes, flops.count(traced.jaxpr, platform), hlo_bytes.memory_bytes(module),
              hlo_bytes.collective_bytes(module, num_stages), overlap.overlap(module)), compiled


def _stages(executor: pipeline.Executor) -> int | None:
  """The stage count of the executor's mesh (how `hlo_bytes.collective_bytes` numbers its devices)."""
  return None if executor.mesh is None else executor.mesh.shape[STAGE]


def collective_bytes(executor: pipeline.Executor, pipe: pipeline.Pipeline, optimizer, state, batch,
                     mode: Mode = Mode.TRAIN) -> dict[str, int]:
  """Bytes the collectives of the executor's compiled step of `mode` send per call, all devices: fwd, bwd,
  data (`hlo_bytes.collective_bytes` of `Executor.trace_step`'s program)."""
  text = executor.trace_step(pipe, optimizer, mode, state, batch).lower().compile().as_text()
  return hlo_bytes.collective_bytes(text, _stages(executor))


def compile_op(target: targets.Target, name: str, fn, *args, devices=None) -> Step:
  """One function compiled for one device of `target`, its arguments abstract (arrays or ShapeDtypeStructs,
  placed on that device): what the target's compiler says of it, as a `Step` (`Step.estimated_s` is its roofline
  time). `devices`: the target's compile-only devices, when the caller already has them (else
  `targets.compile_only_devices`, the process prepared for the target by its caller)."""
  device = (devices or targets.compile_only_devices(target))[0]
  args = _abstract(args, SingleDeviceSharding(device))
  return compile_step(name, lambda: jax.jit(fn).trace(*args), target.platform)[0]


def _table_bytes(pipe: pipeline.Pipeline, state) -> int:
  """Bytes per device of the per-example AQ-SGD tables in an abstract train state (each table's shard)."""
  if not isinstance(pipe.boundary.fwd, schemes.AQSGD):
    return 0
  links = jax.tree.leaves(state.links, is_leaf=lambda x: isinstance(x, LinkState))
  tables = jax.tree.leaves([(link.fwd_send, link.fwd_recv) for link in links])
  shard = lambda a: a.sharding.shard_shape(a.shape)
  return sum(int(np.prod(shard(a), dtype=np.int64)) * a.dtype.itemsize for a in tables)


def compile_for(target: targets.Target, executor: pipeline.Executor, pipe: pipeline.Pipeline,
                optimizer: optax.GradientTransformation, batch, steps=("train", "eval")) -> DryRun:
  """Compiles the train step (Mode.TRAIN) and the compressed eval step of `executor` (built for the target's
  compile-only devices) for `target`; `batch` is a tree of arrays or ShapeDtypeStructs (the global batch). A
  compiler that runs out of device memory gives a DryRun with `error` set and `fits` False; other failures raise."""
  state = executor.state_shapes(pipe, optimizer, batch)
  batch = executor.batch_shapes(batch)
  modes = {"train": Mode.TRAIN, "eval": Mode.EVAL_COMPRESSED}
  devices = 1 if executor.mesh is None else executor.mesh.size
  layout = (f"{executor.describe()}; {pipe.microbatches} microbatches; on "
            + (f"one {target.chip.name}" if devices == 1 else f"{devices} {target.chip.name} chips")
            + (f" of {target.devices}" if target.devices > devices else ""))
  counted = executor.wire_bytes_per_step(pipe, batch)
  tables = _table_bytes(pipe, state)
  compared = executor.collective_ways(Mode.TRAIN)
  try:
    compiled = tuple(compile_step(name, lambda mode=modes[name]: executor.trace_step(pipe, optimizer, mode, state, batch),
                                  target.platform, _stages(executor))[0] for name in steps)
  except jax.errors.JaxRuntimeError as err:
    if "RESOURCE_EXHAUSTED" not in str(err):
      raise
    message = re.sub(r"\s+", " ", str(err).split("RESOURCE_EXHAUSTED:", 1)[1]).strip()
    return DryRun(target, layout, (), counted, compared, tables, message[:300])
  return DryRun(target, layout, compiled, counted, compared, tables)
