"""`benchmarks.real_link` on a shaped network with latency: two stage processes of tiny GPT-2, 2 steps per method.

Needs root, `ip`/`tc`/`unshare`/`taskset`/`sysctl`, gcc, the TUN driver and network namespaces (skipped, with
the reason, where any is missing). The fixture runs the documented command (docs/guide/links.md) at toy sizes on
a 100 Mbit/s link with 20 ms one-way latency. A train step's link bytes (htb counters: headers, ACKs and the
step's scalar collectives included) are within 10% of the bytes the driver counts; compressed steps move fewer
link bytes than fp32 ones; what an epoch sends besides its steps is evaluation (this tiny run evaluates one dense
batch twice), not a gathered state; the delay line drops nothing; `--check-link` sees the round trip and the
rate; an interrupted benchmark leaves no namespace and no process behind.
"""
import json
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import pytest

from benchmarks import link_probe
from benchmarks.real_link import accounting, command, processes
from benchmarks.real_link import network as shaped
from jaxcomp.analysis.link import Link

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT_S = 600
LINK = "100mbit:20ms"
TINY = ["--batch-size", "8", "--train-examples", "16", "--eval-examples", "8", "--epochs", "1"]
NO_TIMING = ["--repeats", "0"]  # no op timing: no netsim, replayed steps or probes


def unavailable() -> str | None:
  """Why the benchmark cannot build its network here (None: it can)."""
  missing = shaped.missing_prerequisites(latency=True)
  if missing:
    return missing
  try:
    with shaped.Network(2, Link.parse(LINK)):
      return None
  except RuntimeError as err:
    return f"network namespaces, veth, htb and a TUN device ({err})"


def namespaces(pid: int) -> list[str]:
  listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
  return [line.split()[0] for line in listed.splitlines() if line.startswith(f"jaxcomp-rl{pid}-")]


@pytest.fixture(scope="module")
def network():
  why = unavailable()
  if why:
    pytest.skip(f"the real-link benchmark needs {why}")


@pytest.fixture(scope="module")
def run(network, tmp_path_factory):
  """The documented command (`--stages S --link LINK --methods METHOD --json ... --keep ...`) at toy sizes, once
  per method as the merged tables are made: fp32 with op timing, direct-fw2-bw4 without it (`--repeats 0`). Their
  JSON files (rows and the delay line's report)."""
  folder = tmp_path_factory.mktemp("real_link")
  outs = []
  for method, timing in (("fp32", ["--repeats", "1", "--rounds", "1"]), ("direct-fw2-bw4", NO_TIMING)):
    outs.append(folder / f"s2-{LINK}-{method}.json")
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.real_link", "--stages", "2", "--link", LINK, "--methods",
                             method, "--json", str(outs[-1]), "--keep", str(folder / f"s2-{LINK}-{method}.d"), *TINY,
                             *timing], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
      log, _ = proc.communicate(timeout=TIMEOUT_S)
    finally:
      if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # it removes its namespaces and stops its workers
        proc.wait(timeout=60)
    assert proc.returncode == 0, log[-3000:]
    assert not namespaces(proc.pid)
  return outs


@pytest.fixture(scope="module")
def rows(run):
  return {r["method"]: r for out in run for r in json.loads(out.read_text())["rows"]}


def test_a_train_step_moves_at_most_10_percent_more_than_it_counts(rows):
  for r in rows.values():
    assert r["counted_bytes_per_step"] <= r["link_bytes_per_step"] <= 1.10 * r["counted_bytes_per_step"], r


def test_netsim_and_the_replayed_steps_are_measured(rows):
  """The documented default path times each stage's ops after training (`--repeats` > 0) and feeds netsim; with
  `--repeats 0` neither is measured."""
  timed, untimed = rows["fp32"], rows["direct-fw2-bw4"]
  assert timed["netsim_steps_per_s"] > 0 and timed["replayed_steps_per_s"] > 0, timed
  assert untimed["netsim_steps_per_s"] is None and untimed["replayed_steps_per_s"] is None, untimed


def test_compressed_steps_move_fewer_link_bytes_than_fp32(rows):
  assert rows["direct-fw2-bw4"]["link_bytes_per_step"] < 0.5 * rows["fp32"]["link_bytes_per_step"]  # the tied exchange is 131 KB of both


def test_an_epoch_sends_evaluation_besides_its_steps_not_the_state(rows):
  """Here an epoch is 2 steps, then one dense evaluation batch with compression on (fp32) and off, a checkpoint
  and results: about one fp32 step's bytes. A checkpoint that gathered the state would add 3 MB (model and Adam)."""
  for r in rows.values():
    assert r["other_link_bytes_per_epoch"] < 1.5 * rows["fp32"]["counted_bytes_per_step"], r


def test_the_delay_line_carries_every_packet(run):
  for out in run:
    report = json.loads(out.read_text())["delay_line"]
    carried = re.search(r"delay 20\.000 ms, .* carried (\d+) packets, dropped (\d+) \(ring full\) \+ (\d+)", report)
    assert carried and int(carried[1]) > 1000 and carried.groups()[1:] == ("0", "0"), report


def test_merged_runs_are_one_table(run, capsys):
  """One method per run, as the fixture ran them: one table, x fp32 from the fp32 row."""
  command.main(["--merge", *map(str, run)])
  table = capsys.readouterr().out.splitlines()
  assert table[2].startswith(f"| {LINK} | 2 | tiny | fp32 | ") and "| 1.00 |" in table[2]
  assert table[3].startswith(f"| {LINK} | 2 | tiny | direct-fw2-bw4 | ") and table[3].split("|")[6].strip()  # x fp32


def test_a_recipe_runs_at_its_own_sizes_unless_a_flag_says():
  """The tiny recipe runs at the benchmark's sizes (`TINY_SIZES`), another recipe at its own: only the size flags
  given reach its processes."""
  unset = dict.fromkeys(processes.TINY_SIZES)
  sizes = lambda recipe, **given: processes.sizes_of(types.SimpleNamespace(recipe=recipe, **{**unset, **given}))
  assert sizes("tiny") == processes.TINY_SIZES
  assert sizes("tiny", batch_size=8) == {**processes.TINY_SIZES, "batch_size": 8}
  assert sizes("protocol-cpu") == {}
  assert sizes("protocol-cpu", train_examples=64, epochs=1) == {"train_examples": 64, "epochs": 1}


def test_an_unknown_recipe_is_named_with_the_choices():
  with pytest.raises(SystemExit) as exit_:
    command.main(["--recipe", "protocol-gpu", "--methods", "fp32"])
  assert str(exit_.value).startswith("error: --recipe: unknown recipe 'protocol-gpu'; choose from paper, tiny, "
                                     "protocol, protocol-cpu"), exit_.value


def test_netsim_counts_the_clipping_all_reduce_only_for_a_run_that_clips():
  from jaxcomp.parallel import schedules
  table = schedules.GPipe().train_table(2, 4)
  before_update = lambda clips: [c for c in accounting.step_collectives(table, 1, clips) if c.at == "before_update"]
  assert len(before_update(True)) == 1 and not before_update(False)


def test_netsim_swaps_the_tied_parameters_between_the_first_and_last_stage():
  """The tied exchange is one swap between stage 0 and the last stage, waiting for both (netsim's `Tied`), half of
  the counted bytes each way, two latencies; the data-parallel ring stays a separate `Exchange`."""
  from jaxcomp.analysis import netsim
  assert accounting.step_exchanges({"wire_bytes_fwd": 10}, 1.0, 4, 1) == (None, None)
  exchange, tied = accounting.step_exchanges({"wire_bytes_tied": 800}, 1.5, 4, 1)
  assert exchange is None and tied == netsim.Tied([(0, 3)], [600.0], messages=2)
  exchange, tied = accounting.step_exchanges({"wire_bytes_tied": 800, "wire_bytes_data": 1600}, 1.0, 2, 2)
  assert exchange == netsim.Exchange([400.0, 400.0], 2) and tied == netsim.Tied([(0, 1)], [200.0], messages=2)


def test_netsim_runs_the_overlapped_table_where_the_run_overlapped_its_sends():
  """A run with --overlap is timed on the schedule's overlapped table: 2 stages, 4 microbatches of 100 kB messages at
  100 Mbit/s and 5 ms each way, 10/20 ms forward/backward: crossing during the next tick's compute saves time."""
  times = [{"stage": s, "fwd": 0.01, "bwd": 0.02, "update": 0.001} for s in range(2)]
  record = {"mode": "train", "wire_bytes_fwd": 400_000, "wire_bytes_bwd": 400_000}
  config = {"stages": 2, "microbatches": 4, "data_parallel": 1, "schedule": "gpipe", "grad_clip": None}
  step = lambda **more: 1 / accounting.netsim_steps_per_s(times, record, 800_000, {**config, **more},
                                                         Link.parse("100mbit:5ms"))
  assert step(overlap=True) < 0.8 * step()
  with pytest.raises(SystemExit) as exit_:  # refused before any network or process: M=1 < 2S
    command.main(["--overlap", "--stages", "2", "--methods", "fp32"])
  assert str(exit_.value).startswith("error: overlapped sends (--overlap) need at least 2S microbatches")


def test_rate_is_the_older_name_of_link(capsys):
  """`--rate RATE` (the table measured before links had a latency) is parsed as `--link`."""
  with pytest.raises(SystemExit) as exit_:
    command.main(["--rate", "100mbit:20", "--methods", "fp32"])
  assert str(exit_.value).startswith("error: link latency '20': give the one-way latency of a message with its unit")


def test_check_link_sees_the_round_trip_and_the_rate(network, tmp_path):
  """`--check-link`: ping's round trip is twice the one-way latency (within 5 ms idle), a 262 KB message and its
  1-byte answer take the bytes at the rate and two latencies (3 ms sooner to 25 ms later), and each direction's TCP
  goodput, both at once with every core loaded, is at least 80% of what TCP carries at the rate."""
  out = tmp_path / "check.json"
  done = subprocess.run([sys.executable, "-m", "benchmarks.real_link", "--check-link", "--link", LINK, "--json",
                         str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout + done.stderr
  checked = json.loads(out.read_text())
  median = lambda values: sorted(values)[len(values) // 2]
  assert 0.040 <= median(checked["rtt_idle_s"]) <= 0.045, checked
  # a message takes its bytes at the rate (with headers) and a latency, its answer another (netsim's link); its
  # first 16 KB leave at once (the token bucket's burst, 1.3 ms at the rate), so it may land up to 3 ms sooner
  expected = 8 * checked["message_bytes"] * 1514 / 1448 / 100e6 + 2 * 0.020
  assert expected - 0.003 <= median(checked["message_trips_s"][2:]) <= expected + 0.025, checked
  assert all(bps >= 0.8 * 100e6 * 1448 / 1514 for bps in checked["goodput_bps"].values()), checked


def test_an_interrupted_benchmark_leaves_nothing_behind(network, tmp_path):
  proc = subprocess.Popen([sys.executable, "-m", "benchmarks.real_link", "--link", LINK, "--methods", "fp32", *TINY,
                           *NO_TIMING, "--keep", str(tmp_path / "kept")], cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
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
  delay_line = subprocess.run(["pgrep", "-f", f"real_link_delay{proc.pid}_"], capture_output=True, text=True).stdout
  assert not delay_line.split(), delay_line


def test_an_interrupted_run_keeps_the_rows_of_its_finished_methods(monkeypatch, tmp_path):
  """--json holds each finished method's rows as soon as it ends: a signal in the next method loses none of them (the
  network, the stage processes and their accounting stand-ins here)."""
  class Network:
    delay_report = ""
    __init__ = lambda self, processes, link: None
    __enter__ = lambda self: self
    __exit__ = lambda self, *exc: False

  def run_method(net, name, args, folder):
    if name != "fp32":
      raise KeyboardInterrupt("signal 15")
    return types.SimpleNamespace(name=name, wall_s=1.0)
  monkeypatch.setattr(command, "missing_prerequisites", lambda latency=False: None)
  monkeypatch.setattr(command.signal, "signal", lambda *a: None)
  monkeypatch.setattr(command, "Network", Network)
  monkeypatch.setattr(command, "run_method", run_method)
  monkeypatch.setattr(command, "Accounting", lambda run: None)
  monkeypatch.setattr(command, "rows_of", lambda run, acc, args: [
      {"method": run.name, "link": args.link, "stages": args.stages, "recipe": "tiny", "steps_per_s": 2.0}])
  out = tmp_path / "rows.json"
  with pytest.raises(KeyboardInterrupt):
    command.main(["--link", LINK, "--methods", "fp32,top10-q8-reuse", "--json", str(out), "--keep",
                    str(tmp_path / "kept")])
  assert json.loads(out.read_text())["rows"] == [
      {"method": "fp32", "link": LINK, "stages": 2, "recipe": "tiny", "steps_per_s": 2.0, "x_fp32": 1.0}]


def test_without_root_it_says_what_is_missing(monkeypatch, capsys):
  monkeypatch.setattr(shaped.os, "geteuid", lambda: 1000)
  with pytest.raises(SystemExit) as exit_:
    command.main(["--methods", "fp32"])
  assert str(exit_.value) == "error: the real-link benchmark needs root (network namespaces and tc need it): run as root"


def test_without_tc_it_says_what_is_missing(monkeypatch):
  monkeypatch.setattr(shaped.os, "geteuid", lambda: 0)
  monkeypatch.setattr(shaped.shutil, "which", lambda tool: None if tool == "tc" else f"/usr/bin/{tool}")
  assert shaped.missing_prerequisites() == "the command(s) tc (iproute2, util-linux, procps)"


def test_a_latency_needs_gcc_for_the_delay_line(monkeypatch):
  monkeypatch.setattr(shaped.os, "geteuid", lambda: 0)
  monkeypatch.setattr(shaped.shutil, "which", lambda tool: None if tool == "gcc" else f"/usr/bin/{tool}")
  assert shaped.missing_prerequisites() is None
  assert shaped.missing_prerequisites(latency=True) == "the command(s) gcc (iproute2, util-linux, procps, gcc)"


def test_a_probe_connects_to_a_server_that_listens_late():
  """`--check-link`'s clients connect to servers started in other processes a moment before; on a loaded machine
  a server listens seconds later (a refused connection once failed the check): the client tries again."""
  with socket.socket() as free:
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
  accepted = []

  def listen_late():
    time.sleep(0.5)
    with socket.create_server(("127.0.0.1", port)) as server:
      server.settimeout(10)
      conn, _ = server.accept()
      accepted.append(conn.recv(1))
      conn.close()
  thread = threading.Thread(target=listen_late)
  thread.start()
  with link_probe.connect("127.0.0.1", port, within_s=10) as sock:
    sock.sendall(b"x")
  thread.join(timeout=15)
  assert accepted == [b"x"]
