"""Run results on disk: one JSON, one CSV and one markdown table per run, written atomically.

Each file belongs to one run name, so runs never overwrite each other, and a file is
replaced only by a complete new version (write to a temporary name, then rename).
"""
import csv
import io
import json
import os
import pathlib


def _atomic_write(path: pathlib.Path, text: str):
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(text)
  os.replace(tmp, path)


def flatten(record: dict, prefix: str = "") -> dict:
  """{'eval_on': {'accuracy': 1}} -> {'eval_on.accuracy': 1}; lists (an epoch's scheduled `evals`) are left out:
  the JSON keeps them."""
  out = {}
  for k, v in record.items():
    if isinstance(v, dict):
      out.update(flatten(v, f"{prefix}{k}."))
    elif not isinstance(v, list):
      out[f"{prefix}{k}"] = v
  return out


def markdown(rows: list[dict], columns: list[str] | None = None) -> str:
  flat = [flatten(r) for r in rows]
  columns = columns or list(dict.fromkeys(k for r in flat for k in r))
  fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in flat]
  return "\n".join(lines)


def write(out_dir, run: str, config: dict, history: list[dict], **summary) -> dict[str, pathlib.Path]:
  """Writes <run>.json, <run>.csv, <run>.md under out_dir; returns their paths. `summary`: more top-level fields of
  the JSON (e.g. `target`: when the run reached its target loss), each also a line of the markdown."""
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  paths = {ext: out_dir / f"{run}.{ext}" for ext in ("json", "csv", "md")}
  _atomic_write(paths["json"], json.dumps({"run": run, "config": config, "history": history, **summary}, indent=1))
  flat = [flatten(r) for r in history]
  buf = io.StringIO()
  if flat:
    writer = csv.DictWriter(buf, fieldnames=list(dict.fromkeys(k for r in flat for k in r)))
    writer.writeheader()
    writer.writerows(flat)
  _atomic_write(paths["csv"], buf.getvalue())
  lines = "".join(f"{k}: {json.dumps(v)}\n" for k, v in summary.items())
  _atomic_write(paths["md"], f"# {run}\n\n{markdown(history)}\n" + (f"\n{lines}" if lines else ""))
  return paths


def read(path) -> dict:
  """One run's results (<run>.json); ValueError saying why if the file is not one."""
  try:
    run = json.loads(pathlib.Path(path).read_text())
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
    raise ValueError(f"not readable as JSON: {type(err).__name__}") from None
  if not (isinstance(run, dict) and isinstance(run.get("run"), str) and isinstance(run.get("config"), dict)
          and isinstance(run.get("history"), list) and all(isinstance(r, dict) for r in run["history"])):
    raise ValueError("not a run's results: a JSON object with run, config and history")
  return run


def load(out_dir, skipped: dict | None = None) -> list[dict]:
  """Every run's results (<run>.json) under out_dir, by run name; the *.json files that are not one
  are left out, and put in `skipped` ({file name: why}) if it is given."""
  runs = []
  for path in sorted(pathlib.Path(out_dir).glob("*.json")):
    try:
      runs.append(read(path))
    except ValueError as err:
      if skipped is not None:
        skipped[path.name] = str(err)
  return runs
