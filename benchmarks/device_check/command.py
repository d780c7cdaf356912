"""device_check's parent: the time budget, a child process per section, device_check.json after each, the report."""
import argparse
import contextlib
import datetime
import json
import math
import os
import pathlib
import subprocess
import sys
import time

from benchmarks.device_check import __doc__ as package_doc
from benchmarks.device_check.children import CHILDREN
from benchmarks.device_check.report import report
from benchmarks.device_check.settings import (BUDGET_S, COMPILE_ONLY_PRESETS, GPU_MEMORY_FRACTION, LARGE_PRESETS,
                                              MIN_SECONDS, OVERHEAD_GOAL, PRESETS, ROOT, SECTIONS, TEST_FILES,
                                              TINY_PRESETS)

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


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m benchmarks.device_check", description=package_doc.splitlines()[0])
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

