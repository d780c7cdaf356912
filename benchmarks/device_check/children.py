"""The sections' child processes. Each runs in its own process, prints one JSON object per line as it goes (a child
stopped at the budget keeps what it printed) and initialises the device itself; the parent never does."""
import contextlib
import importlib.metadata
import json
import math
import platform
import subprocess
import time

import jax
import jax.numpy as jnp

from benchmarks import common
from benchmarks.device_check.settings import CALLS, CODECS, DTYPES, SHAPES
from experiments import config as run_settings
from experiments import gpt2_wikitext
from jaxcomp.analysis import codec_cost, dryrun, targets
from jaxcomp.compress import spec
from jaxcomp.compress.boundary import Mode
from jaxcomp.data import text
from jaxcomp.models import gpt2
from jaxcomp.parallel import executors


def emit(**record):
  print(json.dumps(record), flush=True)


def device_platform():
  """(the default device, the platform name `flops.count` and `lax.platform_dependent` use)."""
  device = jax.devices()[0]
  return device, "cuda" if device.platform == "gpu" else device.platform


def versions() -> dict:
  """Installed versions of the packages a figure depends on (plugins found by name)."""
  names = ["jax", "jaxlib", "flax", "optax", "numpy", "libtpu"]
  names += sorted({d.metadata["Name"] for d in importlib.metadata.distributions()
                   if (d.metadata["Name"] or "").lower().startswith(("jax-cuda", "jax_cuda", "jax-rocm"))})
  out = {}
  for name in names:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
      out[name] = importlib.metadata.version(name)
  return out


def nvidia_smi() -> dict:
  """The driver's name, version and memory of GPU 0 (empty without nvidia-smi)."""
  try:
    line = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=20).stdout.splitlines()[0]
  except (OSError, subprocess.SubprocessError, IndexError):
    return {}
  name, driver, memory = (part.strip() for part in line.split(",")[:3])
  return {"gpu_name": name, "driver_version": driver, "memory_total": memory}


def child_provenance(args):
  device, plat = device_platform()
  stats = device.memory_stats() or {}
  emit(kind="provenance", device_kind=device.device_kind, platform=plat, device_count=jax.device_count(),
       platform_version=getattr(device.client, "platform_version", ""), bytes_limit=stats.get("bytes_limit"),
       python=platform.python_version(), versions=versions(), **nvidia_smi())


def device_target(device, copy_bytes_per_s: float) -> targets.Target:
  """The one-chip target of `device` for the compiled estimates: its published figures where `targets` knows the
  chip, else (a CPU, an unlisted GPU) the bandwidth of x + 1 measured here as its memory bandwidth."""
  known = targets.for_device_kind(device.device_kind)
  if known:
    return known
  _, plat = device_platform()
  chip = targets.Chip(device.device_kind, 0, copy_bytes_per_s, {"bfloat16": 1e15, "float32": 1e15},
                      "x + 1 measured on this device (no published figures)")
  return targets.Target("this device", chip, plat, "", 1)


def compiled_pair(target, device, codec_spec: str, shape, dtype) -> dict:
  """The measured pair's ops compiled for this device (`codec_cost`): encode + decode, or reuse's values_at +
  scatter; their logical and compiled bytes, row sorts and roofline seconds."""
  reuse = codec_spec == common.REUSE
  codec = spec.parse_codec(common.REUSE_OF if reuse else codec_spec)
  ops = codec_cost.codec_costs(target, codec, shape, dtype, reuse, devices=[device])
  pair = [o for o in ops if o.op in (("values_at", "scatter") if reuse else ("encode", "decode"))]
  return {"logical_bytes": sum(o.logical_bytes for o in pair), "traffic_bytes": sum(o.traffic_bytes for o in pair),
          "row_sorts": sum(o.row_sorts for o in pair), "estimate_s": sum(o.roofline_s for o in pair)}


def child_codecs(args):
  repeats = 3 if args.tiny else 20
  device, _ = device_platform()
  for shape in SHAPES[args.tiny]:
    for dtype in DTYPES:
      x = jax.random.normal(jax.random.key(0), shape, dtype)
      dense = x.size * x.dtype.itemsize
      copy_s = common.copy_seconds(x, repeats)
      emit(kind="copy", shape=list(shape), dtype=dtype, dense_bytes=dense, copy_s=copy_s, copy_bytes_per_s=2 * dense / copy_s,
           calls=CALLS, repeats=repeats)
      target = device_target(device, 2 * dense / copy_s)
      for family, codec_spec, goal in CODECS:
        try:
          encode_s, decode_s, wire = common.codec_seconds(codec_spec, x, repeats)
          compiled = compiled_pair(target, device, codec_spec, shape, dtype)
        except Exception as err:  # one codec's failure is its row's
          emit(kind="codec", shape=list(shape), dtype=dtype, family=family, spec=codec_spec, error=repr(err)[:500])
          continue
        pair_s = encode_s + decode_s
        fraction = 2 * (dense + wire) / pair_s / (2 * dense / copy_s)
        emit(kind="codec", shape=list(shape), dtype=dtype, family=family, spec=codec_spec, wire_bytes=wire,
             dense_bytes=dense, encode_s=encode_s, decode_s=decode_s, dense_gb_per_s=dense / pair_s / 1e9,
             fraction_of_copy=fraction, goal=goal, passed=fraction >= goal, compiled=compiled,
             memory_bandwidth=target.chip.hbm_bytes_per_s, memory_bandwidth_source=target.chip.source,
             fraction_of_memory_bandwidth=compiled["logical_bytes"] / pair_s / target.chip.hbm_bytes_per_s,
             estimate_over_measured=compiled["estimate_s"] / pair_s)


def run_config(model: str, preset: str, tiny: bool, **settings):
  """(experiment config, (forward spec, backward spec)) of GPT-2 `model` with `preset`'s compression:
  the paper recipe, or (tiny) the tiny recipe on 32-token blocks; `settings` on top."""
  fwd, bwd = common.method_specs()[preset]
  recipe = dict(recipe="tiny", block_size=32, train_examples=64) if tiny else dict(recipe="paper")
  return run_settings.resolve(gpt2_wikitext.EXPERIMENT, **recipe, model=model, fwd=fwd, bwd=bwd, run_name="device_check",
                        **settings), (fwd, bwd)


def random_batch(config, batch):
  """`batch` (the experiment's placeholder) with tokens drawn uniformly from the run's vocabulary, on the
  default device."""
  vocab = text.ByteTokenizer().vocab_size if config.options.tokenizer == "bytes" else gpt2.GPT2Config().vocab_size
  tokens = jax.random.randint(jax.random.key(0), batch["tokens"].shape, 0, vocab, batch["tokens"].dtype)
  return {**{k: jnp.asarray(v) for k, v in batch.items()}, "tokens": tokens}


def timed(run, calls: int, repeats: int) -> float:
  """Median over `repeats` of the seconds per step of `calls` steps dispatched back to back."""
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = [run() for _ in range(calls)]
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / calls)
  return sorted(times)[len(times) // 2]


def dry_run_fields(step, target) -> dict:
  """The dry run's figures of a compiled step (compiled, not run), and its roofline estimate where the chip is
  known."""
  out = {"argument_bytes": step.argument_bytes, "output_bytes": step.output_bytes, "alias_bytes": step.alias_bytes,
         "temp_bytes": step.temp_bytes, "peak_bytes": step.peak_bytes, "matmul_flops": step.flops.matmul,
         "traffic_bytes": step.traffic_bytes, "compile_s": step.compile_s}
  if target is not None:
    chip = target.chip
    out.update(estimate_chip=chip.name, estimate_source=chip.source, estimated_s=step.estimated_s(chip),
               compute_s=step.compute_s(chip), memory_s=step.memory_s(chip))
  return out


def free_bytes(device):
  stats = device.memory_stats()
  return None if not stats or "bytes_limit" not in stats else stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def child_step(args):
  config, (fwd, bwd) = run_config(args.model, args.preset, args.tiny)
  pipe, optimizer, batch, _ = gpt2_wikitext.EXPERIMENT.abstract(config)
  device, plat = device_platform()
  target = targets.for_device_kind(device.device_kind)
  head = dict(kind="step", model=args.model, preset=args.preset, fwd=fwd, bwd=bwd, executor="simulate",
              batch=list(batch["tokens"].shape), stages=pipe.num_stages)
  batch = random_batch(config, batch)
  key = jax.random.key(config.training.seed)
  executor = run_settings.executor_for(config.executor)
  shapes = executor.state_shapes(pipe, optimizer, batch)
  step, compiled = dryrun.compile_step("train", lambda: executor.trace_step(pipe, optimizer, Mode.TRAIN, shapes, batch),
                                       plat)
  dry = dry_run_fields(step, target)
  free = free_bytes(device)
  if free is not None and step.peak_bytes > free:
    emit(**head, dry_run=dry, skipped=f"the compiled step needs {step.peak_bytes / 2**30:.2f} GiB, "
         f"{free / 2**30:.2f} GiB of device memory is free")
    return
  state = executor.init_state(pipe, optimizer, key, batch)
  holder = [state]

  def run():
    holder[0], metrics = compiled(holder[0], batch)
    return metrics["loss"]

  losses = [float(run()) for _ in range(2)]  # warm-up, and the losses are finite
  calls, repeats = (3, 3) if args.tiny else (10 if args.model == "small" else 4, 3)
  step_s = timed(run, calls, repeats)
  stats = device.memory_stats() or {}
  emit(**head, dry_run=dry, measured=dict(step_s=step_s, losses=losses, finite=all(map(math.isfinite, losses)),
                                          peak_bytes_in_use=stats.get("peak_bytes_in_use"),
                                          bytes_limit=stats.get("bytes_limit"), calls=calls, repeats=repeats))


def child_compile_only(args):
  target = targets.target(args.target)
  targets.prepare_host(target)  # before any backend starts
  for preset in args.preset.split(","):
    config, (fwd, bwd) = run_config(args.model, preset, args.tiny, compile_for=target.name)
    pipe, optimizer, batch, assumed = gpt2_wikitext.EXPERIMENT.abstract(config)
    executor = run_settings.executor_for(config.executor, targets.compile_only_devices(target),
                                         config.training.batch_size)
    report = dryrun.compile_for(target, executor, pipe, optimizer, batch, steps=("train",))
    fields = dry_run_fields(report.steps[0], target) if report.steps else {}
    emit(kind="compile-only", target=target.name, model=args.model, preset=preset, fwd=fwd, bwd=bwd,
         fits=report.fits, peak_bytes=report.peak_bytes, error=report.error, dry_run=fields, assumed=assumed)


def child_sharded(args):
  config, _ = run_config(args.model, "fp32", args.tiny, stages=1, executor="sharded")
  pipe, optimizer, batch, _ = gpt2_wikitext.EXPERIMENT.abstract(config)
  batch = random_batch(config, batch)
  key = jax.random.key(config.training.seed)
  out = {}
  sharded = run_settings.executor_config(config.executor)
  for name, chosen in (("simulate", executors.SimulateConfig()), ("sharded", sharded)):
    executor = executors.make_executor(chosen)
    holder = [executor.init_state(pipe, optimizer, key, batch)]
    step = executor.make_train_step(pipe, optimizer, Mode.TRAIN)

    def run(step=step, holder=holder):
      holder[0], metrics = step(holder[0], batch)
      return metrics["loss"]

    losses = [float(run()) for _ in range(3)]
    out[name] = dict(losses=losses, step_s=timed(run, 3 if args.tiny else 10, 3))
    del holder
  worst = max(abs(a - b) for a, b in zip(out["simulate"]["losses"], out["sharded"]["losses"]))
  emit(kind="sharded", model=args.model, stages=1, measured=out, max_loss_difference=worst,
       sharded_over_simulate=out["sharded"]["step_s"] / out["simulate"]["step_s"])


CHILDREN = {"provenance": child_provenance, "codecs": child_codecs, "step": child_step,
            "compile-only": child_compile_only, "sharded": child_sharded}

