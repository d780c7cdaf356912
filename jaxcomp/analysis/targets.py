"""Accelerators a program can be compiled for without one: their published figures and compile-only devices.

A `Target` is what users rent (`v5e-8`: 8 TPU v5e chips; `h100`: one H100 GPU). Its devices are
compile-only: XLA compiles for them on any host (TPU through `libtpu`, GPU through the CUDA
PJRT plugin), nothing runs. Chip figures are the vendors' published ones (`Chip.source`): HBM
capacity and bandwidth, and the dense matrix-unit peak per operand type; a float32 matmul runs
at the platform's default precision (TPU: bf16 passes; GPU from Ampere on: TF32).

TPU devices need `libtpu` (`pip install -U "jax[tpu]"`, or the test extra). GPU devices need
the CUDA PJRT plugin of the installed jax (`pip install jax-cuda12-pjrt==<jax version>`), and
`ptxas` (a CUDA toolkit, or `pip install nvidia-cuda-nvcc-cu12`); the process must not have
initialised a GPU backend. `prepare_host` sets this process up for a target (libtpu's environment, or
`jax_platforms=cpu`): call it before any JAX backend starts, then `compile_only_devices`, which touches no
process state.
"""
import os
import re
from typing import NamedTuple

import jax

GiB = 1 << 30


class Chip(NamedTuple):
  name: str
  hbm_bytes: int
  hbm_bytes_per_s: float
  peak_flops: dict  # operand dtype name -> dense FLOP/s of the matrix units
  source: str
  gpu: dict | None = None  # CUDA device properties for the compile-only GPU target config


class Target(NamedTuple):
  name: str  # "v5e-8", "h100"
  chip: Chip
  platform: str  # "tpu" | "cuda"
  topology: str  # libtpu topology ("v5e:2x4") or CUDA "partitions x hosts x devices" ("1x1x8")
  devices: int

  def describe(self) -> str:
    c = self.chip
    peak = ", ".join(f"{k} {v / 1e12:g} TFLOP/s" for k, v in c.peak_flops.items())
    return (f"{self.name}: {self.devices} x {c.name} ({c.hbm_bytes / GiB:g} GiB HBM at {c.hbm_bytes_per_s / 1e9:g} GB/s; "
            f"{peak}; {c.source})")


_TPU_DOCS = "cloud.google.com/tpu/docs/{}"
V5E = Chip("TPU v5e", 16 * GiB, 819e9, {"bfloat16": 197e12, "float32": 197e12}, _TPU_DOCS.format("v5e"))
V6E = Chip("TPU v6e", 32 * GiB, 1638e9, {"bfloat16": 918e12, "float32": 918e12}, _TPU_DOCS.format("v6e"))
V5P = Chip("TPU v5p", 95 * GiB, 2765e9, {"bfloat16": 459e12, "float32": 459e12}, _TPU_DOCS.format("v5p"))


def _cuda(cc, sms, fp32_per_sm, threads_per_sm, smem_per_sm, smem_optin, l2, clock_ghz, description):
  return dict(cc=cc, sms=sms, fp32_per_sm=fp32_per_sm, threads_per_sm=threads_per_sm, smem_per_sm=smem_per_sm,
              smem_optin=smem_optin, l2=l2, clock_ghz=clock_ghz, description=description)


_NVIDIA = "NVIDIA {} datasheet (dense Tensor Core rates, without sparsity)"
A100 = Chip("A100 80GB SXM", 80 * GiB, 2039e9, {"bfloat16": 312e12, "float32": 156e12}, _NVIDIA.format("A100"),
            _cuda((8, 0), 108, 64, 2048, 167936, 166912, 40 << 20, 1.41, "NVIDIA A100-SXM4-80GB"))
H100 = Chip("H100 80GB SXM", 80 * GiB, 3350e9, {"bfloat16": 989e12, "float32": 494e12}, _NVIDIA.format("H100"),
            _cuda((9, 0), 132, 128, 2048, 233472, 232448, 50 << 20, 1.98, "NVIDIA H100 80GB HBM3"))
H200 = Chip("H200 141GB SXM", 141 * 10**9, 4800e9, {"bfloat16": 989e12, "float32": 494e12}, _NVIDIA.format("H200"),
            _cuda((9, 0), 132, 128, 2048, 233472, 232448, 50 << 20, 1.98, "NVIDIA H200"))
L4 = Chip("L4 24GB", 24 * GiB, 300e9, {"bfloat16": 121e12, "float32": 60e12}, _NVIDIA.format("L4"),
          _cuda((8, 9), 58, 128, 1536, 102400, 101376, 48 << 20, 2.04, "NVIDIA L4"))


def _tpu(name, chip, topology, devices):
  return Target(name, chip, "tpu", topology, devices)


def _gpu(name, chip, devices):
  return Target(name, chip, "cuda", f"1x1x{devices}", devices)


TARGETS = {t.name: t for t in (
    _tpu("v5e-1", V5E, "v5e:1x1", 1), _tpu("v5e-4", V5E, "v5e:2x2", 4), _tpu("v5e-8", V5E, "v5e:2x4", 8),
    _tpu("v6e-1", V6E, "v6e:1x1", 1), _tpu("v6e-8", V6E, "v6e:2x4", 8), _tpu("v5p-8", V5P, "v5p:2x2x1", 4),
    _gpu("a100", A100, 1), _gpu("a100-8", A100, 8), _gpu("h100", H100, 1), _gpu("h100-8", H100, 8),
    _gpu("h200", H200, 1), _gpu("l4", L4, 1),
)}


def target(name: str) -> Target:
  """The target called `name`; a ValueError lists the valid names."""
  if name not in TARGETS:
    raise ValueError(f"unknown target {name!r}; choose one of {', '.join(TARGETS)}")
  return TARGETS[name]


_DEVICE_KINDS = (  # (pattern of `device.device_kind`, one-chip target whose published figures are that chip's)
    (r"nvidia h100 80gb hbm3|nvidia h100 sxm", "h100"), (r"nvidia h200\b", "h200"),
    (r"nvidia a100-sxm4-80gb", "a100"), (r"nvidia l4$", "l4"), (r"tpu v5 lite", "v5e-1"), (r"tpu v6 lite", "v6e-1"))


def for_device_kind(kind: str) -> Target | None:
  """The one-chip target whose chip a real device is (`device.device_kind`, e.g. "NVIDIA H100 80GB HBM3" ->
  h100); None for a kind whose figures differ from every target's (a CPU, an H100 PCIe, a GH200, an L40S)."""
  for pattern, name in _DEVICE_KINDS:
    if re.match(pattern, kind.strip().lower()):
      return TARGETS[name]
  return None


def gpu_target_config(chip: Chip) -> str:
  """The CUDA plugin's target description (a GpuTargetConfigProto in text form) from the chip's figures."""
  g = chip.gpu
  return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {g["smem_per_sm"]}
  threads_per_core_limit: {g["threads_per_sm"]}
  core_count: {g["sms"]}
  fpus_per_core: {g["fp32_per_sm"]}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(chip.hbm_bytes_per_s)}
  l2_cache_size: {g["l2"]}
  clock_rate_ghz: {g["clock_ghz"]}
  device_memory_size: {chip.hbm_bytes}
  shared_memory_per_block_optin: {g["smem_optin"]}
  cuda_compute_capability {{
    major: {g["cc"][0]}
    minor: {g["cc"][1]}
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 8
}}
runtime_version {{
  major: 12
  minor: 8
}}
device_description_str: "{g["description"]}"
"""


_TPU_HOST_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def prepare_host(t: Target):
  """Sets up this process to compile for `t` (call before any JAX backend starts; later is harmless).
  TPU: libtpu is told it runs on no TPU VM (no metadata server, no lock file shared with other
  processes, no warnings; values already set win). GPU: JAX's platforms are limited to the CPU, the
  condition under which the CUDA plugin offers compile-only devices."""
  if t.platform == "tpu":
    cloud_name = t.name.replace("v5e-", "v5litepod-")  # what a TPU VM's metadata would call it
    for key, value in {**_TPU_HOST_ENV, "TPU_ACCELERATOR_TYPE": cloud_name}.items():
      os.environ.setdefault(key, value)
    return
  try:
    jax.config.update("jax_platforms", "cpu")
  except RuntimeError:  # backends are up already (e.g. on a GPU machine, where the plugin is registered)
    pass


def compile_only_devices(t: Target) -> list:
  """The target's devices, for `jit(...).lower(...).compile()` only (nothing can run on them); the process
  set up for them first (`prepare_host`).

  A missing compiler plugin is a RuntimeError that says what to install."""
  from jax.experimental import topologies
  if t.platform == "tpu":
    kwargs = {"chips_per_host_bounds": (1, 1, 1)} if t.devices == 1 else {}
    try:
      return list(topologies.get_topology_desc(platform="tpu", topology_name=t.topology, **kwargs).devices)
    except RuntimeError as err:
      raise RuntimeError(f"compiling for {t.name} needs libtpu: pip install -U \"jax[tpu]\" ({err})") from None
  try:
    topo = topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(t.chip), topology=t.topology)
  except NotImplementedError:
    raise RuntimeError(f"compiling for {t.name} needs the CUDA PJRT plugin of jax {jax.__version__} "
                       f"(pip install jax-cuda12-pjrt=={jax.__version__}), and no GPU backend started in this "
                       "process (set JAX_PLATFORMS=cpu)") from None
  return list(topo.devices)
