"""device_check.md from device_check.json: every section's figures and where they come from."""
from benchmarks.device_check.settings import CALLS, OVERHEAD_GOAL, SECTIONS

def _gib(b):
  return "-" if b is None else f"{b / 2**30:.2f}"


def _ms(s):
  return "-" if s is None else f"{1e3 * s:.2f}"


def report(results: dict) -> str:
  """device_check.md: every section's figures with where they come from; skipped and failed parts said so."""
  s = results["sections"]
  p = s.get("provenance", {})
  lines = ["# device_check", "", f"`{results['command']}`, commit {results['commit']}, started "
           f"{results['started_utc']}, {results.get('elapsed_s', 0):.0f} s of a {results['budget_s']:.0f} s budget"
           + (" (--tiny: toy sizes)" if results["tiny"] else ""), ""]
  if p:
    lines += [f"Measured on: {p.get('device_kind', '?')} ({p.get('platform', '?')}, {p.get('device_count', '?')} "
              f"device(s), {_gib(p.get('bytes_limit'))} GiB for JAX), driver {p.get('driver_version', 'unknown')}, "
              f"{p.get('platform_version', '')}; python {p.get('python', '?')}; "
              + ", ".join(f"{k} {v}" for k, v in p.get("versions", {}).items()), ""]
  for name in SECTIONS:
    value = s.get(name)
    lines.append(f"## {name}")
    lines.append("")
    if value is None:
      lines += ["not run", ""]
      continue
    if isinstance(value, str):
      lines += [value, ""]
      continue
    if value.get("skipped"):
      lines += [value["skipped"], ""]
      continue
    if name == "codecs" and "rows" in value:
      lines += codec_lines(value)
    elif name.startswith("steps:") and "rows" in value:
      lines += step_lines(value)
    elif name == "compile-only":
      lines += compile_only_lines(value, s)
    elif name == "sharded" and "measured" in value:
      m = value["measured"]
      lines += [f"1-stage GPT-2 {value['model']} (measured): simulate {_ms(m['simulate']['step_s'])} ms, sharded "
                f"{_ms(m['sharded']['step_s'])} ms per step (x{value['sharded_over_simulate']:.3f}); losses of 3 steps "
                f"{m['simulate']['losses']} vs {m['sharded']['losses']}, largest difference "
                f"{value['max_loss_difference']:.3g}"]
    elif name == "tests" and "summary" in value:
      lines += [f"`{' '.join(value['argv'])}` with JAX_PLATFORMS={value['platform']}: {value['summary']} "
                f"(exit {value['returncode']}, {value['wall_s']:.0f} s)"]
      lines += ["", "```", *value["tail"], "```"] if value["tail"] else []
    if value.get("error"):
      lines.append(f"error: {value['error']}")
    lines.append("")
  return "\n".join(lines)


def codec_lines(value) -> list[str]:
  timing = value["copy"][0] if value["copy"] else {"calls": CALLS, "repeats": "?"}
  lines = [f"Measured: encode and decode, each the time per call of {timing['calls']} calls back to back (median of "
           f"{timing['repeats']} runs). GB/s of the dense tensor = its bytes / (encode + decode); of copy = (2 x (dense + "
           "payload) / (encode + decode)) / the copy bandwidth of x + 1 on the same tensor.", ""]
  for c in value["copy"]:
    lines.append(f"- copy {c['dtype']} {c['shape']}: {c['copy_bytes_per_s'] / 1e9:.1f} GB/s (read + write)")
  lines += ["", "Compiled (`analysis.codec_cost`, the same ops compiled for this device): logical bytes (inputs read once, "
            "outputs written once) / measured time as a fraction of the memory bandwidth (HBM, published), the compiled "
            "program's passes (its HBM traffic / logical bytes; a sort counted as one pass, less than it moves) and "
            "its roofline estimate / the measured time.", "",
            "| shape | dtype | family | codec | wire / dense | encode ms | decode ms | dense GB/s | of copy | goal "
            "| pass | of HBM | passes | row sorts | estimate / measured |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|"
            "---:|---:|---:|---:|"]
  for r in value["rows"]:
    if "error" in r:
      lines.append(f"| {r['shape']} | {r['dtype']} | {r['family']} | `{r['spec']}` | error: {r['error'][:120]} |"
                   + " |" * 10)
      continue
    lines.append(f"| {r['shape']} | {r['dtype']} | {r['family']} | `{r['spec']}` | {r['wire_bytes'] / r['dense_bytes']:.4f} "
                 f"| {_ms(r['encode_s'])} | {_ms(r['decode_s'])} | {r['dense_gb_per_s']:.1f} | {r['fraction_of_copy']:.2f} "
                 f"| >= {r['goal']} | {'yes' if r['passed'] else '**no**'} | {r['fraction_of_memory_bandwidth']:.2f} "
                 f"| {r['compiled']['traffic_bytes'] / r['compiled']['logical_bytes']:.2f} | {r['compiled']['row_sorts']} "
                 f"| {r['estimate_over_measured']:.2f} |")
  return lines


def step_lines(value) -> list[str]:
  lines = [f"GPT-2 {value['model']}, simulate, train step. Measured: ms per step (steps back to back), its ratio to "
           f"fp32 (goal <= {OVERHEAD_GOAL}), peak device memory (`memory_stats` peak_bytes_in_use of the child "
           "process: the step, its state and the compiler's autotuning). Dry run (compiled, not run): the same "
           "program's peak (arguments + outputs - donated + temporaries) and the roofline estimate from the chip's "
           "published peaks.", "",
           "| preset | fwd / bwd | measured ms | / fp32 | <= 1.05 | measured peak GiB | dry-run peak GiB | est. ms "
           "(compute / memory) | compile s | note |", "|---|---|---:|---:|---|---:|---:|---:|---:|---|"]
  for r in value["rows"]:
    m, d = r.get("measured", {}), r.get("dry_run", {})
    est = (f"{_ms(d['estimated_s'])} ({_ms(d['compute_s'])} / {_ms(d['memory_s'])})" if "estimated_s" in d
           else "- (no chip figures)" if d else "-")
    verdict = "-" if "overhead_passed" not in r else "yes" if r["overhead_passed"] else "**no**"
    note = r.get("skipped") or r.get("error") or ""
    lines.append(f"| {r.get('preset')} | `{r.get('fwd', '')}` / `{r.get('bwd', '')}` | {_ms(m.get('step_s'))} | "
                 f"{r['over_fp32']:.3f} | {verdict} | {_gib(m.get('peak_bytes_in_use'))} | {_gib(d.get('peak_bytes'))} | "
                 f"{est} | {d.get('compile_s', 0):.1f} | {note[:200]} |" if "over_fp32" in r else
                 f"| {r.get('preset')} | `{r.get('fwd', '')}` / `{r.get('bwd', '')}` | {_ms(m.get('step_s'))} | - | - | "
                 f"{_gib(m.get('peak_bytes_in_use'))} | {_gib(d.get('peak_bytes'))} | {est} | "
                 f"{d.get('compile_s', 0):.1f} | {note[:200]} |")
  return lines


def compile_only_lines(value, sections) -> list[str]:
  if "rows" not in value:
    return [value.get("running", "")]
  measured = {r.get("preset"): r.get("measured", {}) for r in sections.get("steps:small", {}).get("rows", [])}
  lines = [f"`--compile-for {value['target']}` (compile-only devices, CPU-only child, {value['wall_s']:.0f} s; "
           "compiled, not run) beside the steps measured above.", "",
           "| preset | dry-run peak GiB | measured peak GiB | est. ms (roofline) | measured ms |",
           "|---|---:|---:|---:|---:|"]
  for r in value["rows"]:
    m = measured.get(r["preset"], {})
    lines.append(f"| {r['preset']} | {_gib(r['peak_bytes'])} | {_gib(m.get('peak_bytes_in_use'))} | "
                 f"{_ms(r['dry_run'].get('estimated_s'))} | {_ms(m.get('step_s'))} |")
  return lines

