"""One acceptance command for a lent accelerator: it measures what the dry runs only estimate.

    python -m benchmarks.device_check [--out runs/device_check] [--budget-s 450] [--tiny]

Sections, in this order (`--sections` picks some), each run in a child process (a crash or a device out of
memory costs that section only; its error is recorded and the others go on), each skipped with its reason once
the time budget would not hold it; `device_check.json` and `device_check.md` are rewritten after each child:
  provenance  the device (kind, platform, driver, memory) and the software (jax, jaxlib, CUDA/TPU plugins,
              python), the commit and the date: every figure below was measured there
  codecs      encode + decode of each codec family (CODECS) on a GPT-2 small and an XL boundary activation
              ([8, 1024, 768] and [8, 1024, 1600], bfloat16 and float32): GB/s of the dense tensor, and the
              bytes the pair must move (2 x (dense + payload)) over its time as a fraction of the copy bandwidth
              measured on the same tensor (x + 1); goal >= 0.5 for quantizers, >= 0.25 for TopK (pass/fail)
  steps:small GPT-2 small, paper recipe (batch 8 x 1024, 4 stages, AdamW, clipping), simulate on the one device:
              the train step of each of PRESETS (fp32 first), one child each: the measured step time (its ratio
              to fp32 is compression's cost; goal <= 1.05) and peak device memory (`memory_stats`), beside the
              dry run's figures of the very program that ran (`dryrun.compile_step`: memory analysis, FLOPs, HBM
              traffic, and the roofline estimate from the chip's published peaks where `targets.for_device_kind`
              knows the chip). A step whose predicted peak exceeds the free device memory is skipped, said why.
  compile-only  `--compile-for TARGET`'s dry run (`dryrun.compile_for`, compile-only devices in a CPU-only child,
              train step) of GPT-2 small fp32 and top10-reuse for this device's target (or --compile-target),
              beside what steps:small measured; it runs in the background from the start
  sharded     the sharded executor on a 1-stage mesh of this device (a 1-stage GPT-2: no boundary) against
              simulate on the same state and batch: the losses of 3 steps and the step times
  tests       `pytest -x` (-q from pyproject) on the codec, scheme and boundary tests with this device as JAX's backend
              (JAX_PLATFORMS, which tests/conftest.py leaves as it finds it)
  steps:medium, steps:xl  as steps:small for GPT-2 medium and XL (fp32, top10-reuse, aqsgd-fw2-bw4)
`--tiny`: every section at toy sizes (GPT-2 tiny, 32-token blocks, [2, 16, 64] activations, one test file), in
seconds on a CPU (tests/test_benchmarks.py runs it and checks the JSON). Nothing here is a figure unless it was
measured or compiled in this run: fields say which (`measured`, `dry_run`: compiled not run, `estimate`).
"""
import argparse
import contextlib
import datetime
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
import time

BUDGET_S = {False: 450, True: 1800}  # the whole command's: under the 8 minutes a lent device is planned for
PRESETS = ("fp32", "top10-reuse", "aqsgd-fw2-bw4", "direct-fw4-bw8", "tile64-fw3-bw4")
LARGE_PRESETS = TINY_PRESETS = ("fp32", "top10-reuse", "aqsgd-fw2-bw4")
COMPILE_ONLY_PRESETS = ("fp32", "top10-reuse")
QUANTIZER_GOAL, TOPK_GOAL, OVERHEAD_GOAL = 0.5, 0.25, 1.05
CODECS = (  # (family, spec, goal: the pair's bytes moved / time as a fraction of the copy bandwidth)
    ("minmax", "quant:2", QUANTIZER_GOAL), ("minmax", "quant:4", QUANTIZER_GOAL), ("minmax", "quant:8", QUANTIZER_GOAL),
    ("max-abs", "maxabs:2", QUANTIZER_GOAL), ("max-abs", "maxabs:4", QUANTIZER_GOAL),
    ("max-abs", "maxabs:8", QUANTIZER_GOAL),
    ("grouped", "maxabs:3:group=64", QUANTIZER_GOAL), ("grouped", "maxabs:4:group=64:stoch", QUANTIZER_GOAL),
    ("TopK", "topk:0.1", TOPK_GOAL), ("TopK", "topk:0.1:q8", TOPK_GOAL), ("TopK", "reuse", TOPK_GOAL),
    ("fp8", "fp8:scaled", QUANTIZER_GOAL), ("Hadamard", "hadamard+maxabs:4:group=64", QUANTIZER_GOAL))
SHAPES = {False: ((8, 1024, 768), (8, 1024, 1600)), True: ((2, 16, 64),)}
DTYPES = ("bfloat16", "float32")
TEST_FILES = {False: ("tests/test_codecs.py", "tests/test_schemes.py", "tests/test_boundary.py"),
              True: ("tests/test_schemes.py",)}
SECTIONS = ("provenance", "compile-only", "codecs", "steps:small", "sharded", "tests", "steps:medium", "steps:xl")
# seconds a section needs at least to be worth starting (full size; --tiny: none)
MIN_SECONDS = {"provenance": 5, "codecs": 30, "steps:small": 45, "sharded": 40, "tests": 30, "steps:medium": 60,
               "steps:xl": 90}
CALLS = 10  # codec and copy calls timed back to back (`common.pipelined_seconds`)
GPU_MEMORY_FRACTION = "0.95"  # of device memory the step children may use (JAX's default is 0.75)


# ------------------------------------------------------------------------------------------------ children
# Each runs in its own process, prints one JSON object per line as it goes (a child stopped at the budget
# keeps what it printed) and initialises the device itself; the parent never does.

def emit(**record):
  print(json.dumps(record), flush=True)


def device_platform():
  """(the default device, the platform name `flops.count` and `lax.platform_dependent` use)."""
  import jax
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
  import jax
  device, plat = device_platform()
  stats = device.memory_stats() or {}
  emit(kind="provenance", device_kind=device.device_kind, platform=plat, device_count=jax.device_count(),
       platform_version=getattr(device.client, "platform_version", ""), bytes_limit=stats.get("bytes_limit"),
       python=platform.python_version(), versions=versions(), **nvidia_smi())


def child_codecs(args):
  import jax
  from benchmarks import codec_throughput
  repeats = 3 if args.tiny else 20
  for shape in SHAPES[args.tiny]:
    for dtype in DTYPES:
      x = jax.random.normal(jax.random.key(0), shape, dtype)
      dense = x.size * x.dtype.itemsize
      copy_s = codec_throughput.copy_seconds(x, repeats)
      emit(kind="copy", shape=list(shape), dtype=dtype, dense_bytes=dense, copy_s=copy_s, copy_bytes_per_s=2 * dense / copy_s,
           calls=CALLS, repeats=repeats)
      for family, text, goal in CODECS:
        try:
          encode_s, decode_s, wire = codec_throughput.codec_seconds(text, x, repeats)
        except Exception as err:  # one codec's failure is its row's
          emit(kind="codec", shape=list(shape), dtype=dtype, family=family, spec=text, error=repr(err)[:500])
          continue
        pair_s = encode_s + decode_s
        fraction = 2 * (dense + wire) / pair_s / (2 * dense / copy_s)
        emit(kind="codec", shape=list(shape), dtype=dtype, family=family, spec=text, wire_bytes=wire,
             dense_bytes=dense, encode_s=encode_s, decode_s=decode_s, dense_gb_per_s=dense / pair_s / 1e9,
             fraction_of_copy=fraction, goal=goal, passed=fraction >= goal)


def run_config(model: str, preset: str, tiny: bool, **settings):
  """(experiment config, (forward spec, backward spec)) of GPT-2 `model` with `preset`'s compression:
  the paper recipe, or (tiny) the tiny recipe on 32-token blocks; `settings` on top."""
  from benchmarks.throughput_vs_bandwidth import method_specs
  from experiments import config, gpt2_wikitext
  fwd, bwd = method_specs()[preset]
  recipe = dict(recipe="tiny", block_size=32, train_examples=64) if tiny else dict(recipe="paper")
  return config.resolve(gpt2_wikitext.EXPERIMENT, **recipe, model=model, fwd=fwd, bwd=bwd, run_name="device_check",
                        **settings), (fwd, bwd)


def random_batch(config, batch):
  """`batch` (the experiment's placeholder) with tokens drawn uniformly from the run's vocabulary, on the
  default device."""
  import jax
  import jax.numpy as jnp
  from jaxcomp.data import text
  from jaxcomp.models import gpt2
  vocab = text.ByteTokenizer().vocab_size if config.options.tokenizer == "bytes" else gpt2.GPT2Config().vocab_size
  tokens = jax.random.randint(jax.random.key(0), batch["tokens"].shape, 0, vocab, batch["tokens"].dtype)
  return {**{k: jnp.asarray(v) for k, v in batch.items()}, "tokens": tokens}


def timed(run, calls: int, repeats: int) -> float:
  """Median over `repeats` of the seconds per step of `calls` steps dispatched back to back."""
  import jax
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
  import jax
  from experiments import config as run_settings
  from experiments import gpt2_wikitext
  from jaxcomp.analysis import dryrun, targets
  from jaxcomp.compress.boundary import Mode
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
  from experiments import config as run_settings
  from experiments import gpt2_wikitext
  from jaxcomp.analysis import dryrun, targets
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
  import jax
  from experiments import config as run_settings
  from experiments import gpt2_wikitext
  from jaxcomp.compress.boundary import Mode
  from jaxcomp.parallel import executors
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


# ------------------------------------------------------------------------------------------------ the parent

class Check:
  """The results (`device_check.json`: one key per section), the budget, and the children that fill them."""

  def __init__(self, args):
    self.args, self.out = args, pathlib.Path(args.out)
    self.deadline = time.monotonic() + args.budget_s
    self.results = {"command": " ".join(["python -m benchmarks.device_check", *args.argv]), "tiny": args.tiny,
                    "budget_s": args.budget_s, "started_utc": datetime.datetime.now(datetime.UTC).isoformat(
                        timespec="seconds"), "commit": args.commit or commit(), "sections": {}}
    self.background = None

  def left(self) -> float:
    return self.deadline - time.monotonic()

  def env(self, **extra) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(self.out / "jax_cache"))  # a rerun after a timeout compiles less
    return {**env, **extra}

  def child_argv(self, kind: str, *extra) -> list[str]:
    return [sys.executable, "-m", "benchmarks.device_check", "--child", kind, *(["--tiny"] if self.args.tiny else []),
            *extra]

  def run_child(self, kind: str, *extra, env=None, timeout=None) -> tuple[list[dict], str | None]:
    """(the records a child printed, its error or None); stopped at the budget (or `timeout`) with what it
    printed kept."""
    timeout = max(1.0, min(self.left(), timeout or math.inf))
    try:
      done = subprocess.run(self.child_argv(kind, *extra), capture_output=True, text=True, timeout=timeout,
                            env=env or self.env(), cwd=ROOT)
      stdout, error = done.stdout, None if done.returncode == 0 else (
          f"exit {done.returncode}: " + " | ".join(done.stderr.strip().splitlines()[-3:]))[:2000]
    except subprocess.TimeoutExpired as err:
      stdout = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
      error = f"stopped after {timeout:.0f} s (the time budget)"
    return records(stdout), error

  def section(self, name: str, value):
    self.results["sections"][name] = value
    self.write()

  def write(self):
    self.results["elapsed_s"] = round(self.args.budget_s - self.left(), 1)
    self.out.mkdir(parents=True, exist_ok=True)
    for path, text in ((self.out / "device_check.json", json.dumps(self.results, indent=1)),
                       (self.out / "device_check.md", report(self.results))):
      tmp = path.with_name(path.name + ".tmp")
      tmp.write_text(text)
      os.replace(tmp, path)

  def skip_reason(self, name: str) -> str | None:
    need = 0 if self.args.tiny else MIN_SECONDS.get(name, 0)
    if self.left() < need:
      return f"skipped: {self.left():.0f} s of the {self.args.budget_s:.0f} s budget left, the section needs ~{need} s"
    return None

  # ------------------------------------------------------------------------ sections
  def provenance(self):
    from jaxcomp.analysis import targets
    found, error = self.run_child("provenance", timeout=120)
    found = found[0] if found else {}
    target = targets.for_device_kind(found["device_kind"]) if "device_kind" in found else None
    self.section("provenance", {**found, "target": target and target.name, **({"error": error} if error else {})})

  def codecs(self):
    found, error = self.run_child("codecs")
    self.section("codecs", {"copy": [r for r in found if r["kind"] == "copy"],
                            "rows": [r for r in found if r["kind"] == "codec"], "error": error})

  def steps(self, model: str):
    name, presets = f"steps:{model}", PRESETS if model == "small" else LARGE_PRESETS
    if self.args.tiny:  # toy sizes: GPT-2 tiny; dense, TopK and AQ-SGD steps, the larger models' with fp32 alone
      model, presets = "tiny", TINY_PRESETS if name == "steps:small" else presets[:1]
    rows = []
    env = self.env(XLA_PYTHON_CLIENT_MEM_FRACTION=GPU_MEMORY_FRACTION)
    for preset in presets:
      reason = self.skip_reason(name)
      if reason:
        rows.append({"preset": preset, "skipped": reason})
        continue
      found, error = self.run_child("step", "--model", model, "--preset", preset, env=env)
      rows.append({**(found[-1] if found else {"preset": preset}), **({"error": error} if error else {})})
      self.section(name, {"model": model, "rows": overheads(rows)})
    self.section(name, {"model": model, "rows": overheads(rows)})

  def start_compile_only(self):
    """The dry run of `--compile-for TARGET` in a CPU-only child, in the background."""
    target = self.args.compile_target or self.results["sections"].get("provenance", {}).get("target")
    if not target:
      kind = self.results["sections"].get("provenance", {}).get("device_kind", "unknown")
      self.section("compile-only", {"skipped": f"no compile-only target describes this device ({kind}); "
                                               "--compile-target names one"})
      return
    self.background = (target, time.monotonic(), subprocess.Popen(
        self.child_argv("compile-only", "--target", target, "--model", "tiny" if self.args.tiny else "small",
                        "--preset", ",".join(COMPILE_ONLY_PRESETS)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env(JAX_PLATFORMS="cpu"), cwd=ROOT))
    self.section("compile-only", {"target": target, "running": "in the background"})

  def finish_compile_only(self):
    if self.background is None:
      return
    target, start, child = self.background
    try:
      stdout, stderr = child.communicate(timeout=max(1.0, self.left()))
      error = None if child.returncode == 0 else f"exit {child.returncode}: " + " | ".join(stderr.strip().splitlines()[-3:])
    except subprocess.TimeoutExpired:
      child.kill()
      stdout, _ = child.communicate()
      error = "stopped at the end of the time budget"
    self.section("compile-only", {"target": target, "wall_s": time.monotonic() - start, "rows": records(stdout),
                                  "error": error})

  def sharded(self):
    found, error = self.run_child("sharded", "--model", "tiny" if self.args.tiny else "small")
    self.section("sharded", {**(found[-1] if found else {}), "error": error})

  def tests(self):
    plat = self.results["sections"].get("provenance", {}).get("platform", "cpu")
    start = time.monotonic()
    argv = [sys.executable, "-m", "pytest", "-x", "-p", "no:cacheprovider", *TEST_FILES[self.args.tiny]]  # -q: addopts
    try:
      # on an accelerator, XLA's defaults: tests/conftest.py adds its fake CPU devices and XLA:CPU's fast-compile
      # flags only where XLA_FLAGS is unset
      flags = {} if plat == "cpu" else {"XLA_FLAGS": ""}
      done = subprocess.run(argv, capture_output=True, text=True, timeout=max(1.0, self.left()), cwd=ROOT,
                            env=self.env(JAX_PLATFORMS=plat, **flags))
      lines, rc = done.stdout.strip().splitlines(), done.returncode
    except subprocess.TimeoutExpired as err:
      lines, rc = (err.stdout.decode() if isinstance(err.stdout, bytes) else err.stdout or "").splitlines(), None
    self.section("tests", {"argv": argv[1:], "platform": plat, "returncode": rc, "wall_s": time.monotonic() - start,
                           "summary": lines[-1] if lines else "", "tail": lines[-15:] if rc else [],
                           **({"error": "stopped at the end of the time budget"} if rc is None else {})})


def records(stdout: str) -> list[dict]:
  out = []
  for line in stdout.splitlines():
    with contextlib.suppress(ValueError):
      value = json.loads(line)
      if isinstance(value, dict) and "kind" in value:
        out.append(value)
  return out


def overheads(rows: list[dict]) -> list[dict]:
  """Rows with each measured step time over fp32's (the same model, this run) and the goal's verdict."""
  base = next((r["measured"]["step_s"] for r in rows if r.get("preset") == "fp32" and "measured" in r), None)
  for r in rows:
    if base and "measured" in r:
      r["over_fp32"] = r["measured"]["step_s"] / base
      r["overhead_passed"] = r["over_fp32"] <= OVERHEAD_GOAL
  return rows


def commit() -> str:
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                          timeout=10).stdout.strip() or "unknown"
  except (OSError, subprocess.SubprocessError):
    return "unknown"


ROOT = pathlib.Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------------ the report

def _gib(b):
  return "-" if b is None else f"{b / 2**30:.2f}"


def _ms(s):
  return "-" if s is None else f"{1e3 * s:.2f}"


def report(results: dict) -> str:
  """device_check.md: every section's figures with where they come from; skipped and failed parts said so."""
  s = results["sections"]
  p = s.get("provenance", {})
  lines = ["# device_check", "", f"`{results['command']}`, commit {results['commit']}, started "
           f"{results['started_utc']}, {results.get('elapsed_s', 0):.0f} s of a {results['budget_s']:.0f} s budget"
           + (" (--tiny: toy sizes)" if results["tiny"] else ""), ""]
  if p:
    lines += [f"Measured on: {p.get('device_kind', '?')} ({p.get('platform', '?')}, {p.get('device_count', '?')} "
              f"device(s), {_gib(p.get('bytes_limit'))} GiB for JAX), driver {p.get('driver_version', 'unknown')}, "
              f"{p.get('platform_version', '')}; python {p.get('python', '?')}; "
              + ", ".join(f"{k} {v}" for k, v in p.get("versions", {}).items()), ""]
  for name in SECTIONS:
    value = s.get(name)
    lines.append(f"## {name}")
    lines.append("")
    if value is None:
      lines += ["not run", ""]
      continue
    if isinstance(value, str):
      lines += [value, ""]
      continue
    if value.get("skipped"):
      lines += [value["skipped"], ""]
      continue
    if name == "codecs" and "rows" in value:
      lines += codec_lines(value)
    elif name.startswith("steps:") and "rows" in value:
      lines += step_lines(value)
    elif name == "compile-only":
      lines += compile_only_lines(value, s)
    elif name == "sharded" and "measured" in value:
      m = value["measured"]
      lines += [f"1-stage GPT-2 {value['model']} (measured): simulate {_ms(m['simulate']['step_s'])} ms, sharded "
                f"{_ms(m['sharded']['step_s'])} ms per step (x{value['sharded_over_simulate']:.3f}); losses of 3 steps "
                f"{m['simulate']['losses']} vs {m['sharded']['losses']}, largest difference "
                f"{value['max_loss_difference']:.3g}"]
    elif name == "tests" and "summary" in value:
      lines += [f"`{' '.join(value['argv'])}` with JAX_PLATFORMS={value['platform']}: {value['summary']} "
                f"(exit {value['returncode']}, {value['wall_s']:.0f} s)"]
      lines += ["", "```", *value["tail"], "```"] if value["tail"] else []
    if value.get("error"):
      lines.append(f"error: {value['error']}")
    lines.append("")
  return "\n".join(lines)


def codec_lines(value) -> list[str]:
  timing = value["copy"][0] if value["copy"] else {"calls": CALLS, "repeats": "?"}
  lines = [f"Measured: encode and decode, each the time per call of {timing['calls']} calls back to back (median of "
           f"{timing['repeats']} runs). GB/s of the dense tensor = its bytes / (encode + decode); of copy = (2 x (dense + "
           "payload) / (encode + decode)) / the copy bandwidth of x + 1 on the same tensor.", ""]
  for c in value["copy"]:
    lines.append(f"- copy {c['dtype']} {c['shape']}: {c['copy_bytes_per_s'] / 1e9:.1f} GB/s (read + write)")
  lines += ["", "| shape | dtype | family | codec | wire / dense | encode ms | decode ms | dense GB/s | of copy | goal "
            "| pass |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
  for r in value["rows"]:
    if "error" in r:
      lines.append(f"| {r['shape']} | {r['dtype']} | {r['family']} | `{r['spec']}` | error: {r['error'][:120]} |"
                   + " |" * 6)
      continue
    lines.append(f"| {r['shape']} | {r['dtype']} | {r['family']} | `{r['spec']}` | {r['wire_bytes'] / r['dense_bytes']:.4f} "
                 f"| {_ms(r['encode_s'])} | {_ms(r['decode_s'])} | {r['dense_gb_per_s']:.1f} | {r['fraction_of_copy']:.2f} "
                 f"| >= {r['goal']} | {'yes' if r['passed'] else '**no**'} |")
  return lines


def step_lines(value) -> list[str]:
  lines = [f"GPT-2 {value['model']}, simulate, train step. Measured: ms per step (steps back to back), its ratio to "
           f"fp32 (goal <= {OVERHEAD_GOAL}), peak device memory (`memory_stats` peak_bytes_in_use of the child "
           "process: the step, its state and the compiler's autotuning). Dry run (compiled, not run): the same "
           "program's peak (arguments + outputs - donated + temporaries) and the roofline estimate from the chip's "
           "published peaks.", "",
           "| preset | fwd / bwd | measured ms | / fp32 | <= 1.05 | measured peak GiB | dry-run peak GiB | est. ms "
           "(compute / memory) | compile s | note |", "|---|---|---:|---:|---|---:|---:|---:|---:|---|"]
  for r in value["rows"]:
    m, d = r.get("measured", {}), r.get("dry_run", {})
    est = (f"{_ms(d['estimated_s'])} ({_ms(d['compute_s'])} / {_ms(d['memory_s'])})" if "estimated_s" in d
           else "- (no chip figures)" if d else "-")
    verdict = "-" if "overhead_passed" not in r else "yes" if r["overhead_passed"] else "**no**"
    note = r.get("skipped") or r.get("error") or ""
    lines.append(f"| {r.get('preset')} | `{r.get('fwd', '')}` / `{r.get('bwd', '')}` | {_ms(m.get('step_s'))} | "
                 f"{r['over_fp32']:.3f} | {verdict} | {_gib(m.get('peak_bytes_in_use'))} | {_gib(d.get('peak_bytes'))} | "
                 f"{est} | {d.get('compile_s', 0):.1f} | {note[:200]} |" if "over_fp32" in r else
                 f"| {r.get('preset')} | `{r.get('fwd', '')}` / `{r.get('bwd', '')}` | {_ms(m.get('step_s'))} | - | - | "
                 f"{_gib(m.get('peak_bytes_in_use'))} | {_gib(d.get('peak_bytes'))} | {est} | "
                 f"{d.get('compile_s', 0):.1f} | {note[:200]} |")
  return lines


def compile_only_lines(value, sections) -> list[str]:
  if "rows" not in value:
    return [value.get("running", "")]
  measured = {r.get("preset"): r.get("measured", {}) for r in sections.get("steps:small", {}).get("rows", [])}
  lines = [f"`--compile-for {value['target']}` (compile-only devices, CPU-only child, {value['wall_s']:.0f} s; "
           "compiled, not run) beside the steps measured above.", "",
           "| preset | dry-run peak GiB | measured peak GiB | est. ms (roofline) | measured ms |",
           "|---|---:|---:|---:|---:|"]
  for r in value["rows"]:
    m = measured.get(r["preset"], {})
    lines.append(f"| {r['preset']} | {_gib(r['peak_bytes'])} | {_gib(m.get('peak_bytes_in_use'))} | "
                 f"{_ms(r['dry_run'].get('estimated_s'))} | {_ms(m.get('step_s'))} |")
  return lines


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="runs/device_check", help="folder for device_check.json and .md")
  parser.add_argument("--budget-s", type=float, help=f"time budget in seconds (default {BUDGET_S[False]}, "
                      f"--tiny {BUDGET_S[True]})")
  parser.add_argument("--tiny", action="store_true", help="toy sizes: every section in seconds on a CPU")
  parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS))
  parser.add_argument("--compile-target", help="compile-only section's target (default: this device's)")
  parser.add_argument("--commit", help="the commit measured (default: git rev-parse, where the checkout has .git)")
  parser.add_argument("--child", choices=CHILDREN, help=argparse.SUPPRESS)
  parser.add_argument("--model", default="small", help=argparse.SUPPRESS)
  parser.add_argument("--preset", default="fp32", help=argparse.SUPPRESS)
  parser.add_argument("--target", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    CHILDREN[args.child](args)
    return
  args.argv = list(sys.argv[1:] if argv is None else argv)
  args.budget_s = args.budget_s or BUDGET_S[args.tiny]
  wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
  unknown = [s for s in wanted if s not in SECTIONS]
  if unknown:
    parser.error(f"--sections: unknown {unknown}; choose from {','.join(SECTIONS)}")
  check = Check(args)
  for name in [s for s in SECTIONS if s in wanted]:
    reason = check.skip_reason(name)
    if reason and name not in ("compile-only",):
      check.section(name, {"skipped": reason})
      print(f"[device_check] {name}: {reason}", flush=True)
      continue
    started = time.monotonic()
    try:
      if name == "provenance":
        check.provenance()
      elif name == "codecs":
        check.codecs()
      elif name.startswith("steps:"):
        check.steps(name.split(":")[1])
      elif name == "compile-only":
        check.start_compile_only()
      elif name == "sharded":
        check.sharded()
      elif name == "tests":
        check.tests()
    except Exception as err:  # the parent's own failure in a section: recorded, the next section goes on
      check.section(name, {"error": repr(err)[:2000]})
    print(f"[device_check] {name}: {time.monotonic() - started:.0f} s", flush=True)
  check.finish_compile_only()
  check.write()
  print(report(check.results))
  print(f"\n[device_check] wrote {check.out / 'device_check.json'} and {check.out / 'device_check.md'}")


if __name__ == "__main__":
  main()
