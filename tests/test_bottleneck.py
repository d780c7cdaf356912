"""Learned low-rank boundaries (`compress.bottleneck`): what they send, their gradients, their constraint."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp.compress import bottleneck
from jaxcomp.models.mlp import mlp_stages
from jaxcomp.parallel import simulate

X = jax.random.normal(jax.random.key(0), (32, 8))
BATCH = {"x": X, "label": (X[:, 0] > 0).astype(jnp.int32)}
WIDTH, RANK = 16, 4


@contextlib.contextmanager
def _float64():
  """jax_enable_x64 for the block (jax.enable_x64 is not in every jax this package supports)."""
  previous = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", previous)


def _pipe(spec: str, fwd="none", bwd="none"):
  learned = bottleneck.parse(spec)
  return jaxcomp.Pipeline(bottleneck.wrap(mlp_stages(WIDTH, 2, 3), learned, WIDTH), jaxcomp.parse_boundary(fwd, bwd),
                          jaxcomp.losses.classification, "x", tied=bottleneck.tied(learned, 3))


@pytest.mark.parametrize("spec, message", [
    ("proj", "KIND:RANK"), ("lowrank:4", "kind must be one of proj, subspace"), ("proj:0", "positive integer"),
    ("proj:4:2", "KIND:RANK")])
def test_bad_specs_name_the_bad_part(spec, message):
  with pytest.raises(ValueError, match=message):
    bottleneck.parse(spec)


def test_a_rank_wider_than_the_boundary_is_refused():
  with pytest.raises(ValueError, match="bottleneck rank 17 is larger than the 16 features"):
    bottleneck.wrap(mlp_stages(WIDTH, 2, 3), bottleneck.parse("proj:17"), WIDTH)


@pytest.mark.parametrize("spec", ["proj:4", "subspace:4"])
def test_the_boundary_sends_rank_wide_messages(spec):
  """Dense: 2 boundaries x 32 examples x r fp32 each way; with maxabs:4 the codec's bytes of [32, r]."""
  pipe = _pipe(spec)
  assert jaxcomp.boundary_bytes(pipe, BATCH) == {"fwd": 2 * 32 * RANK * 4, "bwd": 2 * 32 * RANK * 4}
  coded = _pipe(spec, "maxabs:4", "maxabs:8")
  fwd, bwd = coded.boundary.wire_bytes((32, RANK), jnp.float32)
  assert jaxcomp.boundary_bytes(coded, BATCH) == {"fwd": 2 * fwd, "bwd": 2 * bwd}


@pytest.mark.parametrize("spec", ["proj:4", "subspace:4"])
def test_gradients_of_p_and_q_match_finite_differences(spec):
  """Each bottleneck parameter's gradient along a random direction against a central difference of the
  loss, in float64. A subspace W is held by both ends as a tied pair: its gradient is the pair's sum, and
  the difference moves both copies."""
  with _float64():
    pipe = _pipe(spec)
    batch = {"x": X.astype(jnp.float64), "label": BATCH["label"]}
    state = simulate.init_state(pipe, optax.sgd(0.1), jax.random.key(1), batch)
    state = state._replace(params=jax.tree.map(lambda a: a.astype(jnp.float64), state.params))
    grads = simulate.loss_and_grads(pipe, state, batch)[3]
    loss = jax.jit(lambda params: simulate.loss_and_grads(pipe, state._replace(params=params), batch)[0])
    for stage, name in [(0, bottleneck.DOWN), (1, bottleneck.UP), (1, bottleneck.DOWN), (2, bottleneck.UP)]:
      direction = jax.random.normal(jax.random.key(stage), state.params[stage][name].shape, jnp.float64)
      moved = [(stage, name), *((t, n) for pair in pipe.tied for (s, (m,)), (t, (n,)) in [pair, pair[::-1]]
                                if (s, m) == (stage, name))]
      assert len(moved) == (2 if spec.startswith("subspace") else 1)

      def shifted(t, moved=moved, direction=direction):
        params = list(state.params)
        for s, n in moved:
          params[s] = {**params[s], n: params[s][n] + t * direction}
        return loss(tuple(params))

      eps = 1e-5
      numeric = (shifted(eps) - shifted(-eps)) / (2 * eps)
      analytic = jnp.vdot(grads[stage][name], direction)
      np.testing.assert_allclose(float(analytic), float(numeric), rtol=1e-6, atol=1e-9, err_msg=f"{stage} {name}")


def test_subspace_stays_orthonormal_and_tied_while_it_trains():
  pipe = _pipe("subspace:4", "maxabs:4", "maxabs:8")
  opt = optax.adam(1e-2)
  state = simulate.init_state(pipe, opt, jax.random.key(1), BATCH)
  step = simulate.make_train_step(pipe, opt)
  start = np.asarray(state.params[0][bottleneck.DOWN])  # the train step donates the state
  for _ in range(5):
    state, _ = step(state, BATCH)
  for b in range(2):
    sent, received = state.params[b][bottleneck.DOWN], state.params[b + 1][bottleneck.UP]
    np.testing.assert_array_equal(np.asarray(sent), np.asarray(received))  # both ends hold the same W
    p = bottleneck.orthonormal(sent)
    np.testing.assert_allclose(np.asarray(p.T @ p), np.eye(RANK), atol=1e-5)
  assert not np.allclose(start, np.asarray(state.params[0][bottleneck.DOWN]))  # W trains


def test_inserting_into_a_model_trained_without_a_bottleneck_keeps_its_weights():
  plain = jaxcomp.Pipeline(mlp_stages(WIDTH, 2, 3), jaxcomp.parse_boundary("none", "none"),
                           jaxcomp.losses.classification, "x")
  trained = simulate.init_state(plain, optax.sgd(0.1), jax.random.key(5), BATCH).params
  pipe = _pipe("subspace:4")
  params = bottleneck.insert_into(trained, bottleneck.parse("subspace:4"), WIDTH, jax.random.key(0))
  state = simulate.init_state(pipe, optax.sgd(0.1), jax.random.key(1), BATCH, params)
  for s in range(3):
    jax.tree.map(np.testing.assert_array_equal, state.params[s]["Dense_0"], trained[s]["Dense_0"])
  np.testing.assert_array_equal(state.params[0][bottleneck.DOWN], state.params[1][bottleneck.UP])  # tied at init
  with pytest.raises(ValueError, match=r"already has parameters named \['bottleneck_down'\]"):
    bottleneck.insert_into(state.params, bottleneck.parse("subspace:4"), WIDTH, jax.random.key(0))
