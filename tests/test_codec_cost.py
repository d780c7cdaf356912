"""A codec's compiled cost on a target (`analysis.codec_cost`): logical bytes, traffic, sorts of the row."""
import jax.numpy as jnp
import pytest

from jaxcomp.analysis import codec_cost, targets
from jaxcomp.compress import codecs, spec

GPT2_SMALL = (8, 1024, 768)  # the papers' boundary activation: 8 examples x 1,024 tokens x 768 features


def test_sorts_reads_the_sorted_axis_of_each_sort():
  hlo = ("%sort.2 = (f32[8,786432]{1,0}, s32[8,786432]{1,0}) sort(%abs.2, %iota.15), dimensions={1}, to_apply=%cmp\n"
         "%sort.9 = s32[8,128]{1,0} sort(%bits), dimensions={1}, is_stable=true, to_apply=%lt\n")
  assert codec_cost.sorts(hlo) == [786432, 128]


def test_a_cast_moves_its_logical_bytes_and_sorts_nothing():
  """bf16 of fp32 on v5e: the input read once, half of it written: one pass, no sort."""
  v5e = targets.target("v5e-1")
  encode, decode = codec_cost.codec_costs(v5e, spec.parse_codec("bf16"), (4, 128, 256), jnp.float32)
  assert encode.logical_bytes == 4 * 128 * 256 * (4 + 2) and decode.logical_bytes == encode.logical_bytes
  assert encode.passes == pytest.approx(1.0) and encode.sorts == encode.row_sorts == 0
  assert encode.roofline_s == pytest.approx(encode.traffic_bytes / v5e.chip.hbm_bytes_per_s)


def test_the_threshold_topk_fits_v5e_at_gpt2_smalls_paper_step_and_sorts_no_row():
  """TopK 10% of GPT-2 small's boundary activation compiled for TPU v5e: the threshold selection compiles (it once
  ran out of VMEM there, from a strided slice of the long row), sorts no row (only its 4,096-entry sample, its
  4,096 candidates and, in some libtpu versions' scatter, their indices), and encode and decode each move the
  activation about once, in its own layout (1.8 and 1.5 passes: with each example flattened to one row of 786,432,
  a copy of it relaid out, they took 3.7 and 4.8; gathers along the whole row, in a transposed layout, once ~100)."""
  v5e = targets.target("v5e-1")
  devices = targets.compile_only_devices(v5e)
  encode, decode = codec_cost.codec_costs(v5e, codecs.TopK(0.1, select="threshold", values="q8"), GPT2_SMALL,
                                          jnp.float32, devices=devices)
  assert encode.row_sorts == 0 and encode.sorts <= 3  # the scatter's index sort: libtpu 0.0.42 has it, newer not
  assert encode.passes < 2.5 and decode.passes < 2
  assert encode.peak_bytes < v5e.chip.hbm_bytes


def test_the_threshold_topk_sorts_no_row_on_v6e():
  """On v6e XLA:TPU runs a scatter on the SparseCore after sorting its indices unless told they are sorted: the
  stream compaction's scatter (`packing.compact`, whose indices never decrease) says so, and the threshold
  selection's encode then holds no sort of the row (two when it did not)."""
  v6e = targets.target("v6e-1")
  encode, _ = codec_cost.codec_costs(v6e, spec.parse_codec("topk:0.1:q8:threshold"), (2, 256, 512), jnp.float32)
  assert encode.row_sorts == 0


def test_the_default_topk_sorts_no_row_on_gpu():
  """On H100 the default selection is the threshold: its compiled encode has no sort of the row, lax.top_k's has one
  (skipped without the CUDA plugin, which the test extra does not bring)."""
  pytest.importorskip("jax_plugins.xla_cuda12", reason="the CUDA PJRT plugin is not installed "
                      "(pip install jax-cuda12-pjrt==<jax version> and a ptxas)")
  h100 = targets.target("h100")
  devices = targets.compile_only_devices(h100)
  default, sort = (codec_cost.codec_costs(h100, spec.parse_codec(s), GPT2_SMALL, jnp.float32, devices=devices)[0]
                   for s in ("topk:0.1:q8", "topk:0.1:q8:sort"))
  assert default.row_sorts == 0 and sort.row_sorts == 1


def test_the_clip_search_of_the_3_bit_default_reads_its_input_once_per_grid_not_once_per_ratio_on_tpu():
  """maxabs:3 (grid=auto, clip=mse: 25 ratios x 2 grids) grouped by 64 on v5e: every ratio's error in one fused
  read per grid, about 10 passes over the message in all (34 when each ratio was its own pass); on CPU the search
  stays ratio by ratio, the faster there."""
  v5e = targets.target("v5e-1")
  encode, _ = codec_cost.codec_costs(v5e, spec.parse_codec("maxabs:3:group=64"), (4, 128, 256), jnp.float32)
  assert encode.passes < 15
