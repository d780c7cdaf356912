"""Multi-process runs on JAX's distributed runtime: start it, place global arrays, feed batches.

Every process (one per host, or per GPU) runs the same program. After `initialize`,
`jax.devices()` lists the devices of all processes, so a (data, stage) mesh spans hosts;
each process transfers only the parts of an array that live on its own devices. On CPU,
cross-process collectives go through gloo (`jax_cpu_collectives_implementation`).
"""
import os

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# Environments where jax.distributed.initialize() finds coordinator, process count and id itself.
CLUSTER_ENVIRONMENTS = {
    "SLURM": lambda env: int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env,
    "Open MPI": lambda env: int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1,
    "Cloud TPU pod": lambda env: "," in env.get("TPU_WORKER_HOSTNAMES", ""),
}


def detected_cluster(env=None) -> str | None:
  """The multi-process cluster this process runs in (see CLUSTER_ENVIRONMENTS), or None."""
  env = os.environ if env is None else env
  return next((name for name, present in CLUSTER_ENVIRONMENTS.items() if present(env)), None)


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, env=None) -> int:
  """Starts jax.distributed; returns the number of processes.

  With `coordinator` ("HOST:PORT" of process 0), `num_processes` and `process_id` all given,
  they are used; with none given, a detected cluster (SLURM, Open MPI, Cloud TPU pod) lets JAX
  find them, and otherwise the run is a single process. Call before any other JAX work.
  """
  given = {"--coordinator": coordinator, "--num-processes": num_processes, "--process-id": process_id}
  if all(v is None for v in given.values()):
    if detected_cluster(env) is None:
      return 1
    jax.distributed.initialize()
    return jax.process_count()
  missing = [flag for flag, v in given.items() if v is None]
  if missing:
    raise ValueError(f"a multi-process run needs --coordinator HOST:PORT, --num-processes N and --process-id I "
                     f"together; missing {', '.join(missing)}")
  host, _, port = coordinator.rpartition(":")
  if not host or not port.isdigit():
    raise ValueError(f"--coordinator must be HOST:PORT (process 0's address), got {coordinator!r}")
  if num_processes < 1 or not 0 <= process_id < num_processes:
    raise ValueError(f"--process-id must be in 0..{num_processes - 1} for --num-processes {num_processes}, "
                     f"got {process_id}")
  jax.distributed.initialize(coordinator, num_processes, process_id)
  return num_processes


def is_main_process() -> bool:
  """True on process 0, the one that writes results and reports."""
  return jax.process_index() == 0


def main_process_value(value: int) -> int:
  """Process 0's `value` (an int) on every process.

  Decisions that read the file system (does a checkpoint folder exist yet?) must be taken
  once: another process may create the folder between two processes' reads, and processes
  that then take different branches issue different collectives (gloo aborts with "Received
  data size doesn't match expected size"). A collective itself: every process calls it.
  """
  if jax.process_count() == 1:
    return value
  return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def put_global(tree, shardings):
  """Arrays with the same values on every process -> global arrays with `shardings`.

  Each process copies only the slices its own devices hold (jax.device_put cannot place
  host data on another process's devices). Typed PRNG keys stay typed.
  """
  def put(x, sharding):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return jax.random.wrap_key_data(put(jax.random.key_data(x), sharding), impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
  return jax.tree.map(put, tree, shardings)


def global_batch(batch: dict, mesh: jax.sharding.Mesh, axis: str = "data") -> dict:
  """A global batch (numpy, the same on every process) split over `axis` of `mesh`; each
  process transfers only its own data shards' rows."""
  sharding = NamedSharding(mesh, P(axis))
  return put_global(batch, {k: sharding for k in batch})
