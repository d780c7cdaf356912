"""benchmarks.codec_compiled at toy sizes: every cell compiled for v5e, written after each, skipped on a rerun."""
import json

from benchmarks import codec_compiled


def test_a_target_fills_every_cell_resumes_and_summarises(tmp_path, monkeypatch, capsys):
  # 131,072 entries an example: the threshold's sorts (4,096 sampled, 4,096 candidates, the TPU scatter's indices)
  # are each under an eighth of it, so none is a row sort
  monkeypatch.setattr(codec_compiled, "SHAPES", {"toy": ((2, 128, 1024), "float32", "tiny", 2)})
  specs = ["topk:0.1:q8:threshold", "topk:0.1:q8:sort", "bf16"]
  codec_compiled.measure_target("v5e-1", tmp_path, ["toy"], specs)
  done = json.loads((tmp_path / "v5e-1.json").read_text())
  assert set(done["cells"]) == {f"toy {s}" for s in specs} and done["stage"]["toy"] > 0
  threshold = {o["op"]: o for o in done["cells"]["toy topk:0.1:q8:threshold"]}
  assert set(threshold) == {"encode", "decode", "values_at", "scatter"}  # with the index-reuse backward
  assert all(o["traffic_bytes"] >= o["logical_bytes"] > 0 for o in threshold.values())
  assert [o["op"] for o in done["cells"]["toy bf16"]] == ["encode", "decode"]
  done["cells"]["toy bf16"][0]["passes"] = -1.0  # a mark: a rerun must keep what is there
  (tmp_path / "v5e-1.json").write_text(json.dumps(done))
  codec_compiled.measure_target("v5e-1", tmp_path, ["toy"], specs)
  assert json.loads((tmp_path / "v5e-1.json").read_text())["cells"]["toy bf16"][0]["passes"] == -1.0
  monkeypatch.setattr(codec_compiled, "TOPK", specs[:2])
  monkeypatch.setattr(codec_compiled, "FAMILIES", ["bf16"])
  text = codec_compiled.summary({"v5e-1": done})
  assert "| `topk:0.1:q8:sort` |" in text and "+1 sort" not in text.split("`topk:0.1:q8:threshold`")[1].split("\n")[0]
