"""Hugging Face GPT-2 checkpoints -> per-stage parameters of `gpt2_stages`.

Reads `model.safetensors` (PyTorch names: `h.{i}.attn.c_attn.weight`, Conv1D weights
stored [in, out]) or `flax_model.msgpack` (HF Flax: `h/{i}/attn/c_attn/kernel` stored
[out, in], embeddings under `embedding`), with an optional `transformer.` prefix, and
`config.json`. A stage's blocks are stacked on a leading axis (`params["blocks"]`, the scanned
layout of `gpt2.GPT2Stage`). The head is tied: the last stage gets its own copy of `wte`.
"""
import json
import pathlib

import numpy as np

from jaxcomp.models.gpt2 import GPT2Config, block_splits

_BLOCK = {  # our name -> (torch name, flax name)
    ("ln_1", "scale"): ("ln_1.weight", "ln_1/scale"), ("ln_1", "bias"): ("ln_1.bias", "ln_1/bias"),
    ("c_attn", "kernel"): ("attn.c_attn.weight", "attn/c_attn/kernel"),
    ("c_attn", "bias"): ("attn.c_attn.bias", "attn/c_attn/bias"),
    ("c_proj", "kernel"): ("attn.c_proj.weight", "attn/c_proj/kernel"),
    ("c_proj", "bias"): ("attn.c_proj.bias", "attn/c_proj/bias"),
    ("ln_2", "scale"): ("ln_2.weight", "ln_2/scale"), ("ln_2", "bias"): ("ln_2.bias", "ln_2/bias"),
    ("mlp_c_fc", "kernel"): ("mlp.c_fc.weight", "mlp/c_fc/kernel"),
    ("mlp_c_fc", "bias"): ("mlp.c_fc.bias", "mlp/c_fc/bias"),
    ("mlp_c_proj", "kernel"): ("mlp.c_proj.weight", "mlp/c_proj/kernel"),
    ("mlp_c_proj", "bias"): ("mlp.c_proj.bias", "mlp/c_proj/bias"),
}
_TOP = {"wte": ("wte.weight", "wte/embedding"), "wpe": ("wpe.weight", "wpe/embedding"),
        ("ln_f", "scale"): ("ln_f.weight", "ln_f/scale"), ("ln_f", "bias"): ("ln_f.bias", "ln_f/bias")}


def config_from_hf(config_json: dict, **overrides) -> GPT2Config:
  """GPT2Config from a HF `config.json` dict."""
  return GPT2Config(vocab_size=config_json["vocab_size"], n_positions=config_json["n_positions"],
                    n_embd=config_json["n_embd"], n_layer=config_json["n_layer"], n_head=config_json["n_head"],
                    dropout=config_json.get("resid_pdrop", 0.1), **overrides)


def read_state_dict(directory) -> tuple[dict[str, np.ndarray], str]:
  """({flat name: array}, "torch" | "flax") from a checkpoint directory, prefix stripped."""
  directory = pathlib.Path(directory)
  if (directory / "model.safetensors").exists():
    from safetensors.numpy import load_file
    weights, kind = load_file(str(directory / "model.safetensors")), "torch"
  elif (directory / "flax_model.msgpack").exists():
    from flax import serialization, traverse_util
    tree = serialization.msgpack_restore((directory / "flax_model.msgpack").read_bytes())
    weights = {"/".join(k): np.asarray(v) for k, v in traverse_util.flatten_dict(tree).items()}
    kind = "flax"
  else:
    raise FileNotFoundError(f"no model.safetensors or flax_model.msgpack in {directory}")
  sep = "." if kind == "torch" else "/"
  prefix = "transformer" + sep
  return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in weights.items()}, kind


def stage_params(weights: dict[str, np.ndarray], kind: str, cfg: GPT2Config, num_stages: int, cuts=None) -> tuple:
  """Per-stage param trees for `gpt2_stages(cfg, num_stages, cuts)`."""
  pick = 0 if kind == "torch" else 1
  sep = "." if kind == "torch" else "/"

  def get(name):
    if name not in weights:
      raise KeyError(f"checkpoint has no weight {name!r}")
    w = np.asarray(weights[name], np.float32)
    return w.T if kind == "flax" and name.endswith("kernel") else w

  def top(key):
    return get(_TOP[key][pick])

  stages = []
  splits = block_splits(cfg.n_layer, num_stages, cuts)
  for s, (first, n) in enumerate(splits):
    p = {"blocks": {}}
    for (module, leaf), names in _BLOCK.items():
      p["blocks"].setdefault(module, {})[leaf] = np.stack([get(f"h{sep}{i}{sep}{names[pick]}")
                                                           for i in range(first, first + n)])
    if s == 0:
      p["wte"], p["wpe"] = top("wte"), top("wpe")
    if s == num_stages - 1:
      p["ln_f"] = {"scale": top(("ln_f", "scale")), "bias": top(("ln_f", "bias"))}
      p["wte"] = top("wte").copy()
    stages.append(p)
  return tuple(stages)


def snapshot(name_or_dir: str, cache_dir=None) -> pathlib.Path:
  """The local folder of a pretrained GPT-2: `name_or_dir` itself when it is one, else the Hugging Face hub's
  snapshot of that name (e.g. "gpt2": config.json, the weights, and the tokenizer's vocab.json and merges.txt),
  downloaded into `cache_dir` (needs the `data` extra and a network connection; later calls read the cache)."""
  directory = pathlib.Path(name_or_dir)
  if directory.is_dir():
    return directory
  try:
    from huggingface_hub import snapshot_download
  except ImportError:
    raise ImportError(f"{name_or_dir!r} is not a local directory and huggingface_hub is not installed "
                      "(pip install -e .[data])") from None
  try:
    return pathlib.Path(snapshot_download(name_or_dir, cache_dir=cache_dir, allow_patterns=[
        "config.json", "*.safetensors", "*.msgpack", "vocab.json", "merges.txt"]))
  except Exception as err:  # offline, unknown repo, ...
    raise OSError(f"could not download {name_or_dir!r} from the Hugging Face hub ({err}); pass a local directory "
                  "with config.json, model.safetensors, vocab.json and merges.txt (huggingface.co/gpt2 has them)") from err


def from_pretrained(name_or_dir: str, num_stages: int, cache_dir=None, cuts=None, **config_overrides):
  """(GPT2Config, per-stage params) from a local HF directory or a hub name (e.g. "gpt2"; `snapshot`)."""
  directory = snapshot(name_or_dir, cache_dir)
  cfg = config_from_hf(json.loads((directory / "config.json").read_text()), **config_overrides)
  weights, kind = read_state_dict(directory)
  return cfg, stage_params(weights, kind, cfg, num_stages, cuts)
