"""`benchmarks.device_check --tiny`: every section runs at toy sizes on the CPU and its JSON holds the fields a
lent GPU's run fills, so the command cannot rot before a device is lent."""
import importlib.util
import json

import pytest

from benchmarks.device_check import command, settings

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


def sections(out) -> dict:
  return json.loads((out / "device_check.json").read_text())["sections"]


@pytest.mark.slow
def test_a_tiny_run_fills_every_section(tmp_path, capsys):
  target = ["--compile-target", "v5e-1"] if HAS_LIBTPU else []
  command.main(["--tiny", "--out", str(tmp_path), *target])
  s = sections(tmp_path)
  assert list(s) == list(settings.SECTIONS)
  p = s["provenance"]
  assert p["platform"] == "cpu" and p["device_kind"] and p["versions"]["jax"] and p["target"] is None

  codecs = s["codecs"]
  assert codecs["error"] is None and len(codecs["copy"]) == len(settings.DTYPES)
  measured = {(r["dtype"], r["spec"]) for r in codecs["rows"] if r["encode_s"] > 0 and r["decode_s"] > 0}
  assert measured == {(d, spec) for d in settings.DTYPES for _, spec, _ in settings.CODECS}
  assert all(r["passed"] == (r["fraction_of_copy"] >= r["goal"]) and r["wire_bytes"] < r["dense_bytes"]
             for r in codecs["rows"])
  # beside each measured pair, the same ops compiled for this device: logical bytes at least the dense tensor read
  # and written once, the program's traffic at least that, and the sort selection's row sort flagged
  assert all(r["compiled"]["traffic_bytes"] >= r["compiled"]["logical_bytes"] >= 2 * r["dense_bytes"]
             and r["estimate_over_measured"] > 0 and r["fraction_of_memory_bandwidth"] > 0 for r in codecs["rows"])
  row_sorts = {r["spec"]: r["compiled"]["row_sorts"] for r in codecs["rows"]}
  assert row_sorts["topk:0.1:q8:threshold"] == 0 and row_sorts["quant:4"] == 0

  for name, presets in (("steps:small", settings.TINY_PRESETS), ("steps:medium", ("fp32",)),
                        ("steps:xl", ("fp32",))):
    rows = s[name]["rows"]
    assert [r["preset"] for r in rows] == list(presets), rows
    for r in rows:
      assert r["measured"]["step_s"] > 0 and r["measured"]["finite"], r
      assert r["dry_run"]["peak_bytes"] > 0 and r["dry_run"]["matmul_flops"] > 0 and "estimated_s" not in r["dry_run"]
      assert r["over_fp32"] > 0
  assert s["steps:small"]["rows"][0]["over_fp32"] == 1.0

  compile_only = s["compile-only"]
  if HAS_LIBTPU:
    assert compile_only["error"] is None
    assert [r["preset"] for r in compile_only["rows"]] == list(settings.COMPILE_ONLY_PRESETS)
    assert all(r["fits"] and r["dry_run"]["estimated_s"] > 0 for r in compile_only["rows"])
  else:
    assert "no compile-only target" in compile_only["skipped"]

  sharded = s["sharded"]
  assert sharded["error"] is None and sharded["max_loss_difference"] < 1e-5
  assert sharded["measured"]["sharded"]["step_s"] > 0

  tests = s["tests"]
  assert tests["returncode"] == 0 and "passed" in tests["summary"] and tests["platform"] == "cpu"
  report = (tmp_path / "device_check.md").read_text()
  assert "## steps:small" in report and "| fp32 |" in report and "error:" not in report
  assert "wrote" in capsys.readouterr().out


def test_a_failing_step_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
  """One child's failure is that row's error; the section goes on and its JSON is written. With it, in the
  default suite, where the figures came from (the whole --tiny run, every section, is the slow test above)."""
  monkeypatch.setattr(command, "TINY_PRESETS", ("no-such-preset", "fp32"))
  command.main(["--tiny", "--out", str(tmp_path), "--sections", "provenance,steps:small"])
  s = sections(tmp_path)
  assert list(s) == ["provenance", "steps:small"]
  p = s["provenance"]
  assert p["platform"] == "cpu" and p["device_kind"] and p["versions"]["jax"] and p["target"] is None
  failed, fp32 = s["steps:small"]["rows"]
  assert failed["preset"] == "no-such-preset" and "no-such-preset" in failed["error"] and "measured" not in failed
  assert fp32["measured"]["step_s"] > 0 and fp32["over_fp32"] == 1.0
  assert fp32["dry_run"]["peak_bytes"] > 0 and fp32["dry_run"]["matmul_flops"] > 0


def test_sections_past_the_budget_are_skipped_with_the_reason(tmp_path):
  command.main(["--tiny", "--out", str(tmp_path), "--budget-s", "1e-9"])
  s = sections(tmp_path)
  assert all("budget" in s[name]["skipped"] for name in settings.SECTIONS if name != "compile-only")
  assert "no compile-only target" in s["compile-only"]["skipped"]
  assert "budget" in (tmp_path / "device_check.md").read_text()


def test_every_preset_and_codec_resolves():
  """The full-size run's presets and codec specs parse (a GPU run must not lose a row to a typo)."""
  from benchmarks.common import method_specs
  from jaxcomp.compress import spec
  assert set(settings.PRESETS) <= set(method_specs())
  for _, text, _ in settings.CODECS:
    if text != "reuse":
      spec.parse_codec(text)
