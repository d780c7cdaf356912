"""Every benchmark runs end to end at toy sizes and prints its table (numbers are not asserted)."""
import pytest

from benchmarks import (aqsgd_buffers, codec_throughput, quantizer_error, step_overhead, throughput_vs_bandwidth,
                        topk_selection, wire_bytes)


@pytest.mark.parametrize("module, argv, expect", [
    (codec_throughput, ["--shape", "2,16,32", "--repeats", "2"], "| `maxabs:3` |"),
    (topk_selection, ["--shape", "2,2048", "--repeats", "2"], "| 1% | sampled threshold |"),
    (wire_bytes, ["--skip-pipeline", "--shape", "4,64"], "| `efmixed+topk:0.1` |"),
    (step_overhead, ["--seq", "8", "--batch", "4", "--repeats", "1", "--presets", "EF21 Top10%"], "| EF21 Top10% |"),
    (throughput_vs_bandwidth, ["--seq", "8", "--batch", "4", "--repeats", "1", "--configs", "AQ-SGD fw3-bw6"],
     "| AQ-SGD fw3-bw6 |"),
    (aqsgd_buffers, ["--examples", "8", "--batch", "4", "--seq", "8"], "| host + prefetch |"),
    (quantizer_error, ["--relu-shape", "4,2,2,8", "--gauss-shape", "2,4,8", "--bits", "2"], "| authors (SPEC) |"),
])
def test_benchmark_prints_its_table(module, argv, expect, capsys):
  module.main(argv)
  assert expect in capsys.readouterr().out
