"""Matrix FLOPs counted on the jaxpr: loops by their trip counts, branches by the costliest."""
import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.models import resnet
from jaxcomp.analysis import flops

F32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)


def test_matmul_and_convolution_flops_match_xla_on_loop_free_programs():
  """dot_general exactly; a ResNet stage's forward and backward (strided convolutions, whose input
  gradient is an lhs-dilated convolution) within 10% of XLA's own count."""
  assert flops.of(lambda a, b: a @ b, F32(4, 8), F32(8, 16)).by_dtype == {"float32": 2 * 4 * 8 * 16}
  stage = resnet.resnet18_stages(resnet.ResNet18Config(width=8), 4)[1]
  x = jax.random.normal(jax.random.key(0), (4, 32, 32, 8))
  params, model_state = stage.init(jax.random.key(1), x)
  loss = lambda p, x: jnp.sum(stage.apply(p, model_state, x, train=False, rng=jax.random.key(2))[0] ** 2)
  grads = jax.grad(loss, argnums=(0, 1))
  xla = jax.jit(grads).lower(params, x).compile().cost_analysis()["flops"]
  ours = flops.of(grads, params, x)
  assert ours.exact and abs(ours.total - xla) <= 0.1 * xla, (ours.total, xla)


def test_loops_count_per_iteration_and_branches_count_the_costliest():
  step = lambda c, _: (c @ c, None)
  one = flops.of(lambda x: x @ x, F32(8, 8)).matmul
  assert flops.of(lambda x: jax.lax.scan(step, x, None, length=5)[0], F32(8, 8)).matmul == 5 * one
  switch = lambda i, x: jax.lax.switch(i, [lambda x: x, lambda x: x @ x @ x, lambda x: x @ x], x)
  assert flops.of(switch, jax.ShapeDtypeStruct((), jnp.int32), F32(8, 8)).matmul == 2 * one
  searched = flops.of(lambda x: jax.lax.while_loop(lambda x: x[0, 0] < 1, lambda x: x @ x, x), F32(8, 8))
  assert searched.matmul == one and not searched.exact  # a data-dependent trip count: a lower bound
  by_platform = lambda x: jax.lax.platform_dependent(x, cpu=lambda x: x @ x @ x, default=lambda x: x @ x)
  assert flops.of(by_platform, F32(8, 8), platform="cpu").matmul == 2 * one
  assert flops.of(by_platform, F32(8, 8), platform="tpu").matmul == one


def test_flops_are_split_by_operand_type_and_counted_per_device_inside_shard_map():
  mesh = jax.make_mesh((2,), ("s",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
  per_device = jax.shard_map(lambda a, b: a.astype(jnp.bfloat16) @ b.astype(jnp.bfloat16), mesh=mesh,
                             in_specs=(jax.P("s"), jax.P()), out_specs=jax.P("s"))
  counted = flops.of(per_device, F32(8, 16), F32(16, 4))
  assert counted.by_dtype == {"bfloat16": 2 * 4 * 16 * 4}  # 4 of the 8 rows on each device
  np.testing.assert_equal(counted.other, 0.0)
