"""`benchmarks.real_link` on a shaped network: two stage processes of tiny GPT-2, 2 steps per method.

Needs root, `ip`/`tc`/`unshare`/`taskset` and network namespaces (skipped, with the reason, where any is
missing). A train step's link bytes (htb counters: headers, ACKs and the step's scalar collectives
included) are within 10% of the bytes the driver counts; compressed steps move fewer link bytes than
fp32 ones; what an epoch sends besides its steps is evaluation (this tiny run evaluates one dense batch
twice), not a gathered state; an interrupted benchmark leaves no namespace and no process behind.
"""
import json
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from benchmarks import real_link

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT_S = 600
TINY = ["--batch-size", "8", "--train-examples", "16", "--eval-examples", "8", "--epochs", "1"]
NO_TIMING = ["--repeats", "0"]  # the interruption test needs no op timing


def unavailable() -> str | None:
  """Why the benchmark cannot build its network here (None: it can)."""
  missing = real_link.missing_prerequisites()
  if missing:
    return missing
  try:
    with real_link.Network(2, "100mbit"):
      return None
  except RuntimeError as err:
    return f"network namespaces, veth and htb ({err})"


def namespaces(pid: int) -> list[str]:
  listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
  return [line.split()[0] for line in listed.splitlines() if line.startswith(f"jaxcomp-rl{pid}-")]


@pytest.fixture(scope="module")
def network():
  why = unavailable()
  if why:
    pytest.skip(f"the real-link benchmark needs {why}")


@pytest.fixture(scope="module")
def rows(network, tmp_path_factory):
  out = tmp_path_factory.mktemp("real_link") / "rows.json"
  proc = subprocess.Popen([sys.executable, "-m", "benchmarks.real_link", "--rate", "100mbit", "--methods",
                           "fp32,direct-fw2-bw4", *TINY, "--repeats", "1", "--rounds", "1", "--json", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  try:
    log, _ = proc.communicate(timeout=TIMEOUT_S)
  finally:
    if proc.poll() is None:
      proc.send_signal(signal.SIGTERM)  # it removes its namespaces and stops its workers
      proc.wait(timeout=60)
  assert proc.returncode == 0, log[-3000:]
  assert not namespaces(proc.pid)
  return {r["method"]: r for r in json.loads(out.read_text())["rows"]}


def test_a_train_step_moves_at_most_10_percent_more_than_it_counts(rows):
  for r in rows.values():
    assert r["counted_bytes_per_step"] <= r["link_bytes_per_step"] <= 1.10 * r["counted_bytes_per_step"], r


def test_netsim_and_the_replayed_steps_are_measured(rows):
  """The documented default path times each stage's ops after training (`--repeats` > 0) and feeds netsim."""
  for r in rows.values():
    assert r["netsim_steps_per_s"] > 0 and r["replayed_steps_per_s"] > 0, r


def test_compressed_steps_move_fewer_link_bytes_than_fp32(rows):
  assert rows["direct-fw2-bw4"]["link_bytes_per_step"] < 0.5 * rows["fp32"]["link_bytes_per_step"]  # the tied exchange is 131 KB of both


def test_an_epoch_sends_evaluation_besides_its_steps_not_the_state(rows):
  """Here an epoch is 2 steps, then one dense evaluation batch with compression on (fp32) and off, a checkpoint
  and results: about one fp32 step's bytes. A checkpoint that gathered the state would add 3 MB (model and Adam)."""
  for r in rows.values():
    assert r["other_link_bytes_per_epoch"] < 1.5 * rows["fp32"]["counted_bytes_per_step"], r


def test_an_interrupted_benchmark_leaves_nothing_behind(network, tmp_path):
  proc = subprocess.Popen([sys.executable, "-m", "benchmarks.real_link", "--methods", "fp32", *TINY, *NO_TIMING, "--keep",
                           str(tmp_path / "kept")], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    deadline = time.monotonic() + 120
    while not list((tmp_path / "kept").glob("*/process*.log")) and time.monotonic() < deadline:
      time.sleep(0.2)
    assert namespaces(proc.pid), "the benchmark did not start its processes"
    time.sleep(3)  # the stage processes are running
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode != 0 and not namespaces(proc.pid)
  workers = subprocess.run(["pgrep", "-f", "--", f"--marks {tmp_path / 'kept'}"], capture_output=True, text=True).stdout
  assert not workers.split(), workers


def test_without_root_it_says_what_is_missing(monkeypatch, capsys):
  monkeypatch.setattr(real_link.os, "geteuid", lambda: 1000)
  with pytest.raises(SystemExit) as exit_:
    real_link.main(["--methods", "fp32"])
  assert str(exit_.value) == "error: the real-link benchmark needs root (network namespaces and tc need it): run as root"


def test_without_tc_it_says_what_is_missing(monkeypatch):
  monkeypatch.setattr(real_link.os, "geteuid", lambda: 0)
  monkeypatch.setattr(real_link.shutil, "which", lambda tool: None if tool == "tc" else f"/usr/bin/{tool}")
  assert real_link.missing_prerequisites() == "the command(s) tc (iproute2, util-linux)"
