"""The overlap reader (`analysis.overlap`): compute scheduled between a collective-permute's start and its done,
read from scheduled HLO text (hand-written here; compiled for TPU in test_dryrun, for CPU below)."""
import jax
import jax.numpy as jnp
from jax import P
from jax.sharding import NamedSharding

from jaxcomp.analysis import overlap
from jaxcomp.parallel.mesh import TIED

SCHEDULED = """HloModule step, is_scheduled=true

%fused_tanh (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %t = f32[4]{0} tanh(%p)
}

%holds_dot (a: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  ROOT %d = f32[4,4]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (c: (s32[], f32[4], f32[4,4])) -> (s32[], f32[4], f32[4,4]) {
  %c = (s32[], f32[4]{0}, f32[4,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %x = f32[4]{0} get-tuple-element(%c), index=1
  %w = f32[4,4]{1,0} get-tuple-element(%c), index=2
  %early = (f32[4]{0}, f32[4]{0}, u32[], u32[]) collective-permute-start(%x), channel_id=1, source_target_pairs={{0,1}}, metadata={op_name="jit(step)/shard_map/while/body/ppermute"}
  %late = (f32[4]{0}, f32[4]{0}, u32[], u32[]) collective-permute-start(%x), channel_id=2, source_target_pairs={{1,0}}, metadata={op_name="jit(step)/shard_map/while/body/ppermute"}
  %late.done = f32[4]{0} collective-permute-done(%late)
  %f = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_tanh
  %called = f32[4,4]{1,0} call(%w), to_apply=%holds_dot
  %early.done = f32[4]{0} collective-permute-done(%early)
  %copied = f32[4]{0} copy(%early.done)
  ROOT %out = (s32[], f32[4]{0}, f32[4,4]{1,0}) tuple(%i, %copied, %called)
}

ENTRY %main (x: f32[4], w: f32[4,4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %w = f32[4,4]{1,0} parameter(1)
  %fill = (f32[4]{0}, f32[4]{0}, u32[], u32[]) collective-permute-start(%x), channel_id=3, source_target_pairs={{0,1}}, metadata={op_name="jit(step)/shard_map/ppermute"}
  %bitcast = f32[4]{0} bitcast(%x)
  %fill.done = f32[4]{0} collective-permute-done(%fill)
  %tied = (f32[4]{0}, f32[4]{0}, u32[], u32[]) collective-permute-start(%x), channel_id=4, source_target_pairs={{0,1}}, metadata={op_name="jit(step)/shard_map/TIED_SCOPE/ppermute"}
  %g = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_tanh
  %tied.done = f32[4]{0} collective-permute-done(%tied)
  %sync = f32[4]{0} collective-permute(%g), channel_id=5, source_target_pairs={{0,1}}, metadata={op_name="jit(step)/shard_map/ppermute"}
  ROOT %r = f32[4]{0} add(%sync, %fill.done)
}
""".replace("TIED_SCOPE", TIED)


def test_compute_between_each_start_and_its_own_done_is_counted():
  """`early` is in flight across a fusion and a call holding a dot (2, one a matrix multiply); `late`, started after it and done at once,
  across nothing (0: not the 2 ops before `early`'s done); the fill tick's permute across a bitcast only (0); a
  synchronous permute overlaps nothing."""
  found = {p.name: p for p in overlap.permutes(SCHEDULED)}
  assert {n: p.compute_between for n, p in found.items()} == {"early": 2, "late": 0, "fill": 0, "tied": 1, "sync": 0}
  assert {n: p.matmuls_between for n, p in found.items()} == {"early": 1, "late": 0, "fill": 0, "tied": 0, "sync": 0}
  assert {n for n, p in found.items() if p.in_loop} == {"early", "late"}
  assert {n for n, p in found.items() if p.tied} == {"tied"}


def test_the_summary_counts_boundary_permutes_in_the_tick_loop_and_the_unrolled_ticks_apart():
  summary = overlap.overlap(SCHEDULED)
  assert summary == overlap.Overlap(loop_overlapped=1, loop_matmul=1, loop=2, unrolled_overlapped=0, unrolled_matmul=0, unrolled=2)
  assert summary.text().startswith("overlap: 1 of 2 boundary permutes have compute between start and done")


def test_cpu_collectives_block_so_nothing_overlaps():
  """XLA:CPU emits a synchronous collective-permute: the reader says 0 of 1 on the compiled CPU program."""
  mesh = jax.make_mesh((4,), ("s",), devices=jax.devices("cpu")[:4])
  step = jax.jit(jax.shard_map(lambda x: jnp.tanh(jax.lax.ppermute(x, "s", [(i, i + 1) for i in range(3)]) @ x.T) @ x,
                               mesh=mesh, in_specs=P("s"), out_specs=P("s")))
  x = jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=NamedSharding(mesh, P("s")))
  assert overlap.overlap(step.trace(x).lower().compile().as_text()) == overlap.Overlap(0, 0, 0, 0, 0, 1)
