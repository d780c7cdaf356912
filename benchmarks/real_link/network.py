"""The shaped network: a namespace per stage process behind a router namespace, htb per peer, a delay line for
latency, the class counters that say how many bytes crossed, and a check of the link it builds."""
import contextlib
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

from jaxcomp.analysis.link import Link, parse_rate

SUBNET = "10.77.0"


ROUTER_ADDRESS = f"{SUBNET}.254"  # the router's end of every stage's veth pair


INTERFACE = "veth0"


DELAY_DEVICE = "delay0"  # the router's TUN device, behind which the delay line holds packets


DELAY_TABLE = "77"  # the router's routing table that sends what arrives from a stage into the delay line


UNSHAPED_RATE = "100gbit"


CLASS_SENT = re.compile(r"class htb 1:(\d+) .*?\n\s*Sent (\d+) bytes")


# Each stage namespace is tuned as a WAN cluster's hosts are (ESnet's host tuning for long fat links): socket
# buffers well above the bandwidth-delay product (100 Mbit/s x 100 ms RTT = 1.25 MB), gloo's own SO_SNDBUF
# (up to 32 MB) not capped below it, no return to slow start after an idle connection (a pipeline's links idle
# between messages), and a loss-based congestion control, reno (the kernel's default, cubic, is not among those a
# namespace may pick here; bbr, the other, paced a 262 KB message 30-35 ms longer than its bytes at 100 ms RTT).
TCP_SETTINGS = {"net.core.rmem_max": "67108864", "net.core.wmem_max": "67108864",
                "net.ipv4.tcp_rmem": "4096 131072 67108864", "net.ipv4.tcp_wmem": "4096 65536 67108864",
                "net.ipv4.tcp_slow_start_after_idle": "0", "net.ipv4.tcp_congestion_control": "reno"}


DELAY_LINE_SOURCE = pathlib.Path(__file__).parent / "delay_line.c"


def address(i: int) -> str:
  return f"{SUBNET}.{i + 1}"


def missing_prerequisites(latency: bool = False) -> str | None:
  """What this machine lacks to build the network, with a delay line when `latency` (None: nothing)."""
  if os.geteuid() != 0:
    return "root (network namespaces and tc need it): run as root"
  tools = [t for t in ("ip", "tc", "unshare", "taskset", "sysctl", *(("gcc",) if latency else ()))
           if shutil.which(t) is None]
  if tools:
    return f"the command(s) {', '.join(tools)} (iproute2, util-linux, procps{', gcc' if latency else ''})"
  if latency and not os.path.exists("/dev/net/tun"):
    return "/dev/net/tun (the TUN driver) for the delay line"
  return None


def _run(*cmd):
  done = subprocess.run(cmd, capture_output=True, text=True)
  if done.returncode:
    raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.stdout.strip()}")
  return done.stdout


class Network(contextlib.AbstractContextManager):
  """`processes` network namespaces behind a router namespace, each process's egress shaped per peer at the
  link's rate, and, with a latency, a delay line in the router holding every packet for it.

  Stage i has address 10.77.0.i+1/32 on its end of a veth pair and reaches the others through the router
  (10.77.0.254 on every router port). With a latency the router sends every packet that arrives from a stage
  into a TUN device (policy routing: table DELAY_TABLE for each port), where the delay line (`delay_line.c`,
  compiled with gcc into a temporary folder) writes it back `latency_s` later, and the router forwards it to
  its stage: each packet crosses the delay line once, so each direction of each pair has the one-way latency
  on top of its htb rate. The stage namespaces take `TCP_SETTINGS`. A context manager: on exit (also after an
  error or a signal) the delay line is stopped (its report kept in `delay_report`) and every namespace it made
  is deleted, which removes its interfaces and qdiscs with it."""

  def __init__(self, processes: int, link: Link):
    self.processes, self.link = processes, link
    self.prefix = f"jaxcomp-rl{os.getpid()}"
    self.router = f"{self.prefix}-router"
    self.made: list[str] = []
    self.delay_line: subprocess.Popen | None = None
    self.delay_report = ""
    self.folder = None

  def namespace(self, i: int) -> str:
    return f"{self.prefix}-{i}"

  def __enter__(self):
    try:
      self._build()
    except BaseException:
      self.close()
      raise
    return self

  def __exit__(self, *exc):
    self.close()

  def _add_namespace(self, name, settings: dict):
    _run("ip", "netns", "add", name)
    self.made.append(name)
    _run("ip", "-n", name, "link", "set", "lo", "up")
    for key, value in settings.items():
      _run("ip", "netns", "exec", name, "sysctl", "-q", "-w", f"{key}={value}")

  def _build(self):
    self._add_namespace(self.router, {"net.ipv4.ip_forward": "1", "net.ipv4.conf.all.rp_filter": "0",
                                      "net.ipv4.conf.default.rp_filter": "0"})
    rate = UNSHAPED_RATE if math.isinf(self.link.bandwidth_bps) else self.link.rate
    burst = max(16 * 1024, int(min(parse_rate(rate), 1e10) / 8 / 1000))  # >= 1 ms at the rate
    router = ("ip", "-n", self.router)
    for i in range(self.processes):
      ns, port = self.namespace(i), f"p{i}"
      self._add_namespace(ns, TCP_SETTINGS)
      _run("ip", "link", "add", INTERFACE, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.router)
      _run(*router, "addr", "add", f"{ROUTER_ADDRESS}/32", "dev", port)
      _run(*router, "link", "set", port, "up")
      _run(*router, "route", "add", f"{address(i)}/32", "dev", port)
      _run("ip", "-n", ns, "addr", "add", f"{address(i)}/32", "dev", INTERFACE)
      _run("ip", "-n", ns, "link", "set", INTERFACE, "up")
      _run("ip", "-n", ns, "route", "add", f"{ROUTER_ADDRESS}/32", "dev", INTERFACE)
      _run("ip", "-n", ns, "route", "add", f"{SUBNET}.0/24", "via", ROUTER_ADDRESS, "dev", INTERFACE)
      tc = ("tc", "-n", ns)
      _run(*tc, "qdisc", "add", "dev", INTERFACE, "root", "handle", "1:", "htb", "default", "999")
      _run(*tc, "class", "add", "dev", INTERFACE, "parent", "1:", "classid", "1:999", "htb", "rate", UNSHAPED_RATE,
           "quantum", "1514")
      for j in range(self.processes):
        if j != i:
          _run(*tc, "class", "add", "dev", INTERFACE, "parent", "1:", "classid", f"1:{j + 1}", "htb", "rate", rate,
               "ceil", rate, "burst", str(burst), "cburst", str(burst), "quantum", "1514")
          _run(*tc, "filter", "add", "dev", INTERFACE, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match",
               "ip", "dst", f"{address(j)}/32", "flowid", f"1:{j + 1}")
    if self.link.latency_s:
      self._start_delay_line()
      _run(*router, "link", "set", DELAY_DEVICE, "up", "txqueuelen", "10000")
      _run(*router, "route", "add", "default", "dev", DELAY_DEVICE, "table", DELAY_TABLE)
      for i in range(self.processes):
        _run(*router, "rule", "add", "iif", f"p{i}", "lookup", DELAY_TABLE, "pref", "100")

  def _start_delay_line(self):
    self.folder = pathlib.Path(tempfile.mkdtemp(prefix=f"real_link_delay{os.getpid()}_"))
    program = self.folder / "delay_line"
    _run("gcc", "-O2", "-o", str(program), str(DELAY_LINE_SOURCE))
    self.report_file = open(self.folder / "report.txt", "w")
    self.delay_line = subprocess.Popen(
        ["ip", "netns", "exec", self.router, str(program), DELAY_DEVICE, str(round(self.link.latency_s * 1e6))],
        stdout=subprocess.PIPE, stderr=self.report_file, text=True, start_new_session=True)
    if self.delay_line.stdout.readline().strip() != "ready":
      self.delay_line.wait(timeout=10)
      raise RuntimeError(f"the delay line did not start: {(self.folder / 'report.txt').read_text().strip()}")

  def sent(self) -> dict[tuple[int, int], int]:
    """{(i, j): bytes process i has sent to process j} from the htb class counters."""
    out = {}
    for i in range(self.processes):
      for j, sent in class_bytes(("tc", "-n", self.namespace(i))).items():
        out[i, j] = sent
    return out

  def close(self):
    if self.delay_line is not None:
      if self.delay_line.poll() is None:
        self.delay_line.terminate()
        try:
          self.delay_line.wait(timeout=10)
        except subprocess.TimeoutExpired:
          self.delay_line.kill()
          self.delay_line.wait()
      self.report_file.close()
      self.delay_report = (self.folder / "report.txt").read_text().strip()
      self.delay_line = None
    if self.folder is not None:
      shutil.rmtree(self.folder, ignore_errors=True)
      self.folder = None
    for name in reversed(self.made):
      subprocess.run(["ip", "netns", "del", name], capture_output=True)
    self.made = []


def class_bytes(tc=("tc",)) -> dict[int, int]:
  """{peer j: bytes sent to it} of this namespace's htb classes (class 1:j+1), from `tc -s class show`."""
  text = _run(*tc, "-s", "class", "show", "dev", INTERFACE)
  return {int(c) - 1: int(n) for c, n in CLASS_SENT.findall(text) if c != "999"}


def render_check(link: Link, checked: dict, delay_report: str) -> str:
  """`check_link`'s figures as lines: round trips (median, min, max ms) and goodput each way (Mbit/s, and its share of
  the most TCP can carry at the rate: 1448 payload bytes per 1514-byte frame)."""
  rtt_of = lambda trips: " / ".join(f"{1e3 * v:.2f}" for v in (sorted(trips)[len(trips) // 2], min(trips), max(trips)))
  rtt = lambda key: rtt_of(checked[key])
  most = link.bandwidth_bps * 1448 / 1514
  goodput = ", ".join(f"{way} {bps / 1e6:.1f} Mbit/s ({bps / most:.1%})" for way, bps in checked["goodput_bps"].items())
  goodput += "" if math.isfinite(most) else " (unshaped)"
  expected = 8 * checked["message_bytes"] * 1514 / 1448 / link.bandwidth_bps + 2 * link.latency_s
  lines = [f"link {link}: ping round trip, ms (median / min / max): idle {rtt('rtt_idle_s')}, every core loaded "
           f"{rtt('rtt_loaded_s')} (2 x {link.latency_s * 1e3:g} ms expected)",
           f"a {checked['message_bytes']:,}-byte message and a 1-byte answer, each after 0.5 s idle, ms (median / min "
           f"/ max of the last {len(checked['message_trips_s']) - 2}): {rtt_of(checked['message_trips_s'][2:])} "
           f"({1e3 * expected:.1f} expected: the bytes at the rate, with headers, and 2 latencies)",
           f"TCP goodput, both ways at once, every core loaded: {goodput} of the most TCP carries at the rate"]
  return "\n".join(lines + ([delay_report] if delay_report else []))


def check_link(net: Network, seconds: float = 5.0, pings: int = 20, message_bytes: int = 262_144,
               count: int = 12) -> dict:
  """What the link between stages 0 and 1 does: round trips (ICMP echo, idle, then while two busy processes load
  every core), `count` messages of `message_bytes` (a tiny GPT-2 activation at batch 8), each after 0.5 s idle and
  answered with a byte, and the TCP goodput of each direction with both directions sending at once under load."""
  in_ns = lambda i, *args: ["ip", "netns", "exec", net.namespace(i), sys.executable, "-m", "benchmarks.link_probe",
                            *args]
  env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[1])}
  result = lambda cmd: json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, env=env,
                                                 timeout=120).stdout)
  out = {"rtt_idle_s": result(in_ns(0, "ping", address(1), str(pings)))}
  server = subprocess.Popen(in_ns(1, "server", address(1), "5202", str(message_bytes), str(count)), env=env,
                            stdout=subprocess.DEVNULL)
  out["message_bytes"], out["message_trips_s"] = message_bytes, result(
      in_ns(0, "client", address(1), "5202", str(message_bytes), str(count)))
  server.wait(timeout=60)
  cores = sorted(os.sched_getaffinity(0))
  load = [subprocess.Popen(["taskset", "-c", str(c), sys.executable, "-c", "while True: pass"]) for c in cores]
  try:
    out["rtt_loaded_s"] = result(in_ns(0, "ping", address(1), str(pings)))
    sinks = [subprocess.Popen(in_ns(j, "sink", address(j), "5201", "0"), stdout=subprocess.PIPE, text=True, env=env)
             for j in (1, 0)]
    sources = [subprocess.Popen(in_ns(i, "source", address(j), "5201", str(seconds)), env=env,
                                stdout=subprocess.DEVNULL) for i, j in ((0, 1), (1, 0))]
    for p in sources:
      p.wait(timeout=seconds + 60)
    received = [json.loads(p.communicate(timeout=60)[0]) for p in sinks]
    out["goodput_bps"] = {"0->1": 8 * received[0]["bytes"] / received[0]["seconds"],
                          "1->0": 8 * received[1]["bytes"] / received[1]["seconds"]}
  finally:
    for p in load:
      p.kill()
      p.wait()
  return out

