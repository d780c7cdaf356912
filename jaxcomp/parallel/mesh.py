"""The (data, stage) device mesh of the sharded executor and its axis names."""
import jax

STAGE, DATA = "stage", "data"
# the jax.named_scope of the tied-parameter exchange's collective-permutes (`analysis.hlo_bytes` counts them apart)
TIED = "tied_exchange"
# the jax.named_scope of the data-parallel exchange's dense all-reduce (`analysis.hlo_bytes` counts it as `data`)
DATA_EXCHANGE = "data_exchange"
# the jax.named_scope of the messages of a boundary whose ring wraps around (interleaved schedules: its
# activations go from the last stage device to device 0, its gradients back), which `analysis.hlo_bytes`
# counts with their directions reversed
WRAPPED = "wrapped_link"


def make_mesh(num_stages: int, data: int = 1, devices=None) -> jax.sharding.Mesh:
  """A (data, stage) mesh, topology-aware where the platform tells (`jax.make_mesh`):
  stage neighbours are physical neighbours; a clear error when there are too few devices."""
  devices = jax.devices() if devices is None else list(devices)
  if num_stages < 1 or data < 1:
    raise ValueError(f"mesh needs stages >= 1 and data >= 1, got stages={num_stages}, data={data}")
  if num_stages * data > len(devices):
    raise ValueError(f"a mesh of {data} data x {num_stages} stages needs {num_stages * data} devices, "
                     f"but only {len(devices)} are available (on CPU, XLA_FLAGS="
                     f"--xla_force_host_platform_device_count={num_stages * data} set before JAX starts gives that "
                     "many)")
  auto = (jax.sharding.AxisType.Auto,) * 2
  return jax.make_mesh((data, num_stages), (DATA, STAGE), axis_types=auto,
                       devices=devices[: num_stages * data])
