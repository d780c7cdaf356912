"""HLO-text accounting: collectives and memory traffic, loops counted per iteration on every backend's text."""
import jax
import jax.numpy as jnp
import optax
import pytest

import jaxcomp
from jaxcomp.analysis import hlo_bytes
from jaxcomp.models.mlp import mlp_stages
from jaxcomp.parallel import simulate

# A TPU-style program (no known_trip_count annotation; async collective-permute; the loop counter's
# start copied into the loop tuple), written by hand: a 4-iteration loop whose body sends f32[8,128].
TPU_STYLE = """HloModule m

%cond (p: (s32[], f32[8,128])) -> pred[] {
  %p = (s32[]{:T(128)}, f32[8,128]{1,0:T(8,128)}) parameter(0)
  %n = s32[]{:T(128)} constant(4)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %n), direction=LT
}

%body (q: (s32[], f32[8,128])) -> (s32[], f32[8,128]) {
  %q = (s32[]{:T(128)}, f32[8,128]{1,0:T(8,128)}) parameter(0)
  %x = f32[8,128]{1,0:T(8,128)} get-tuple-element(%q), index=1
  %start = (f32[8,128]{1,0:T(8,128)}, f32[8,128]{1,0:T(8,128)}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%x), channel_id=1, source_target_pairs={{0,1},{2,3}}
  %done = f32[8,128]{1,0:T(8,128)} collective-permute-done(%start)
  %j = s32[]{:T(128)} get-tuple-element(%q), index=0
  %one = s32[]{:T(128)} constant(1)
  %k = s32[]{:T(128)} add(%j, %one)
  ROOT %t = (s32[]{:T(128)}, f32[8,128]{1,0:T(8,128)}) tuple(%k, %done)
}

%search_cond (r: (f32[8,128])) -> pred[] {
  %r = (f32[8,128]{1,0:T(8,128)}) parameter(0)
  %y = f32[8,128]{1,0:T(8,128)} get-tuple-element(%r), index=0
  %z = f32[]{:T(128)} constant(0)
  %s = f32[]{:T(128)} reduce(%y, %z), dimensions={0,1}, to_apply=%add
  ROOT %gt = pred[]{:T(512)} compare(%s, %z), direction=GT
}

%search_body (u: (f32[8,128])) -> (f32[8,128]) {
  %u = (f32[8,128]{1,0:T(8,128)}) parameter(0)
  %v = f32[8,128]{1,0:T(8,128)} get-tuple-element(%u), index=0
  %w = f32[8,128]{1,0:T(8,128)} negate(%v)
  ROOT %out = (f32[8,128]{1,0:T(8,128)}) tuple(%w)
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %c = f32[] add(%a, %b)
}

ENTRY %main (x0: f32[8,128]) -> f32[8,128] {
  %x0 = f32[8,128]{1,0:T(8,128)} parameter(0)
  %zero = s32[]{:T(128)} constant(0)
  %start0 = s32[]{:T(128)} copy(%zero)
  %init = (s32[]{:T(128)}, f32[8,128]{1,0:T(8,128)}) tuple(%start0, %x0)
  %loop = (s32[]{:T(128)}, f32[8,128]{1,0:T(8,128)}) while(%init), condition=%cond, body=%body
  %sent = f32[8,128]{1,0:T(8,128)} get-tuple-element(%loop), index=1
  %search_init = (f32[8,128]{1,0:T(8,128)}) tuple(%sent)
  %search = (f32[8,128]{1,0:T(8,128)}) while(%search_init), condition=%search_cond, body=%search_body
  ROOT %result = f32[8,128]{1,0:T(8,128)} get-tuple-element(%search), index=0
}
"""


def test_trip_count_from_the_loop_condition_and_async_collectives():
  """No known_trip_count: 4 iterations read from `i < 4` with i starting at (a copy of) 0; each
  async collective-permute counted once per pair and iteration; the data-dependent search loop
  holds no collective, so it is allowed."""
  sent = hlo_bytes.collective_bytes(TPU_STYLE)
  assert sent == {"fwd": 4 * 2 * 8 * 128 * 4, "bwd": 0, "data": 0}


def test_a_collective_in_a_loop_of_unknown_trip_count_is_refused():
  text = TPU_STYLE.replace("constant(4)", "parameter(1)")  # the bound is no longer a constant
  with pytest.raises(ValueError, match="collective-permute inside a loop without a known trip count"):
    hlo_bytes.collective_bytes(text)


def test_memory_traffic_counts_loop_bodies_per_iteration_and_skips_other_memory_spaces():
  tile, scalar, pred = 8 * 128 * 4, 4, 1
  # per iteration: the collective-permute-start's operand and result, the counter's add, the condition's
  # compare; once: the entry's copy of the counter, the search loop's negate, reduce (+ init) and compare
  per_iteration = 2 * tile + 3 * scalar + (2 * scalar + pred)
  once = 2 * scalar + 2 * tile + (tile + 2 * scalar) + (2 * scalar + pred)
  assert hlo_bytes.memory_bytes(TPU_STYLE) == 4 * per_iteration + once
  assert hlo_bytes.device_memory_bytes("f32[20,100]{1,0:T(8,128)}") == 24 * 128 * 4
  assert hlo_bytes.device_memory_bytes("f32[20,100]{1,0}") == 20 * 100 * 4
  assert hlo_bytes.device_memory_bytes("f32[256,512]{1,0:T(8,128)S(1)}") == 0  # VMEM: not HBM traffic


def test_a_combined_collective_permute_moves_every_operand():
  """XLA:GPU combines a payload's arrays into one collective-permute-start of a tuple of operands."""
  text = """HloModule m

ENTRY %main (a: u32[32], b: u8[128]) -> (u32[32], u8[128]) {
  %a = u32[32]{0} parameter(0)
  %b = u8[128]{0} parameter(1)
  %s = ((u32[32]{0}, u8[128]{0}), (u32[32]{0}, u8[128]{0})) collective-permute-start(%a, %b), channel_id=1, source_target_pairs={{0,1}}
  ROOT %d = (u32[32]{0}, u8[128]{0}) collective-permute-done(%s)
}
"""
  assert hlo_bytes.collective_bytes(text) == {"fwd": 32 * 4 + 128, "bwd": 0, "data": 0}
  assert hlo_bytes.memory_bytes(text) == 2 * (32 * 4 + 128)  # reads both operands, writes both results
  all_reduce = """HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %r = f32[8]{0} all-reduce-start(%p), replica_groups={}, to_apply=%add
  ROOT %d = f32[8]{0} all-reduce-done(%r)
}
"""
  assert hlo_bytes.memory_bytes(all_reduce) == 2 * 8 * 4  # XLA:GPU's all-reduce-start is no tuple


@pytest.mark.parametrize("groups", ["{{0,1,2,3},{4,5,6,7}}", "[2,4]<=[8]", "mesh['data'=2,'stage'=4] {'stage'}"])
def test_an_all_gathers_groups_read_the_same_in_every_spelling(groups):
  """XLA spells replica groups as a list, an iota, or (libtpu 0.0.50 on) named mesh axes: 2 groups of 4 each way,
  each member's f32[8] to the 3 others."""
  text = f"""HloModule m

ENTRY %main (p: f32[8]) -> f32[32] {{
  %p = f32[8]{{0}} parameter(0)
  ROOT %g = f32[32]{{0}} all-gather(%p), replica_groups={groups}, dimensions={{0}}
}}
"""
  assert hlo_bytes.collective_bytes(text) == {"fwd": 0, "bwd": 0, "data": 2 * 4 * 3 * 8 * 4}


def test_a_wrapped_links_permutes_count_the_other_way():
  """Under `mesh.WRAPPED` (a ring's last device to device 0) a permute to a lower device is an activation."""
  text = """HloModule m

ENTRY %main (a: f32[8], g: f32[4]) -> (f32[8], f32[4]) {
  %a = f32[8]{0} parameter(0)
  %g = f32[4]{0} parameter(1)
  %f = f32[8]{0} collective-permute(%a), channel_id=1, source_target_pairs={{1,0}}, metadata={op_name="jit(step)/wrapped_link/ppermute"}
  %b = f32[4]{0} collective-permute(%g), channel_id=2, source_target_pairs={{0,1}}, metadata={op_name="jit(step)/wrapped_link/ppermute"}
  %c = f32[4]{0} collective-permute(%g), channel_id=3, source_target_pairs={{0,1}}, metadata={op_name="jit(step)/ppermute"}
  ROOT %t = (f32[8]{0}, f32[4]{0}) tuple(%f, %b)
}
"""
  assert hlo_bytes.collective_bytes(text) == {"fwd": 8 * 4 + 4 * 4, "bwd": 4 * 4, "data": 0}


def test_an_async_slice_reads_its_slice_not_the_whole_operand():
  """XLA:TPU's slice-start: (operand, slice in VMEM, context); only the slice leaves HBM."""
  text = """HloModule m

ENTRY %main (p: f32[1024,8]) -> f32[256,8] {
  %p = f32[1024,8]{0,1:T(8,128)} parameter(0)
  %s = ((f32[1024,8]{0,1:T(8,128)}), f32[256,8]{0,1:T(8,128)S(1)}, s32[]{:S(2)}) slice-start(%p), slice={[0:256], [0:8]}
  ROOT %d = f32[256,8]{0,1:T(8,128)S(1)} slice-done(%s)
}
"""
  assert hlo_bytes.memory_bytes(text) == 256 * 8 * 4  # read of the slice; the VMEM result is no HBM traffic


def test_an_async_copy_moves_its_source_once_and_a_buffer_allocation_nothing():
  """XLA:TPU's copy-start: (destination, source, context). A prefetch into VMEM reads its HBM source once; an
  eviction to HBM writes its destination once; AllocateBuffer reserves memory its writers fill."""
  text = """HloModule m

ENTRY %main (p: f32[1024,128]) -> f32[1024,128] {
  %p = f32[1024,128]{1,0:T(8,128)} parameter(0)
  %in = (f32[1024,128]{1,0:T(8,128)S(1)}, f32[1024,128]{1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%p)
  %v = f32[1024,128]{1,0:T(8,128)S(1)} copy-done(%in)
  %buf = f32[1024,128]{1,0:T(8,128)} custom-call(), custom_call_target="AllocateBuffer"
  %out = (f32[1024,128]{1,0:T(8,128)}, f32[1024,128]{1,0:T(8,128)S(1)}, u32[]{:S(2)}) copy-start(%v)
  ROOT %d = f32[1024,128]{1,0:T(8,128)} copy-done(%out)
}
"""
  assert hlo_bytes.memory_bytes(text) == 2 * 1024 * 128 * 4  # the prefetch's read and the eviction's write


def test_memory_traffic_is_xlas_bytes_accessed_on_a_loop_free_cpu_program():
  x = jax.random.normal(jax.random.key(0), (16, 8))
  batch = {"x": x, "label": (x[:, 0] > 0).astype(jnp.int32)}
  pipe = jaxcomp.Pipeline(mlp_stages(32, 2, 3), jaxcomp.parse_boundary("quant:4", "quant:8"),
                          jaxcomp.losses.classification, "x", microbatches=2)
  state = simulate.init_state(pipe, optax.adam(1e-3), jax.random.key(1), batch)
  compiled = simulate.make_train_step(pipe, optax.adam(1e-3)).lower(state, batch).compile()
  assert "while" not in compiled.as_text().split("ENTRY")[1]
  xla = compiled.cost_analysis()["bytes accessed"]
  assert abs(hlo_bytes.memory_bytes(compiled.as_text()) - xla) <= 0.01 * xla


def test_loop_traffic_grows_with_the_trip_count():
  def traffic(n):
    f = jax.jit(lambda x: jax.lax.fori_loop(0, n, lambda i, x: jnp.tanh(x @ x), x))
    return hlo_bytes.memory_bytes(f.lower(jnp.ones((16, 16))).compile().as_text())
  two, three, four = traffic(2), traffic(3), traffic(4)
  assert three - two == four - three > 0


def test_a_scanned_layer_reads_its_slice_of_the_stacked_weights_not_the_stack():
  """A scan over stacked layer weights [n, d, d] dynamic-slices one layer per iteration: the traffic of
  an iteration is a few layers' bytes whatever n (XLA's fusion-boundary rule would count the whole stack)."""
  def per_iteration(n):
    f = jax.jit(lambda x, w: jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, w)[0])
    args = jax.ShapeDtypeStruct((16, 128), jnp.float32), jax.ShapeDtypeStruct((n, 128, 128), jnp.float32)
    return hlo_bytes.memory_bytes(f.lower(*args).compile().as_text()) / n
  layer = 128 * 128 * 4
  assert per_iteration(16) < 4 * layer and abs(per_iteration(16) - per_iteration(4)) < 0.05 * per_iteration(4)
