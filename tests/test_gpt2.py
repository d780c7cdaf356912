"""GPT-2 stages and HF checkpoint loading against an independent NumPy forward pass."""
import dataclasses
import importlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import serialization
from safetensors.numpy import save_file

import jaxcomp
from jaxcomp.models import gpt2, gpt2_weights
from jaxcomp.parallel import sharded, simulate

HF_CONFIG = {"vocab_size": 50, "n_positions": 16, "n_embd": 16, "n_layer": 4, "n_head": 2, "resid_pdrop": 0.1}


def _hf_weights(seed=0):
  """A random GPT-2 in HF PyTorch naming (Conv1D weights [in, out])."""
  rng = np.random.default_rng(seed)
  d, v, p = HF_CONFIG["n_embd"], HF_CONFIG["vocab_size"], HF_CONFIG["n_positions"]
  w = {"wte.weight": rng.normal(0, 0.3, (v, d)), "wpe.weight": rng.normal(0, 0.1, (p, d)),
       "ln_f.weight": 1 + rng.normal(0, 0.1, d), "ln_f.bias": rng.normal(0, 0.1, d)}
  for i in range(HF_CONFIG["n_layer"]):
    shapes = {"ln_1.weight": (d,), "ln_1.bias": (d,), "attn.c_attn.weight": (d, 3 * d), "attn.c_attn.bias": (3 * d,),
              "attn.c_proj.weight": (d, d), "attn.c_proj.bias": (d,), "ln_2.weight": (d,), "ln_2.bias": (d,),
              "mlp.c_fc.weight": (d, 4 * d), "mlp.c_fc.bias": (4 * d,), "mlp.c_proj.weight": (4 * d, d),
              "mlp.c_proj.bias": (d,)}
    for name, shape in shapes.items():
      w[f"h.{i}.{name}"] = (1.0 if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") else 0.0) + \
          rng.normal(0, 0.3, shape)
    w[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, p, p)))  # a buffer HF stores; ignored
  return {k: v.astype(np.float32) for k, v in w.items()}


def _reference_logits(w, tokens):
  """GPT-2 forward in NumPy from the HF weight dict (float64)."""
  w = {k: v.astype(np.float64) for k, v in w.items()}
  d, heads = HF_CONFIG["n_embd"], HF_CONFIG["n_head"]
  hd = d // heads
  b, t = tokens.shape

  def ln(x, g, bias):
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + 1e-5) * g + bias

  def gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))

  x = w["wte.weight"][tokens] + w["wpe.weight"][:t]
  for i in range(HF_CONFIG["n_layer"]):
    p = lambda n: w[f"h.{i}.{n}"]
    h = ln(x, p("ln_1.weight"), p("ln_1.bias"))
    q, k, v = np.split(h @ p("attn.c_attn.weight") + p("attn.c_attn.bias"), 3, axis=-1)
    q, k, v = (a.reshape(b, t, heads, hd).transpose(0, 2, 1, 3) for a in (q, k, v))
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    attn = (probs @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
    x = x + attn @ p("attn.c_proj.weight") + p("attn.c_proj.bias")
    h = ln(x, p("ln_2.weight"), p("ln_2.bias"))
    x = x + gelu(h @ p("mlp.c_fc.weight") + p("mlp.c_fc.bias")) @ p("mlp.c_proj.weight") + p("mlp.c_proj.bias")
  return ln(x, w["ln_f.weight"], w["ln_f.bias"]) @ w["wte.weight"].T


def _chain(stages, params, tokens, train=False, rng=jax.random.key(0)):
  x = tokens
  for s, (stage, p) in enumerate(zip(stages, params)):
    x = stage.apply(p, {}, x, train=train, rng=jax.random.fold_in(rng if rng is not None else jax.random.key(0), s))[0]
  return x


@pytest.fixture
def checkpoint_dirs(tmp_path):
  w = _hf_weights()
  torch_dir, flax_dir = tmp_path / "torch", tmp_path / "flax"
  for d in (torch_dir, flax_dir):
    d.mkdir()
    (d / "config.json").write_text(json.dumps(HF_CONFIG))
  save_file({f"transformer.{k}": v for k, v in w.items()}, str(torch_dir / "model.safetensors"))
  tree = {"wte": {"embedding": w["wte.weight"]}, "wpe": {"embedding": w["wpe.weight"]},
          "ln_f": {"scale": w["ln_f.weight"], "bias": w["ln_f.bias"]}, "h": {}}
  for i in range(HF_CONFIG["n_layer"]):
    g = lambda n: w[f"h.{i}.{n}"]
    tree["h"][str(i)] = {
        "ln_1": {"scale": g("ln_1.weight"), "bias": g("ln_1.bias")},
        "ln_2": {"scale": g("ln_2.weight"), "bias": g("ln_2.bias")},
        "attn": {"c_attn": {"kernel": g("attn.c_attn.weight").T, "bias": g("attn.c_attn.bias")},
                 "c_proj": {"kernel": g("attn.c_proj.weight").T, "bias": g("attn.c_proj.bias")}},
        "mlp": {"c_fc": {"kernel": g("mlp.c_fc.weight").T, "bias": g("mlp.c_fc.bias")},
                "c_proj": {"kernel": g("mlp.c_proj.weight").T, "bias": g("mlp.c_proj.bias")}}}
  (flax_dir / "flax_model.msgpack").write_bytes(serialization.msgpack_serialize({"transformer": tree}))
  return w, torch_dir, flax_dir


@pytest.mark.parametrize("which", ["torch", "flax"])
@pytest.mark.parametrize("num_stages", [1, 4])
def test_loaded_stages_match_numpy_reference(checkpoint_dirs, which, num_stages):
  w, torch_dir, flax_dir = checkpoint_dirs
  cfg, params = gpt2_weights.from_pretrained(str(torch_dir if which == "torch" else flax_dir), num_stages)
  assert cfg.n_layer == 4 and cfg.vocab_size == 50
  tokens = np.random.default_rng(1).integers(0, 50, (2, 11))
  logits = _chain(gpt2.gpt2_stages(cfg, num_stages), params, jnp.asarray(tokens))
  np.testing.assert_allclose(np.asarray(logits), _reference_logits(w, tokens), atol=1e-4, rtol=1e-4)
  if num_stages > 1:
    np.testing.assert_array_equal(params[0]["wte"], params[-1]["wte"])


def test_hub_name_loads_from_a_local_hub_cache_offline(tmp_path, monkeypatch):
  """The hub-name path of from_pretrained, against a cache folder in huggingface_hub's layout."""
  pytest.importorskip("huggingface_hub", reason="huggingface_hub not installed (the data extra)")
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setattr(importlib.import_module("huggingface_hub.constants"), "HF_HUB_OFFLINE", True)
  w = _hf_weights()
  commit = "0123456789abcdef0123456789abcdef01234567"
  repo = tmp_path / "models--gpt2"
  snapshot = repo / "snapshots" / commit
  snapshot.mkdir(parents=True)
  (repo / "refs").mkdir()
  (repo / "refs" / "main").write_text(commit)
  (snapshot / "config.json").write_text(json.dumps(HF_CONFIG))
  save_file(w, str(snapshot / "model.safetensors"))
  cfg, params = gpt2_weights.from_pretrained("gpt2", 2, cache_dir=str(tmp_path))
  assert cfg.n_layer == 4 and cfg.vocab_size == 50
  np.testing.assert_array_equal(params[1]["blocks"]["mlp_c_proj"]["kernel"][1], w["h.3.mlp.c_proj.weight"])
  with pytest.raises(OSError, match="could not download 'gpt2-medium' from the Hugging Face hub .*pass a local dir"):
    gpt2_weights.from_pretrained("gpt2-medium", 2, cache_dir=str(tmp_path))
  (snapshot / "vocab.json").write_text("{}")  # the tokenizer's files come in the same snapshot as the weights
  (snapshot / "merges.txt").write_text("#version: 0.2\n")
  assert gpt2_weights.snapshot("gpt2", cache_dir=str(tmp_path)) == snapshot
  assert (gpt2_weights.snapshot("gpt2", cache_dir=str(tmp_path)) / "vocab.json").is_file()


def test_stage_splits_and_errors(tmp_path):
  assert gpt2.block_splits(12, 4) == [(0, 3), (3, 3), (6, 3), (9, 3)]  # cuts after blocks 2, 5, 8
  assert gpt2.block_splits(12, 4, cuts=[1, 5, 9]) == [(0, 2), (2, 4), (6, 4), (10, 2)]
  assert gpt2.block_splits(5, 2) == [(0, 3), (3, 2)]
  with pytest.raises(ValueError, match=r"num_stages must be an integer in 1..12 \(n_layer\), got 13"):
    gpt2.gpt2_stages(gpt2.GPT2Config.small(), 13)
  with pytest.raises(ValueError, match="cuts must be 3 increasing block indices"):
    gpt2.block_splits(12, 4, cuts=[5, 2, 8])
  with pytest.raises(ValueError, match="cuts must be 1 increasing"):
    gpt2.block_splits(12, 2, cuts=[11])
  with pytest.raises(FileNotFoundError, match="no model.safetensors or flax_model.msgpack"):
    gpt2_weights.read_state_dict(tmp_path)
  cfg = gpt2.GPT2Config.small()
  shapes = [p.shape for p in jax.tree.leaves(jax.eval_shape(
      lambda: gpt2.gpt2_stages(cfg, 1)[0].init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))[0]))]
  assert sum(int(np.prod(s)) for s in shapes) == 124_439_808  # GPT-2 small


def test_outlier_channels_cross_the_boundaries_and_leave_the_model_alone():
  """With outliers, what stage 0 hands on is r * 64 on 4 spread channels plus 1024 at token 0 in two of them, r the
  plain model's residual; the next stage reads r back, so the logits are the plain model's."""
  cfg = gpt2.GPT2Config.tiny(n_layer=2, dropout=0.0)
  outliers = dataclasses.replace(cfg, outlier_channels=4, outlier_scale=64.0, massive=1024.0)
  tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, cfg.vocab_size)
  plain, carried = gpt2.gpt2_stages(cfg, 2), gpt2.gpt2_stages(outliers, 2)
  params = [plain[0].init(jax.random.key(1), tokens)[0]]
  r = plain[0].apply(params[0], {}, tokens, train=False, rng=jax.random.key(0))[0]
  params.append(plain[1].init(jax.random.key(2), r)[0])
  x = carried[0].apply(params[0], {}, tokens, train=False, rng=jax.random.key(0))[0]
  channels = outliers.outliers()
  np.testing.assert_array_equal(channels, [8, 24, 40, 56])
  expected = np.asarray(r).copy()
  expected[..., channels] *= 64.0
  expected[:, 0, channels[:2]] += 1024.0
  np.testing.assert_array_equal(np.asarray(x), expected)
  np.testing.assert_allclose(np.asarray(carried[1].apply(params[1], {}, x, train=False, rng=jax.random.key(0))[0]),
                             np.asarray(plain[1].apply(params[1], {}, r, train=False, rng=jax.random.key(0))[0]), rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_dropout_only_in_training():
  cfg = gpt2.GPT2Config.tiny()
  stages = gpt2.gpt2_stages(cfg, 2)
  tokens = jnp.arange(20).reshape(2, 10)
  params = [st.init(jax.random.key(0), x)[0] for st, x in zip(stages, [tokens, jnp.zeros((2, 10, 64))])]
  eval_a = _chain(stages, params, tokens, rng=jax.random.key(1))
  eval_b = _chain(stages, params, tokens, rng=jax.random.key(2))
  np.testing.assert_array_equal(np.asarray(eval_a), np.asarray(eval_b))
  train_a = _chain(stages, params, tokens, train=True, rng=jax.random.key(1))
  assert not np.allclose(np.asarray(train_a), np.asarray(eval_a))


def _lm_pipe(fwd, bwd, num_stages=4, m=2, cfg=None):
  cfg = cfg or gpt2.GPT2Config.tiny(n_embd=32, dropout=0.0)
  return jaxcomp.Pipeline(gpt2.gpt2_stages(cfg, num_stages), jaxcomp.parse_boundary(fwd, bwd, num_examples=8),
                          jaxcomp.losses.language_model, "tokens", m, tied=gpt2.gpt2_tied(num_stages))


TOKENS = jax.random.randint(jax.random.key(0), (4, 16), 0, 257)
LM_BATCH = {"tokens": TOKENS, "id": jnp.arange(4)}


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_adamw_steps_reduce_loss_with_tied_head():
  pipe = _lm_pipe("topk:0.3", "reuse")
  opt = optax.adamw(3e-3)
  state = simulate.init_state(pipe, opt, jax.random.key(1), LM_BATCH)
  np.testing.assert_array_equal(np.asarray(state.params[0]["wte"]), np.asarray(state.params[3]["wte"]))
  step = simulate.make_train_step(pipe, opt)
  losses = []
  for _ in range(15):
    state, metrics = step(state, LM_BATCH)
    losses.append(float(metrics["loss"]))
  assert losses[-1] < losses[0] - 0.5
  np.testing.assert_array_equal(np.asarray(state.params[0]["wte"]), np.asarray(state.params[3]["wte"]))


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_transformer_gpipe_matches_simulate():
  pipe = dataclasses.replace(_lm_pipe("ef21+topk:0.2", "quant:8"), grad_clip_norm=1.0)
  opt = optax.sgd(0.1)
  state = simulate.init_state(pipe, opt, jax.random.key(1), LM_BATCH)
  ex = sharded.ShardedExecutor(sharded.make_mesh(4))
  flat = ex.stack(pipe, opt, state, LM_BATCH)
  state, sim_metrics = simulate.make_train_step(pipe, opt)(state, LM_BATCH)
  flat, g_metrics = ex.make_train_step(pipe, opt)(flat, LM_BATCH)
  np.testing.assert_allclose(float(g_metrics["loss"]), float(sim_metrics["loss"]), rtol=1e-5)
  back = ex.unstack(pipe, opt, flat, LM_BATCH)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6), back.params,
               state.params)
