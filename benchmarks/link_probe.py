"""The probes of `python -m benchmarks.real_link --check-link`, each run as its own process inside a stage's network
namespace (`python -m benchmarks.link_probe KIND ARGS...`): ICMP round trips, messages answered with a byte, and
bulk TCP goodput. The standard library only: a probe starts in a fraction of a second, without JAX."""
import json
import os
import socket
import struct
import sys
import time


def icmp_checksum(data: bytes) -> int:
  """The internet checksum (RFC 1071) of `data`."""
  data += b"\0" * (len(data) % 2)
  total = sum(int.from_bytes(data[i: i + 2], "big") for i in range(0, len(data), 2))
  while total >> 16:
    total = (total & 0xFFFF) + (total >> 16)
  return ~total & 0xFFFF


def ping(target: str, count: int, interval_s: float = 0.1) -> list[float]:
  """Round trips in seconds of `count` ICMP echo requests to `target` (a raw socket: root), as `ping` sends them."""
  ident, trips = os.getpid() & 0xFFFF, []
  with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as sock:
    sock.settimeout(5.0)
    for seq in range(count):
      header = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
      payload = b"jaxcomp real_link" * 3
      packet = struct.pack("!BBHHH", 8, 0, icmp_checksum(header + payload), ident, seq) + payload
      sent = time.perf_counter()
      sock.sendto(packet, (target, 0))
      while True:
        reply = sock.recv(2048)
        kind, _, _, their_ident, their_seq = struct.unpack("!BBHHH", reply[20:28])
        if kind == 0 and (their_ident, their_seq) == (ident, seq):
          break
      trips.append(time.perf_counter() - sent)
      time.sleep(interval_s)
  return trips


def connect(peer: str, port: int, within_s: float = 30.0) -> socket.socket:
  """A TCP connection to `peer`:`port`, tried again while refused (its server, another process, may not listen yet:
  on a loaded machine its start takes seconds) until `within_s` have passed."""
  deadline = time.monotonic() + within_s
  while True:
    try:
      return socket.create_connection((peer, port), timeout=30)
    except ConnectionRefusedError:
      if time.monotonic() > deadline:
        raise
      time.sleep(0.05)


def bulk(role: str, peer: str, port: int, seconds: float) -> dict:
  """One TCP transfer for `seconds`: `source` sends to `peer`:`port`, `sink` (on `peer`, its own address) receives
  and returns {"bytes", "seconds"} between its first and last byte."""
  if role == "source":
    with connect(peer, port) as sock:
      block, end = b"\0" * (1 << 20), time.monotonic() + seconds
      while time.monotonic() < end:
        sock.sendall(block)
    return {}
  with socket.create_server((peer, port)) as server:
    server.settimeout(30)
    conn, _ = server.accept()
    with conn:
      received, first = 0, None
      while chunk := conn.recv(1 << 20):
        first = first or time.perf_counter()
        received += len(chunk)
      return {"bytes": received, "seconds": time.perf_counter() - first}


def messages(role: str, peer: str, port: int, nbytes: int, count: int, idle_s: float = 0.5) -> list[float]:
  """`count` messages of `nbytes` on one TCP connection, each after `idle_s` of idling, each answered with one
  byte: `client` sends to `peer`:`port` and returns each round trip in seconds (the bytes at the rate plus two
  latencies, with windows above the bandwidth-delay product); `server` (on `peer`) answers."""
  if role == "client":
    trips = []
    with connect(peer, port) as sock:
      for _ in range(count):
        time.sleep(idle_s)
        sent = time.perf_counter()
        sock.sendall(b"\0" * nbytes)
        sock.recv(1)
        trips.append(time.perf_counter() - sent)
    return trips
  with socket.create_server((peer, port)) as server:
    server.settimeout(30)
    conn, _ = server.accept()
    with conn:
      for _ in range(count):
        got = 0
        while got < nbytes:
          got += len(conn.recv(1 << 20))
        conn.sendall(b"\1")
  return []


def main(argv=None):
  """`ping TARGET COUNT`, `sink|source ADDRESS PORT SECONDS` or `server|client ADDRESS PORT BYTES COUNT`, run inside
  a stage namespace: its result as JSON on stdout."""
  argv = sys.argv[1:] if argv is None else argv
  if argv[0] == "ping":
    print(json.dumps(ping(argv[1], int(argv[2]))))
  elif argv[0] in ("server", "client"):
    print(json.dumps(messages(argv[0], argv[1], int(argv[2]), int(argv[3]), int(argv[4]))))
  else:
    print(json.dumps(bulk(argv[0], argv[1], int(argv[2]), float(argv[3]))))


if __name__ == "__main__":
  main()
