"""`jaxcomp.ppermute` against `lax.ppermute`: time per call and bytes sent, on fake CPU devices.

`python -m benchmarks.ppermute [--shape 8,1024,768] [--devices 2,4] [--rounds 7]`
Every device of a ring sends its activation (fp32, `--shape`: GPT-2 small's [8, 1024, 768] by default) to
the next one. "fwd": the call alone; "fwd+bwd": `jax.vjp` through it, the cotangent sent back too. Bytes:
per call over all devices, read from the compiled program's collective-permutes (`hlo_bytes`) beside
S x `wire_bytes`. Every program is compiled first, then all are timed in interleaved rounds; `none / none`
compiles to the same program as `lax.ppermute`, so its ratio is the run's noise floor. On CPU the S devices
share the host's cores and a collective-permute is a memory copy: the times show the codecs' work against
a copy, not against a network.
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jaxcomp
from benchmarks.common import interleaved_medians, use_fake_cpu_devices
from jaxcomp.analysis import hlo_bytes

PAIRS = (("none", "none"), ("bf16", "bf16"), ("maxabs:8", "maxabs:8"), ("maxabs:4", "maxabs:8"),
         ("topk:0.1", "reuse"))


def programs(send, mesh):
  """(forward, forward + backward) of `send` over the ring of `mesh`'s devices, jitted."""
  n = mesh.devices.size
  ring = [(i, (i + 1) % n) for i in range(n)]
  spec = jax.P("i")
  call = lambda x: send(x, "i", ring)
  both = lambda x, g: (lambda y, vjp: (y, vjp(g)[0]))(*jax.vjp(call, x))
  return (jax.jit(jax.shard_map(call, mesh=mesh, in_specs=spec, out_specs=spec)),
          jax.jit(jax.shard_map(both, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec))))


def measure(devices: int, shape, rounds: int):
  """Rows (name, fwd s, fwd+bwd s, compiled bytes fwd, fwd+bwd, counted fwd, fwd+bwd) for `devices` devices:
  every program compiled first, then timed in interleaved rounds (`common.interleaved_medians`)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("i",))
  sharding = jax.sharding.NamedSharding(mesh, jax.P("i"))
  x = jax.device_put(jax.random.normal(jax.random.key(0), (devices * shape[0], *shape[1:])), sharding)
  g = jax.device_put(jax.random.normal(jax.random.key(1), x.shape), sharding)
  sends = {"lax.ppermute": jax.lax.ppermute}
  sends.update({f"{fwd} / {bwd}": lambda x, a, p, fwd=fwd, bwd=bwd: jaxcomp.ppermute(x, a, p, fwd, bwd)
                for fwd, bwd in PAIRS})
  runs, sent, counted = {}, {}, {}
  for name, send in sends.items():
    forward, both = (p.lower(*args).compile() for p, args in zip(programs(send, mesh), ((x,), (x, g))))
    runs[(name, "fwd")], runs[(name, "both")] = (lambda p=forward: p(x)), (lambda p=both: p(x, g))
    sent[name] = [sum(hlo_bytes.collective_bytes(p.as_text()).values()) for p in (forward, both)]
    wire = (4 * int(np.prod(shape)),) * 2 if name == "lax.ppermute" else \
        jaxcomp.compressed_link(*name.split(" / ")).wire_bytes(shape, jnp.float32)
    counted[name] = [devices * wire[0], devices * sum(wire)]
  times = interleaved_medians(runs, rounds)
  return [(name, times[(name, "fwd")], times[(name, "both")], *sent[name], *counted[name]) for name in sends]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", default="8,1024,768", help="one device's activation (GPT-2 small: 8,1024,768)")
  parser.add_argument("--devices", default="2,4", help="ring sizes, comma-separated")
  parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
  args = parser.parse_args(argv)
  shape = tuple(int(s) for s in args.shape.split(","))
  sizes = [int(s) for s in args.devices.split(",")]
  if max(sizes) > jax.device_count():
    raise SystemExit(f"error: --devices {args.devices} needs {max(sizes)} devices, found {jax.device_count()}; "
                     f"set XLA_FLAGS=--xla_force_host_platform_device_count={max(sizes)}")
  print(f"device: {jax.devices()[0].device_kind}; per device fp32 {list(shape)} = "
        f"{4 * np.prod(shape) / 2**20:.1f} MiB; a ring, every device sends one message\n")
  print("| S | fwd / bwd | fwd ms | / lax | fwd+bwd ms | / lax | bytes fwd | bytes fwd+bwd | / lax | compiled = S x wire_bytes |")
  print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
  for devices in sizes:
    rows = measure(devices, shape, args.rounds)
    _, base_fwd, base_both, _, base_bytes, _, _ = rows[0]
    for name, fwd, both, sent_fwd, sent_both, counted_fwd, counted_both in rows:
      same = "yes" if (sent_fwd, sent_both) == (counted_fwd, counted_both) else f"**no** ({counted_fwd:,}, {counted_both:,})"
      print(f"| {devices} | `{name}` | {fwd * 1e3:.1f} | {fwd / base_fwd:.2f} | {both * 1e3:.1f} | {both / base_both:.2f} "
            f"| {sent_fwd:,} | {sent_both:,} | {sent_both / base_bytes:.3f} | {same} |")


if __name__ == "__main__":
  use_fake_cpu_devices(4)  # rings of up to 4 devices, on a machine without accelerators
  main()
