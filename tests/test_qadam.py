"""jaxcomp.parallel.qadam: QuantizedAdam on the sharded executor's data-parallel replicas."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp.analysis import dryrun
from jaxcomp.compress.boundary import Mode
from jaxcomp.parallel import padded_rows, sharded, simulate
from jaxcomp.parallel.qadam import QuantizedAdam
from pipeline_cases import BATCH, assert_trees_close, mlp_pipe, slow


def _qadam_setup(scheme, opt, pipe=None, warmup=0):
  pipe = pipe or mlp_pipe("none", "none", m=2)
  ex = sharded.ShardedExecutor(sharded.make_mesh(4, data=2), jaxcomp.parse_scheme(scheme))
  state = ex.init_state(pipe, opt, jax.random.key(1), BATCH)
  step = ex.make_train_step(pipe, opt, Mode.WARMUP)
  for _ in range(warmup):
    state, _ = step(state, BATCH)
  return pipe, ex, state


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_quantized_adam_state_round_trips_through_the_simulate_layout():
  opt = QuantizedAdam(1e-2)
  pipe, ex, state = _qadam_setup("ef+quant:4", opt, warmup=1)
  state, _ = ex.make_train_step(pipe, opt, Mode.TRAIN)(state, BATCH)
  back = ex.unstack(pipe, opt, state, BATCH)
  assert jax.tree.structure(back.opt_state) == jax.tree.structure(opt.init(back.params))
  assert float(jnp.abs(back.grad_state.error[1]["Dense_0"]["kernel"]).max()) > 0
  again = ex.stack(pipe, opt, back, BATCH)
  assert_trees_close(again._replace(rng=()), state._replace(rng=()), 0)


@pytest.mark.slow  # heavy: python -m pytest -m slow
@pytest.mark.parametrize("lr, weight_decay", [(1e-2, 0.0), slow(optax.linear_schedule(2e-2, 5e-3, 3), 0.1)])
def test_quantized_adam_warmup_is_adam_on_the_mean_gradient(lr, weight_decay):
  """Warm-up = optax.adam(w) after the dense pmean, ties and clipping (data=2, 3 steps)."""
  tied = (((1, ("Dense_0", "kernel")), (2, ("Dense_0", "kernel"))),)
  pipe = dataclasses.replace(mlp_pipe("quant:4", "quant:8"), tied=tied, grad_clip_norm=0.05)
  reference = sharded.ShardedExecutor(sharded.make_mesh(4, data=2))
  opt = optax.adamw(lr, weight_decay=weight_decay) if weight_decay else optax.adam(lr)
  expected = reference.init_state(pipe, opt, jax.random.key(1), BATCH)
  step = reference.make_train_step(pipe, opt, Mode.WARMUP)
  for _ in range(3):
    expected, _ = step(expected, BATCH)
  _, _, state = _qadam_setup("none", QuantizedAdam(lr, weight_decay=weight_decay), pipe, warmup=3)
  assert_trees_close(state.params, expected.params, 1e-6)
  assert float(jnp.abs(state.params - expected.params[:1]).max()) > 0.01  # not the same stage row
  np.testing.assert_array_equal(np.asarray(state.opt_state.nu_count), [3] * 4)


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_quantized_adam_freezes_v_and_averages_the_error_fed_momentum():
  """One compressed step against a reference: v frozen; the replicas' EF telescopes to
  m' + mean(e') - mean(e) = b1 m + (1 - b1) g (g: the mean gradient, from `simulate`).
  eps = 1e-4: dead ReLU units have v = 0, and 2 warm-up steps leave revived ones m / eps."""
  b1, b2, lr, eps = 0.9, 0.999, 1e-3, 1e-4
  pipe, ex, state = _qadam_setup("ef+quant:4", QuantizedAdam(lr, b1, b2, eps), warmup=2)
  train = ex.make_train_step(pipe, QuantizedAdam(lr, b1, b2, eps), Mode.TRAIN)
  state, _ = train(state, BATCH)  # one compressed step: the error buffers are non-zero
  snapshot = lambda st: jax.tree.map(np.array, st._replace(rng=None))  # copies: the step donates
  before = snapshot(state)
  template = simulate.init_state(mlp_pipe("none", "none", m=4), optax.identity(), jax.random.key(1), BATCH)
  sim_state = ex.unstack(pipe, None, state, BATCH)
  grads = jax.jit(lambda st, b: simulate.loss_and_grads(mlp_pipe("none", "none", m=4), st, b))(sim_state, BATCH)[3]
  flat = padded_rows.FlatRows(template.params)
  g = np.asarray(flat.stack(grads))
  state, _ = train(state, BATCH)
  after = snapshot(state)
  o0, o1 = before.opt_state, after.opt_state
  np.testing.assert_array_equal(o1.nu, o0.nu)
  np.testing.assert_array_equal(o1.nu_count, [2] * 4)
  np.testing.assert_array_equal(o1.count, [4] * 4)
  e0, e1 = before.grad_state.error, after.grad_state.error  # [S, D, P]
  assert np.abs(e1).max() > 1e-4
  real = np.arange(flat.size)[None] < np.asarray(flat.sizes)[:, None]
  np.testing.assert_allclose((o1.mu + e1.mean(1) - e0.mean(1))[real], (b1 * o0.mu + (1 - b1) * g)[real], atol=1e-6)
  assert not o1.mu[~real].any() and not after.params[~real].any()  # padding stays zero
  step = o1.mu / (1 - b1**4) / (np.sqrt(o0.nu / (1 - b2**2)) + eps)
  np.testing.assert_allclose(after.params, before.params - lr * step, atol=1e-6)


@pytest.mark.slow  # heavy: python -m pytest -m slow
def test_quantized_adam_exchange_bytes_match_the_hlo():
  opt = QuantizedAdam(1e-2)
  sent, predicted = {}, {}
  for scheme in ("none", "ef+quant:4"):
    pipe, ex, state = _qadam_setup(scheme, opt)
    sent[scheme] = dryrun.collective_bytes(ex, pipe, opt, state, BATCH)["data"]
    predicted[scheme] = ex.wire_bytes_per_step(pipe, BATCH)["data"]
  warm = dryrun.collective_bytes(ex, pipe, opt, state, BATCH, Mode.WARMUP)
  assert sent == predicted
  row = state.params.shape[1]
  assert warm["data"] == ex.wire_bytes_per_step(pipe, BATCH, Mode.WARMUP)["data"] == 4 * 2 * row * 4  # a dense ring
  # all-reduce: 4 stages x 2 (D-1) x the fp32 row
  assert sent["none"] == row * 4 * 4 * 2  # 4 stages x fp32 row x 2 replicas x 1 peer
  assert sent["ef+quant:4"] == sent["none"] // 8 + 4 * 2 * 8  # + fp32 (min, max) per message


def test_quantized_adam_clear_errors():
  opt = QuantizedAdam(1e-2)
  pipe = mlp_pipe("none", "none")
  with pytest.raises(ValueError, match="QuantizedAdam exchanges Adam's first moment compressed by grad_scheme"):
    sharded.ShardedExecutor(sharded.make_mesh(4, data=2)).make_train_step(pipe, opt, Mode.WARMUP)
  with pytest.raises(ValueError, match="only runs inside sharded.ShardedExecutor"):
    simulate.make_train_step(pipe, opt)(simulate.init_state(pipe, opt, jax.random.key(1), BATCH), BATCH)
  _, ex, state = _qadam_setup("ef+quant:4", opt, pipe)
  with pytest.raises(ValueError, match="no warm-up step"):
    ex.make_train_step(pipe, opt, Mode.TRAIN)(state, BATCH)
  for bad in (dict(b1=1.0), dict(b2=-0.1), dict(eps=-1.0), dict(weight_decay=True), dict(learning_rate="1e-3")):
    with pytest.raises(ValueError, match="QuantizedAdam"):
      QuantizedAdam(**bad)
