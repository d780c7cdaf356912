"""ReparamSSN (Protocol NanoGPT's fixed-subspace model) and the `ids+CODEC` boundary that carries its token ids."""
import hashlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import config, gpt2_wikitext
from jaxcomp import losses, methods
from jaxcomp.analysis import dryrun
from jaxcomp.compress.spec import parse_boundary, parse_codec
from jaxcomp.data import text
from jaxcomp.models import protocol_gpt
from jaxcomp.models.protocol_gpt import ProtocolConfig
from jaxcomp.parallel import sharded, simulate
from jaxcomp.pipeline import Pipeline

# a ReparamSSN small enough to train in a test: 4 blocks of width 32 (r = 5), head dim 8, 4 stages
CFG = protocol_gpt.reparam_ssn(ProtocolConfig.tiny(n_embd=32, head_dim=8, vocab_size=61))
TOKENS = jax.random.randint(jax.random.key(3), (8, 12), 0, CFG.vocab_size)
BATCH = {"tokens": TOKENS}


def _noisy(params, scale=0.05):
  """`params` with every leaf moved by N(0, scale): the zero-initialised projections then write the residual."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(7), len(leaves))
  return jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def _pipe(fwd="ids+none", bwd="ids+none", stages=4, m=2):
  return Pipeline(protocol_gpt.protocol_stages(CFG, stages), parse_boundary(fwd, bwd), losses.language_model,
                  "tokens", microbatches=m)


def _state(pipe):
  state = simulate.init_state(pipe, optax.sgd(1.0), jax.random.key(0), BATCH)
  return state._replace(params=_noisy(state.params))


def _one_stage_params(params4):
  """The 4-stage model's parameters as one stage's: its subspace blocks stacked, the final block, both ends."""
  blocks = jax.tree.map(lambda *a: jnp.concatenate(a), *(p["blocks"] for p in params4[:3]))
  return {"wte": params4[0]["wte"], "blocks": blocks, "final_blocks": params4[3]["final_blocks"],
          "head_norm": params4[3]["head_norm"], "head": params4[3]["head"]}


def test_reparam_ssn_of_the_203m_model_is_the_records():
  """Rank 160, the MLP 11,292 wide: 203,822,240 parameters (the record's, under the dense 203,828,352); every
  boundary float32 [B, T, 161] whose `ids+bf16` message is 322 bytes a token each way (the record's 644)."""
  cfg = protocol_gpt.reparam_ssn(ProtocolConfig.b203m())
  assert (cfg.ssn_rank, cfg.mlp_hidden, protocol_gpt.num_params(cfg)) == (160, 11_292, 203_822_240)
  x, total = jax.ShapeDtypeStruct((2, 16), jnp.int32), 0
  for stage in protocol_gpt.protocol_stages(cfg, 8):
    params, state = jax.eval_shape(stage.init, jax.random.key(0), x)
    total += sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
    x = jax.eval_shape(lambda p, s, x, stage=stage: stage.apply(p, s, x, train=False, rng=jax.random.key(0))[0], params, state, x)
    if x.shape[-1] != cfg.vocab_size:
      assert (x.shape, x.dtype) == ((2, 16, 161), jnp.float32)
  assert total == 203_822_240
  codec = parse_codec("ids+bf16")
  assert codec.wire_bytes((16, 1024, 161), jnp.float32) == 16 * 1024 * 322


def test_every_boundary_is_the_fixed_table_plus_u_c_so_cutting_into_stages_changes_nothing():
  """The 4-stage model's logits equal the same weights run as one stage (no boundary): each stage's residual is
  F[tokens] + U c exactly, rebuilt from [c, ids] alone; and the ids channel is the tokens."""
  pipe1, pipe4 = _pipe(stages=1), _pipe()
  params4 = _state(pipe4).params
  x, messages = TOKENS, []
  for stage, p in zip(pipe4.stages, params4):
    x = stage.apply(p, {"constants": _constants()}, x, train=False, rng=jax.random.key(0))[0]
    messages.append(x)
  one = pipe1.stages[0].apply(_one_stage_params(params4), {"constants": _constants()}, TOKENS, train=False,
                              rng=jax.random.key(0))[0]
  np.testing.assert_allclose(messages[-1], one, atol=2e-5)
  for m in messages[:-1]:
    assert m.shape == (*TOKENS.shape, CFG.ssn_rank + 1)
    np.testing.assert_array_equal(m[..., -1], TOKENS.astype(np.float32))


def _constants():
  u, f = protocol_gpt.ssn_constants(CFG)
  return {"ssn_u": u, "ssn_fixed": f}


def test_u_has_orthonormal_columns_and_the_constants_come_from_the_seed():
  u, f = protocol_gpt.ssn_constants(CFG)
  np.testing.assert_allclose(u.T @ u, np.eye(CFG.ssn_rank), atol=1e-5)
  assert f.shape == (CFG.vocab_size, CFG.n_embd)
  other = protocol_gpt.ssn_constants(ProtocolConfig(**{**CFG.__dict__, "ssn_seed": 1}))
  assert not np.allclose(other[0], u)


def test_gradients_through_the_boundaries_are_exact_and_match_finite_differences():
  """The pipeline's gradients (dL/dc backward through each boundary) equal those of the one-stage model, and a
  finite difference along a random direction of the embedding."""
  pipe4 = _pipe()
  state = _state(pipe4)
  _, _, _, grads4, _, _ = simulate.step_grads(pipe4, state, BATCH)
  consts = {"constants": _constants()}

  def one_stage_loss(p):
    logits = _pipe(stages=1).stages[0].apply(p, consts, TOKENS, train=False, rng=jax.random.key(0))[0]
    return losses.language_model(logits, BATCH)[0]

  params1 = _one_stage_params(state.params)
  grads1 = jax.grad(one_stage_loss)(params1)
  merged = _one_stage_params(grads4)
  for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(grads1)):
    np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-4)
  direction = jax.random.normal(jax.random.key(5), params1["wte"].shape)
  eps = 1e-2
  shifted = lambda s: one_stage_loss({**params1, "wte": params1["wte"] + s * eps * direction})
  finite = (shifted(1.0) - shifted(-1.0)) / (2 * eps)
  np.testing.assert_allclose(float(jnp.vdot(grads4[0]["wte"], direction)), float(finite), rtol=1e-2)  # float32 central difference


@pytest.mark.parametrize("fwd, bwd", [("ids+bf16", "ids+bf16"), ("ids+maxabs:8:group=5", "ids+maxabs:4:stoch")])
def test_the_compiled_program_sends_the_bytes_counted(fwd, bwd):
  """On 4 devices the sharded step's collective-permutes carry exactly `wire_bytes`: c through the codec, the ids
  2 bytes a token, nothing dense."""
  pipe = _pipe(fwd, bwd)
  ex = sharded.ShardedExecutor(sharded.make_mesh(4))
  opt = optax.sgd(0.1)
  flat = ex.init_state(pipe, opt, jax.random.key(1), BATCH)
  sent = dryrun.collective_bytes(ex, pipe, opt, flat, BATCH)
  counted = simulate.wire_bytes_per_step(pipe, BATCH)
  assert sent == {"fwd": counted["fwd"], "bwd": counted["bwd"], "data": 0}
  tokens = TOKENS.size
  if fwd == "ids+bf16":
    assert counted["fwd"] == counted["bwd"] == 3 * tokens * (2 * CFG.ssn_rank + 2)


def test_sharded_training_matches_simulate():
  pipe = _pipe("ids+maxabs:8:group=5", "ids+maxabs:8:group=5:stoch")
  opt = optax.adam(1e-3)
  state = simulate.init_state(pipe, opt, jax.random.key(1), BATCH)
  ex = sharded.ShardedExecutor(sharded.make_mesh(4))
  flat = ex.stack(pipe, opt, state, BATCH)
  sim_step, g_step = simulate.make_train_step(pipe, opt), ex.make_train_step(pipe, opt)
  for _ in range(2):
    state, m_sim = sim_step(state, BATCH)
    flat, m_g = g_step(flat, BATCH)
    np.testing.assert_allclose(float(m_g["loss"]), float(m_sim["loss"]), rtol=1e-5)


def test_token_ids_cross_exactly_even_those_whose_bf16_bits_are_nans_or_subnormals():
  """Ids 1..127 as bf16 bit patterns are subnormals and 32,641..32,767 NaNs; sent as uint16 they all arrive, and
  the codec of the rest never sees them (its scale is the coordinates')."""
  ids = jnp.array([0, 1, 127, 32_705, 32_767, 50_303, 65_535], jnp.float32)
  c = jax.random.normal(jax.random.key(0), (7, 4))
  x = jnp.concatenate([c, ids[:, None]], -1)[None]
  codec = parse_codec("ids+maxabs:4")
  y = codec(x)
  np.testing.assert_array_equal(y[..., -1], x[..., -1])
  np.testing.assert_allclose(y[..., :-1], parse_codec("maxabs:4")(c[None]), atol=0)
  assert codec.encode(x).arrays.ids.dtype == jnp.uint16
  assert codec.wire_bytes(x.shape, x.dtype) == parse_codec("maxabs:4").wire_bytes(c[None].shape, c.dtype) + 2 * 7
  with pytest.raises(ValueError, match=r"ids\+CODEC sends the last channel"):
    codec.wire_bytes((8, 1), jnp.float32)


def _run(**flags):
  return config.resolve(gpt2_wikitext.EXPERIMENT, "protocol-cpu", **flags)


def test_the_experiment_refuses_ssn_without_ids_and_ids_without_ssn():
  for flags, match in ((dict(bottleneck="ssn", fwd="bf16", bwd="ids+bf16"), "its forward spec must be ids"),
                       (dict(fwd="ids+bf16", bwd="ids+bf16"), "only ReparamSSN's boundaries carry them"),
                       (dict(bottleneck="ssn:x", fwd="ids+bf16", bwd="ids+bf16"), "expected ssn or ssn:R")):
    with pytest.raises(ValueError, match=match):
      gpt2_wikitext.abstract(_run(**flags, train_examples=64))
  with pytest.raises(ValueError, match="ReparamSSN changes Protocol NanoGPT's model"):
    gpt2_wikitext.abstract(config.resolve(gpt2_wikitext.EXPERIMENT, "tiny", bottleneck="ssn", fwd="ids+bf16",
                                          bwd="ids+bf16", train_examples=64))


def test_the_ssn_methods_build_protocol_tiny_as_reparam_ssn_at_its_own_rates():
  m = methods.get("ssn")
  pipe, _, batch, _ = gpt2_wikitext.abstract(_run(**m.run_settings(), train_examples=64))
  assert pipe.stages[0].module.cfg.ssn_rank == 20  # 160/1024 of 128
  assert dict(m.settings)["lr"] == 0.02


def test_the_shipped_texts_are_the_ones_their_readme_names():
  kjv = text.shipped_corpus("kjv")
  digest = hashlib.sha256((kjv.train + kjv.validation).encode()).hexdigest()
  assert digest == "2c912b5b95925209996ca14c05a3d0597b0aa0b78057387f16bc4839cc10784d"
  assert kjv.train.startswith("Genesis 1\n\nIn the beginning God created")
  shakespeare = text.shipped_corpus("shakespeare")
  assert len(shakespeare.train + shakespeare.validation) == 1_115_394
  long = text.shipped_corpus("long")
  assert len(long.train.encode()) // 128 >= 44_800  # the ladder's training blocks
  with pytest.raises(ValueError, match="the shipped texts are"):
    text.shipped_corpus("gutenberg")
