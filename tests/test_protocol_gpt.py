"""Protocol NanoGPT's model: its parameter count, its math against a reference written from the benchmark's
train_gpt.py, its stages, and the Muon + AdamW optimizer's parameter groups."""
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import config, gpt2_wikitext
from jaxcomp.models import protocol_gpt
from jaxcomp.models.protocol_gpt import ProtocolConfig


def _params(stages, x):
  """Every stage's parameter shapes (`jax.eval_shape`: nothing allocated) and the activation after each stage."""
  shapes, acts = [], []
  for stage in stages:
    params, state = jax.eval_shape(stage.init, jax.random.key(0), x)
    x = jax.eval_shape(lambda p, x, stage=stage, state=state: stage.apply(p, state, x, train=False,
                                                                          rng=jax.random.key(0))[0], params, x)
    shapes.append(params)
    acts.append(x)
  return shapes, acts


def test_protocol_203m_has_the_benchmarks_203828352_parameters_one_block_per_stage():
  stages = protocol_gpt.protocol_stages(ProtocolConfig.b203m(), 8)
  shapes, acts = _params(stages, jax.ShapeDtypeStruct((2, 16), jnp.int32))
  count = lambda tree: sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))
  assert sum(count(p) for p in shapes) == 203_828_352
  assert [p["blocks"]["q"]["kernel"].shape for p in shapes] == [(1, 1024, 1024)] * 8
  assert "wte" in shapes[0] and "head" not in shapes[0] and shapes[0]["wte"].shape == (50304, 1024)
  assert "head" in shapes[7] and "wte" not in shapes[7] and shapes[7]["head"]["kernel"].shape == (1024, 50304)
  assert all("wte" not in p and "head" not in p for p in shapes[1:7])
  # the boundaries carry bf16 [B, T, 1024] (2,048 bytes per token each way); the last stage gives fp32 logits
  assert {(a.shape, a.dtype.name) for a in acts[:-1]} == {((2, 16, 1024), "bfloat16")}
  assert (acts[-1].shape, acts[-1].dtype) == ((2, 16, 50304), jnp.float32)


def _reference_logits(params, tokens, cfg: ProtocolConfig):
  """The benchmark's forward (train_gpt.py's GPT, GPTStage) written out in fp32."""
  eps = float(jnp.finfo(jnp.float32).eps)
  rms = lambda x, g=1.0: x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * g
  linear = lambda x, layer: x @ layer["kernel"] + layer["bias"]
  b, t = tokens.shape
  quarter = cfg.head_dim // 4
  freq = np.concatenate([(1 / 1024) ** np.linspace(0, 1, quarter), np.zeros(quarter)])
  theta = np.arange(t)[:, None] * freq[None, :]
  cos, sin = np.cos(theta)[None, :, None, :], np.sin(theta)[None, :, None, :]

  def rotate(x):
    x1, x2 = x[..., : cfg.head_dim // 2], x[..., cfg.head_dim // 2:]
    return jnp.concatenate([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], -1)

  x = rms(params["wte"][tokens], params["embed_norm"]["scale"])
  for i in range(cfg.n_layer):
    block = jax.tree.map(lambda a: a[i], params["blocks"])
    h = rms(x, block["norm1"]["scale"])
    q, k, v = (linear(h, block[n]).reshape(b, t, cfg.n_head, cfg.head_dim) for n in ("q", "k", "v"))
    q, k = rotate(rms(q)), rotate(rms(k))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.12
    scores = jnp.where(np.tril(np.ones((t, t), bool)), scores, -jnp.inf)
    y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v).reshape(b, t, -1)
    x = x + linear(y, block["attn_proj"])
    x = x + linear(jnp.maximum(linear(rms(x, block["norm2"]["scale"]), block["fc"]), 0) ** 2, block["mlp_proj"])
  z = linear(rms(x, params["head_norm"]["scale"]), params["head"])
  return 15 * z / jnp.sqrt(z * z + 15**2)


def test_the_model_computes_the_benchmarks_gpt():
  """Random parameters everywhere (the zero-initialised projections and head included), one stage, two blocks."""
  cfg = ProtocolConfig.tiny(vocab_size=50, n_layer=2, n_embd=64, head_dim=16)
  (stage,) = protocol_gpt.protocol_stages(cfg, 1)
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab_size)
  params, state = stage.init(jax.random.key(0), tokens)
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(2), len(leaves))
  params = jax.tree.unflatten(tree, [0.3 * jax.random.normal(k, a.shape) + (a.ndim == 1) for k, a in zip(keys, leaves)])
  got = stage.apply(params, state, tokens, train=True, rng=jax.random.key(0))[0]
  want = _reference_logits(params, tokens, cfg)
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
  assert float(jnp.abs(got).max()) < 15  # soft-capped


def test_initialisation_is_the_benchmarks():
  cfg = ProtocolConfig.tiny()
  first, last = protocol_gpt.protocol_stages(cfg, 4)[::3]
  p0 = first.init(jax.random.key(0), jnp.zeros((2, 8), jnp.int32))[0]
  p3 = last.init(jax.random.key(0), jnp.zeros((2, 8, cfg.n_embd), jnp.float32))[0]
  blocks = p0["blocks"]
  for zero in (blocks["attn_proj"]["kernel"], blocks["mlp_proj"]["kernel"], p3["head"]["kernel"], blocks["q"]["bias"]):
    assert not np.any(np.asarray(zero))
  assert np.std(np.asarray(blocks["fc"]["kernel"])) == pytest.approx(math.sqrt(0.33 / cfg.n_embd), rel=0.05)
  assert np.std(np.asarray(p0["wte"])) == pytest.approx(1.0, rel=0.05)
  assert np.all(np.asarray(blocks["norm1"]["scale"]) == 1)


def _muon_run(**flags):
  return config.resolve(gpt2_wikitext.EXPERIMENT, "protocol-cpu", **flags)


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest_at_its_group_rates():
  """One step from the initial parameters: each block matrix moves by -lr x an orthogonal matrix (Muon; singular
  values 1 after 12 Newton-Schulz steps), the embedding, head and vectors by about their own AdamW rate (Adam's
  first step is lr x sign(g))."""
  run = _muon_run()
  cfg = ProtocolConfig.tiny()
  stages = protocol_gpt.protocol_stages(cfg, 4)
  x = jnp.zeros((2, 8), jnp.int32)
  params = []
  for stage in stages:
    params.append(stage.init(jax.random.key(0), x)[0])
    x = jnp.zeros((2, 8, cfg.n_embd), jnp.float32)
  params = tuple(params)
  groups = protocol_gpt.param_groups(params)
  assert groups[0]["blocks"]["fc"]["kernel"] == groups[3]["blocks"]["q"]["kernel"] == "matrix"
  assert (groups[0]["wte"], groups[3]["head"]["kernel"], groups[3]["head"]["bias"]) == ("embedding", "head", "vector")
  assert groups[1]["blocks"]["norm1"]["scale"] == groups[1]["blocks"]["fc"]["bias"] == "vector"
  grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(p.size), p.shape), params)
  optimizer = gpt2_wikitext.optimizer_for(run, 400)
  updates, _ = optimizer.update(grads, optimizer.init(params), params)
  proj = np.asarray(updates[1]["blocks"]["attn_proj"]["kernel"][0])  # zero-initialised: no weight decay term
  singular = np.linalg.svd(proj / -0.025, compute_uv=False)  # a square Gaussian's smallest take longer to reach 1
  assert singular.max() < 1.02 and np.mean(np.abs(singular - 1) < 0.02) > 0.95
  fc = np.asarray(updates[2]["blocks"]["fc"]["kernel"][0]) + 0.025 * 0.05 * np.asarray(params[2]["blocks"]["fc"]["kernel"][0])
  np.testing.assert_allclose(np.linalg.svd(fc / -0.025, compute_uv=False), 2.0, atol=0.04)  # x sqrt(512 / 128)
  for leaf, rate in ((updates[3]["head"]["kernel"], 0.004), (updates[0]["wte"], 0.7),
                     (updates[2]["blocks"]["norm2"]["scale"], 0.015)):
    assert float(jnp.abs(leaf).max()) == pytest.approx(rate, rel=0.01)


def test_the_lr_schedule_is_stable_then_decays_over_the_cooldown():
  schedule = gpt2_wikitext.lr_schedule(_muon_run(), 0.025, 3000)
  assert [float(schedule(s)) for s in (0, 899, 900)] == pytest.approx([0.025, 0.025, 0.025])
  assert float(schedule(2000)) == pytest.approx(0.025 * 1000 / 2100)  # (1 - 2000/3000) / 0.7
  assert float(schedule(3000)) == 0.0
  linear = gpt2_wikitext.lr_schedule(config.resolve(gpt2_wikitext.EXPERIMENT), 1e-3, 100)  # --cooldown 1
  assert float(linear(25)) == pytest.approx(0.75e-3)


def test_muon_refuses_a_gpt2_model():
  with pytest.raises(ValueError, match="--model tiny is GPT-2: use --model protocol-tiny"):
    gpt2_wikitext.optimizer_for(config.resolve(gpt2_wikitext.EXPERIMENT, optimizer="muon"), 10)
  assert isinstance(gpt2_wikitext.optimizer_for(config.resolve(gpt2_wikitext.EXPERIMENT), 10),
                    optax.GradientTransformation)


def test_the_protocol_recipe_is_the_benchmarks_dense_record():
  run = config.resolve(gpt2_wikitext.EXPERIMENT, "protocol")
  ex, training, own = run.executor, run.training, run.options
  assert (ex.executor, ex.schedule, ex.stages, ex.microbatches) == ("sharded", "1f1b", 8, 64)
  assert (training.batch_size, own.block_size, training.steps, own.lr_steps) == (512, 1024, 3000, 3000)
  assert (training.eval_every, training.target_loss) == (25, 3.276)
  assert (own.model, own.optimizer, training.lr, own.cooldown, own.grad_clip) == ("protocol-203m", "muon", 0.025, 0.7,
                                                                                  None)
  pipe, _, batch, _ = gpt2_wikitext.abstract(run)
  assert pipe.num_stages == 8 and pipe.microbatches == 64 and batch["tokens"].shape == (512, 1024)


@pytest.mark.slow  # heavy: python -m pytest -m slow (Muon's 12 Newton-Schulz steps on every matrix compile slowly)
def test_a_protocol_cpu_run_records_its_step_to_target_and_stops_there(tmp_path, capsys):
  """The initial model predicts uniformly (its head is zero): eval loss ln 257 = 5.549 <= 6 at step 1."""
  from experiments import cli
  cli.main(gpt2_wikitext.EXPERIMENT, ["--recipe", "protocol-cpu", "--steps", "3", "--train-examples", "32",
                                      "--eval-examples", "16", "--batch-size", "8", "--eval-every", "1",
                                      "--target-loss", "6", "--stop-at-target", "--out", str(tmp_path),
                                      "--run-name", "p", "--no-progress"])
  results = json.loads((tmp_path / "results" / "p.json").read_text())
  assert results["target"]["step"] == 1 and results["history"][-1]["step"] == 1
  assert results["config"]["model"] == "protocol-tiny" and results["config"]["optimizer"] == "muon"
  assert "target eval loss 6 (compression on): reached at step 1" in capsys.readouterr().out
