"""The notebooks run top to bottom in a fresh kernel (nbclient), at a tiny size, on CPU with the
suite's 8 fake devices: a notebook that breaks fails the suite."""
import ast
import pathlib
import re

import nbclient
import nbformat

NOTEBOOKS = pathlib.Path(__file__).parents[1] / "notebooks"


def _text(cell) -> str:
  return "".join(o.get("text", "") + "".join(o.get("data", {}).get("text/plain", "")) for o in cell.get("outputs", []))


def test_quickstart_runs_top_to_bottom(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXCOMP_NOTEBOOK_EXAMPLES", "32")  # training examples per run: 4 steps per epoch
  monkeypatch.setenv("JAXCOMP_NOTEBOOK_OUT", str(tmp_path))
  notebook = nbformat.read(NOTEBOOKS / "quickstart.ipynb", as_version=4)
  nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                          resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()  # raises on any cell's error
  code = [c for c in notebook.cells if c.cell_type == "code"]
  text = "\n".join(_text(c) for c in code)
  assert "bytes per step: {'fwd': 12312, 'bwd': 49176}" in text  # part 1: the MLP's exact bytes
  images = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
  assert len(images) == 2  # the report's figure and one run's plot, shown inline
  (run_dir,) = tmp_path.iterdir()
  assert {p.name for p in (run_dir / "results").glob("*.png")} == {"baseline.png", "aqsgd-fw2-bw4.png", "curves.png"}
  counted = ast.literal_eval(re.search(r"counted: +(\{.*\})", text).group(1))
  compiled = ast.literal_eval(re.search(r"compiled program: +(\{.*\})", text).group(1))
  assert compiled == counted and min(counted.values()) > 0  # part 3: 8 devices, every message read back
  # part 4: the hand-written GPipe loop and its jaxcomp.ppermute twin, bytes read back from both programs
  sent = dict(re.findall(r"bytes per step, (\S+): compiled program (fwd [\d,]+ bwd [\d,]+); counted \d+ x wire_bytes = "
                         r"\2", text))
  assert set(sent) == {"lax.ppermute", "jaxcomp.ppermute"}, text
  forward = {name: int(both.split()[1].replace(",", "")) for name, both in sent.items()}
  assert forward["jaxcomp.ppermute"] < forward["lax.ppermute"] / 4  # 4-bit codes and a scale per channel
