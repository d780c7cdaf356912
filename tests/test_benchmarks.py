"""Every benchmark runs end to end at toy sizes and prints its table (its figures are not asserted; the error
bounds of quantizer_error are checked against brute force)."""
import argparse
import itertools
import json
import re

import numpy as np
import pytest

from benchmarks import (
  accelerator_fit,
  aqsgd_buffers,
  codec_throughput,
  ppermute,
  quantizer_error,
  step_overhead,
  throughput_vs_bandwidth,
  topk_selection,
  wire_bytes,
)
from jaxcomp.analysis import netsim, step_cost, step_inputs
from jaxcomp.analysis.link import Link
from jaxcomp.compress import spec


@pytest.mark.parametrize("module, argv, expect", [
    (codec_throughput, ["--shape", "2,16,32", "--repeats", "2"], "| `maxabs:3` |"),
    pytest.param(topk_selection, ["--shape", "2,2048", "--repeats", "2"], "| 1% | sampled threshold |",
                 marks=pytest.mark.slow),
    (wire_bytes, ["--skip-pipeline", "--shape", "4,64"], "| `efmixed+topk:0.1` |"),
    pytest.param(step_overhead, ["--seq", "8", "--batch", "4", "--microbatches", "1", "--repeats", "1", "--presets", "EF21 Top10%"],
     "| EF21 Top10% |", marks=pytest.mark.slow),
    pytest.param(aqsgd_buffers, ["--examples", "8", "--batch", "4", "--seq", "8"], "| host + prefetch |",
                 marks=pytest.mark.slow),
    (quantizer_error, ["--relu-shape", "4,2,2,8", "--gauss-shape", "2,4,8", "--bits", "2"], "| authors (SPEC) |"),
    (ppermute, ["--shape", "2,16,32", "--devices", "2", "--rounds", "1"], "| 2 | `topk:0.1 / reuse` |"),
])
def test_benchmark_prints_its_table(module, argv, expect, capsys):
  module.main(argv)
  assert expect in capsys.readouterr().out


def test_throughput_table_rows_and_label(capsys):
  throughput_vs_bandwidth.main(["--seq", "8", "--batch", "4", "--repeats", "1", "--schedule", "1f1b",
                                "--methods", "aqsgd-fw3-bw6"])
  out = capsys.readouterr().out
  assert "Training throughput, samples/s (measured on cpu; netsim, 1f1b, tied exchange dense)" in out
  table = out[out.index("| link | method | samples/s | x fp32 |"):].splitlines()[2:]
  cells = [[c.strip() for c in line.split("|")[1:-1]] for line in table]
  methods = ["fp32", "fp32 + QuantizedAdam", "aqsgd-fw3-bw6", "aqsgd-fw3-bw6 + QuantizedAdam"]
  bandwidths = ["10 Gbps, 1 ms", "1 Gbps, 1 ms", "500 Mbps, 1 ms", "300 Mbps, 1 ms", "100 Mbps, 1 ms"]
  assert [c[:2] for c in cells] == [[b, m] for b in bandwidths for m in methods]
  assert all(float(c[2]) > 0 for c in cells) and {c[3] for c in cells if c[1] == "fp32"} == {"1.00"}
  assert all(abs(sum(map(int, c[4].split(" / "))) - 100) <= 2 for c in cells)  # critical path shares, rounded
  assert cells[-2][5] == "3.4 (up to 4.3x end-to-end)"  # the paper's figure, labelled as such in the header


def test_throughput_links_are_rate_and_latency(capsys):
  """--link names each link (rate:latency); --latency-ms, the older flag, sets the default links' latency and is
  refused beside --link; a bad link is one error line naming it."""
  parser = argparse.ArgumentParser()
  links = lambda link, latency_ms: throughput_vs_bandwidth.links_of(parser, argparse.Namespace(link=link,
                                                                                                latency_ms=latency_ms))
  assert links("1gbit:20ms, 100mbit:50ms", None) == [Link(1e9, 0.02), Link(1e8, 0.05)]
  assert links(None, 20.0) == [Link(bw, 0.02) for bw in netsim.DEFAULT_BANDWIDTHS_BPS]
  assert links(None, None)[-1] == Link(100e6, 1e-3)
  with pytest.raises(SystemExit):
    links("100mbit:20ms", 5.0)
  assert "give each link's latency in --link (e.g. 100mbit:5ms)" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    throughput_vs_bandwidth.main(["--link", "100mbit:20"])
  assert "--link: link latency '20': give the one-way latency of a message with its unit" in capsys.readouterr().err


def test_throughput_counts_each_choice_of_the_tied_exchange(capsys):
  """--tied-exchange dense,untied,SCHEME: a table each; the tied embedding's gradient crosses between devices 0 and 3
  (257 x 64 fp32 each way; compressed, its payload), and on a slow link costs fp32 samples/s that untied does not."""
  throughput_vs_bandwidth.main(["--seq", "8", "--batch", "4", "--repeats", "1", "--data-parallel", "1",
                                "--methods", "fp32", "--tied-exchange", "dense,untied,ef+topk:0.1"])
  out = capsys.readouterr().out
  assert "Tied exchange dense: devices 0 <-> 3, 65,792 B each way per replica" in out
  assert "Tied exchange untied: nothing sent (the head trains on its own)" in out
  assert re.search(r"Tied exchange ef\+topk:0.1: devices 0 <-> 3, 8,636 B each way per replica, codec [\d.]+ ms", out)
  rates, shares = {}, {}
  for choice in ("dense", "untied", "ef+topk:0.1"):
    table = out[out.index(f"tied exchange {choice}):"):].split("\n\n")[1].splitlines()[2:]
    cells = {c[0]: c for c in ([x.strip() for x in line.split("|")[1:-1]] for line in table)}
    rates[choice] = float(cells["100 Mbps, 1 ms"][2])
    shares[choice] = int(cells["100 Mbps, 1 ms"][4].split(" / ")[3])  # the tied exchange's share of the critical path
  assert rates["untied"] > rates["dense"] and rates["untied"] >= rates["ef+topk:0.1"]
  assert shares["untied"] == 0 < shares["dense"]


def test_throughput_from_a_compiled_target_is_labelled_an_estimate(capsys):
  """--compile-for: stage and codec times are the roofline of their programs compiled for the target's chip."""
  throughput_vs_bandwidth.main(["--compile-for", "v5e-8", "--seq", "8", "--batch", "4", "--methods", "aqsgd-fw3-bw6"])
  out = capsys.readouterr().out
  label = "estimated for TPU v5e from programs compiled for v5e-8 (roofline, not run)"
  assert f"Stage and codec times ({label})" in out and f"Training throughput, samples/s ({label}; netsim, gpipe, " \
      "tied exchange dense)" in out
  stage_ms = re.search(r"stage forward: \[(.*)\] stage backward: \[(.*)\]", out)
  assert all(float(t) > 0 for part in stage_ms.groups() for t in part.split(","))
  with pytest.raises(SystemExit):
    throughput_vs_bandwidth.main(["--compile-for", "v5e-1", "--stages", "2"])  # 2 x 2 chips on a 1-chip target
  assert "--stages 2 x --data-parallel 2 needs 4 chips; v5e-1 has 1" in capsys.readouterr().err


def test_codec_work_goes_to_the_stage_that_does_it():
  costs = step_cost.StageCosts("test", fwd_s=(1, 2, 3), bwd_s=(10, 20, 30),
                                             encode_s=((0.1, 0.2), (0.3, 0.4)), decode_s=((0.01, 0.02), (0.03, 0.04)))
  fwd, bwd = step_cost.op_seconds(costs)
  # stage s encodes boundary s's forward message and decodes boundary s-1's; backwards the other way round
  assert fwd == pytest.approx([1 + 0.1, 2 + 0.01 + 0.3, 3 + 0.03])
  assert bwd == pytest.approx([10 + 0.02, 20 + 0.2 + 0.04, 30 + 0.4])


def test_throughput_schedules_with_and_without_overlap():
  """--schedule LIST --overlap both: each table without overlapped sends and, where one exists (M >= 2S), with
  (forwarding delay 2); where none does it is left out with the reason; --overlap on there is an error."""
  built, left_out = throughput_vs_bandwidth.tables("gpipe, zb-h1,interleaved:2", "both", 4, 8)
  assert [(t.name, t.forwarding_delay) for t in built] == [(name, delay) for name in ("gpipe", "zb-h1", "interleaved:2")
                                                           for delay in (1, 2)] and left_out == []
  built, left_out = throughput_vs_bandwidth.tables("1f1b,zb-h1", "both", 4, 4)
  assert [(t.name, t.forwarding_delay) for t in built] == [("1f1b", 1), ("zb-h1", 1)]
  assert [line.split(":")[0] for line in left_out] == ["1f1b", "zb-h1"]
  assert [t.forwarding_delay for t in throughput_vs_bandwidth.tables("zb-h1", "on", 4, 8)[0]] == [2]
  with pytest.raises(ValueError, match="need at least 2S microbatches"):
    throughput_vs_bandwidth.tables("zb-h1", "on", 4, 4)


def test_interleaved_chunks_cut_the_stage_times():
  """interleaved:V: each stage's compute cut into V chunks of 1/V; every chunk boundary with boundary 0's codec
  times and bytes; V = 1 leaves the costs as they are."""
  costs = step_cost.StageCosts("test", fwd_s=(2.0, 4.0), bwd_s=(6.0, 8.0), encode_s=((0.1, 0.2),),
                                             decode_s=((0.3, 0.4),))
  chunked, messages = step_inputs.on_chunks(costs, [(10, 20)], 2)
  assert chunked.fwd_s == (1.0, 1.0, 2.0, 2.0) and chunked.bwd_s == (3.0, 3.0, 4.0, 4.0)
  assert chunked.encode_s == ((0.1, 0.2),) * 3 and chunked.decode_s == ((0.3, 0.4),) * 3 and messages == [(10, 20)] * 3
  assert step_inputs.on_chunks(costs, [(10, 20)], 1) == (costs, [(10, 20)])
  rows = {"gpipe": [throughput_vs_bandwidth.Row(Link(1e9, 0.02), m, rate, {})
                    for m, rate in (("fp32", 2.0), ("q", 5.0))]}
  assert (throughput_vs_bandwidth.render_schedules(rows).splitlines()[2]
          == "| gpipe | 1 Gbps, 20 ms | 2.00 | 5.00 (2.50x) |")


def test_data_parallel_exchange_per_stage_device():
  """Every stage device exchanges the executor's row (each stage's parameters padded to the longest stage's)."""
  dense = step_inputs.exchange(None, 1000, 2, 4)
  assert dense == netsim.Exchange([2 * 3 / 4 * 4000] * 2, 6)  # ring all-reduce of the fp32 row
  q4 = spec.parse_scheme("ef+quant:4")
  compressed = step_inputs.exchange(q4, 1000, 1, 4)
  assert compressed == netsim.Exchange([3 * q4.wire_bytes((1, 1000), "float32")], 3)  # all-gather to 3 others
  chunked = step_inputs.exchange(q4, 1000, 1, 4, chunks=2)  # interleaved:2: two rows, one ring each
  assert chunked == netsim.Exchange([2 * 3 * q4.wire_bytes((1, 1000), "float32")], 6)
  assert step_inputs.exchange(None, 1000, 3, 1) == netsim.Exchange([0] * 3, 0)


def test_fit_table_renders_the_cached_cells_and_marks_the_rest(tmp_path, capsys):
  cache = tmp_path / "fit.json"
  cache.write_text(json.dumps({
      "small|baseline|v5e-1": {"status": "fits", "peak_gib": 4.9, "hbm_gib": 16.0, "est_ms": 125.4, "bound": "memory"},
      "small|baseline|v5e-8 gpipe 4x2": {"status": "does not fit", "peak_gib": 25.5, "hbm_gib": 16.0,
                                         "est_ms": 80.0, "bound": "compute", "hlo_equal": True}}))
  accelerator_fit.main(["--models", "small", "--methods", "baseline,top10-reuse", "--columns",
                        "v5e-1,v5e-8 gpipe 4x2", "--cache", str(cache), "--table-only"])
  rows = capsys.readouterr().out.splitlines()
  assert rows[-2] == "| small | baseline | fits 4.9/16 GiB, ~125 ms (m) | **no** 25.5/16 GiB, ~80 ms (c), HLO bytes = |"
  assert rows[-1] == "| small | top10-reuse | - | - |"  # not compiled: nothing ran


def test_fit_table_stops_a_compile_past_the_host_memory_limit_and_goes_on(tmp_path, capsys):
  cache = tmp_path / "fit.json"
  accelerator_fit.main(["--models", "small", "--methods", "baseline", "--columns", "v5e-1", "--cache", str(cache),
                        "--host-limit-gb", "0.02"])  # the child passes 20 MB while importing jax
  assert capsys.readouterr().out.splitlines()[-1] == (
      "| small | baseline | not compiled (compile passed 0.02 GB of host RAM) |")
  assert json.loads(cache.read_text())["small|baseline|v5e-1"]["status"] == "host memory"


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_quantizer_error_outlier_tensors_and_recorded_activations(tmp_path, capsys):
  np.savez(tmp_path / "rec.npz", fwd_0=np.random.default_rng(0).normal(size=(2, 4, 16)).astype(np.float32))
  quantizer_error.main(["--relu-shape", "4,2,2,8", "--gauss-shape", "2,4,16", "--bits", "2", "--group", "8",
                        "--recorded", str(tmp_path / "rec.npz")])
  out = capsys.readouterr().out
  for title in ("N(0,1), 4 features x 50", "N(0,1), 4 features x 50, 1000 at token 0 in two of them", "rec.npz: fwd_0"):
    assert f"**{title}" in out
  assert out.count("| grouped / per channel (`maxabs:B:group=8` / `maxabs:B`) | ") == 4
  assert "| `maxabs:B:group=8:grid=auto:clip=mse` | " in out
  assert out.count("| `maxabs:B:group=8:stoch`, mean of each channel's relative MSE | ") == 4
  assert out.count("| `channel+hadamard+maxabs:B:group=8`, mean of each channel's relative MSE | ") == 4


def test_quantizer_error_lower_bounds_per_group():
  """The free-levels bound is exact 1-D k-means (brute force over every split of 8 sorted values into 4
  runs, each decoded to its mean) and lies below the best uniform grid, which lies below a midrise grid at r = 1."""
  x = np.random.default_rng(0).normal(size=(3, 2, 16)).astype(np.float32)
  rows = np.sort(x.astype(np.float64).reshape(-1, 8), 1)
  brute = sum(min(sum(((part - part.mean()) ** 2).sum() for part in np.split(row, cuts))
                  for cuts in itertools.combinations(range(1, 8), 3)) for row in rows)
  free = quantizer_error.free_levels_error(x, 2, 8)
  np.testing.assert_allclose(free, brute / (rows ** 2).sum(), rtol=1e-9)
  uniform = quantizer_error.best_uniform_error(x, 2, 8)
  s = np.abs(rows).max(1, keepdims=True)
  midrise = (2 * np.clip(np.floor(rows / s * 1.5), -2, 1) + 1) * s / 3
  assert free < uniform <= ((midrise - rows) ** 2).sum() / (rows ** 2).sum()


def test_quantizer_error_channel_average_weighs_every_channel_the_same():
  """Zeroing a small channel beside a channel 50x larger: 1/2 averaged over channels, 1/2501 pooled."""
  x = np.stack([np.full(6, 50.0), np.ones(6)], -1).reshape(2, 3, 2)
  x_hat = x * np.array([1.0, 0.0])
  assert quantizer_error.channel_error(x, x_hat) == 0.5
  assert quantizer_error.errors(x, x_hat)[0] == 1 / 2501
