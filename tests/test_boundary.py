"""The custom_vjp boundary against hand-written references of the compressed gradient."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from jaxcomp.compress import codecs, schemes, spec
from jaxcomp.compress.boundary import Boundary, Mode, Reuse

B, D = 4, 12
W1 = jax.random.normal(jax.random.key(1), (D, D)) / 3
W2 = jax.random.normal(jax.random.key(2), (D, 3)) / 3
X = jax.random.normal(jax.random.key(3), (B, D))


def _x(shape, dtype=jnp.float32, seed=0):
  return (jax.random.normal(jax.random.key(seed), shape) * 3 + 1).astype(dtype)


def _loss(w1, w2, link, state, mode=Mode.TRAIN):
  """A two-stage net with one boundary: L = sum(tanh(tanh(X W1) W2)^2)."""
  h = jnp.tanh(X @ w1)
  y, fwd_states = link(h, state, jax.random.key(0), mode)
  return jnp.sum(jnp.tanh(y @ w2) ** 2), fwd_states


def _reference(fwd_c, bwd_c):
  """Hand-derived: y = C_f(h); dL/dh = C_b(dL/dy); chain rule by hand."""
  a = X @ W1
  h = jnp.tanh(a)
  y = fwd_c(h)
  z = jnp.tanh(y @ W2)
  dz = 2 * z * (1 - z**2)
  dw2 = y.T @ dz
  dy = dz @ W2.T
  dh = bwd_c(dy)
  dw1 = X.T @ (dh * (1 - h**2))
  return dw1, dw2, dy


class GradientTest(parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(
      (codecs.MinMaxQuant(2), codecs.MinMaxQuant(8)), (codecs.TopK(0.25), codecs.TopK(0.5)),
      (codecs.MaxAbsQuant(4), codecs.Cast("bfloat16")), (codecs.Identity(), codecs.MinMaxQuant(3)))
  def test_plain_gradient_is_compressed_true_gradient(self, fwd_c, bwd_c):
    link = Boundary(schemes.Plain(fwd_c), schemes.Plain(bwd_c))
    state = link.init(B, (D,), jnp.float32)
    grads = self.variant(jax.grad(lambda w1, w2: _loss(w1, w2, link, state)[0], argnums=(0, 1)))(W1, W2)
    dw1, dw2, _ = _reference(fwd_c, bwd_c)
    np.testing.assert_allclose(np.asarray(grads[1]), np.asarray(dw2), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grads[0]), np.asarray(dw1), rtol=1e-5, atol=1e-6)
    plain = jax.grad(lambda w1: jnp.sum(jnp.tanh(jnp.tanh(X @ w1) @ W2) ** 2))(W1)
    self.assertFalse(np.allclose(np.asarray(grads[0]), np.asarray(plain), atol=1e-6))

  @chex.variants(with_jit=True, without_jit=True)
  def test_backward_ef_state_is_the_cotangent(self):
    bwd = schemes.EF(codecs.TopK(0.25))
    link = Boundary(schemes.Plain(codecs.Identity()), bwd)
    state = link.init(B, (D,), jnp.float32)
    state = state._replace(bwd_send=schemes.EFState(0.1 * jax.random.normal(jax.random.key(9), (B, D))))
    grad_fn = self.variant(jax.grad(lambda w1, s: _loss(w1, W2, link, s)[0], argnums=(0, 1)))
    dw1, new_state = grad_fn(W1, state)
    _, _, dy = _reference(lambda h: h, lambda g: g)
    v = dy + state.bwd_send.error  # m = C(dy + e); e' = dy + e - m
    m = bwd.codec(v)
    np.testing.assert_allclose(np.asarray(new_state.bwd_send.error), np.asarray(v - m), atol=1e-6)
    h = jnp.tanh(X @ W1)
    np.testing.assert_allclose(np.asarray(dw1), np.asarray(X.T @ (m * (1 - h**2))), rtol=1e-5, atol=1e-6)


def test_index_reuse_sends_gradient_on_forward_mask():
  topk = codecs.TopK(0.25)
  link = Boundary(schemes.Plain(topk), Reuse())
  state = link.init(B, (D,), jnp.float32)
  h = jnp.tanh(X @ W1)
  mask = np.asarray(topk(h)) != 0
  dw1 = jax.grad(lambda w1: _loss(w1, W2, link, state)[0])(W1)
  _, _, dy = _reference(topk, lambda g: g)
  np.testing.assert_allclose(np.asarray(dw1), np.asarray(X.T @ (jnp.where(mask, dy, 0) * (1 - h**2))),
                             rtol=1e-5, atol=1e-6)
  assert link.wire_bytes((B, D), jnp.float32) == (topk.wire_bytes((B, D), jnp.float32), B * 3 * 4)


def test_warmup_is_dense_and_fills_aqsgd_buffer():
  link = Boundary(schemes.AQSGD(codecs.MinMaxQuant(2), num_examples=B), schemes.Plain(codecs.MinMaxQuant(2)))
  state = link.init(B, (D,), jnp.float32)
  dw1, (fs, fr) = jax.grad(lambda w1: _loss(w1, W2, link, state, Mode.WARMUP), has_aux=True)(W1)
  np.testing.assert_allclose(np.asarray(dw1), np.asarray(_reference(lambda h: h, lambda g: g)[0]), rtol=1e-5, atol=1e-6)
  h = jnp.tanh(X @ W1)
  np.testing.assert_array_equal(np.asarray(fs.buffer), np.asarray(h.astype(jnp.float16)))
  np.testing.assert_array_equal(np.asarray(fr.buffer), np.asarray(fs.buffer))


def test_first_visit_sends_activations_dense_and_gradients_compressed():
  """AQ-SGD's first visit: m(xi) = a at both ends, dL/dh = C_b(dL/dy) as in training."""
  bwd = codecs.MinMaxQuant(2)
  link = Boundary(schemes.AQSGD(codecs.MinMaxQuant(2), num_examples=B), schemes.Plain(bwd))
  state = link.init(B, (D,), jnp.float32)
  dw1, (fs, fr) = jax.grad(lambda w1: _loss(w1, W2, link, state, Mode.FIRST_VISIT), has_aux=True)(W1)
  np.testing.assert_allclose(np.asarray(dw1), np.asarray(_reference(lambda h: h, bwd)[0]), rtol=1e-5, atol=1e-6)
  h = jnp.tanh(X @ W1)
  np.testing.assert_array_equal(np.asarray(fs.buffer), np.asarray(h.astype(jnp.float16)))
  np.testing.assert_array_equal(np.asarray(fr.buffer), np.asarray(fs.buffer))


def test_eval_modes_are_stateless():
  link = Boundary(schemes.EF21(codecs.TopK(0.25)), schemes.Plain(codecs.MinMaxQuant(8)))
  state = link.init(B, (D,), jnp.float32)
  h = jnp.tanh(X @ W1)
  y, fwd_states = link(h, state, jax.random.key(0), Mode.EVAL_COMPRESSED)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(codecs.TopK(0.25)(h)))
  assert fwd_states == (state.fwd_send, state.fwd_recv)
  y, _ = link(h, state, jax.random.key(0), Mode.EVAL_UNCOMPRESSED)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(h))


def test_invalid_ticks_leave_backward_state_alone():
  """A bubble call contributes zero to the backward-state cotangent, whatever the state holds."""
  link = Boundary(schemes.Plain(codecs.Identity()), schemes.EF21(codecs.TopK(0.25)))
  state = link.init(B, (D,), jnp.float32)
  ones = schemes.EF21State(jnp.ones((B, D)))
  state = state._replace(bwd_send=ones, bwd_recv=ones)  # non-zero: an unmasked bubble would hand it back
  f = lambda s, ok: link(jnp.tanh(X @ W1), s, jax.random.key(0), Mode.TRAIN, ok, ok)[0].sum()
  valid = jax.grad(f)(state, True)
  bubble = jax.grad(f)(state, False)
  assert float(jnp.abs(valid.bwd_send.estimate).max()) > 0
  assert float(jnp.abs(bubble.bwd_send.estimate).max()) == 0.0
  assert float(jnp.abs(bubble.bwd_recv.estimate).max()) == 0.0


@pytest.mark.parametrize("fwd, bwd, match", [
    (schemes.Plain(codecs.MinMaxQuant(4)), Reuse(), "index reuse needs a single TopK"),
    (schemes.EFMixed(codecs.TopK(0.2)), Reuse(), "index reuse needs a single TopK"),
    (schemes.Plain(codecs.TopK(0.2)), schemes.AQSGD(codecs.MinMaxQuant(4), num_examples=3), "activations only"),
    ("topk", schemes.Plain(codecs.Identity()), "forward scheme must be a Scheme"),
    (Reuse(), schemes.Plain(codecs.Identity()), "reuse is backward only"),
])
def test_bad_boundaries(fwd, bwd, match):
  with pytest.raises(ValueError, match=match):
    Boundary(fwd, bwd)


@pytest.mark.parametrize("fwd, bwd", [("hadamard+maxabs:3:group=16", "hadamard+maxabs:4:group=16"),
                                      pytest.param("adaptive:3:4:0.25", "hadamard+adaptive:3:4:0.25:stoch",
                                                   marks=pytest.mark.slow),
                                      pytest.param("adaptive:2:3:0.25:grid=midrise",
                                                   "hadamard+maxabs:4:group=16:grid=midrise", marks=pytest.mark.slow)])
def test_boundary_gradient_is_the_compressed_true_gradient(fwd, bwd):
  link = spec.parse_boundary(fwd, bwd)
  x = _x((4, 6, 32), seed=2)
  w = jax.random.normal(jax.random.key(5), (32, 32)) / 6
  state = link.init(4, (6, 32), jnp.float32)
  key = jax.random.key(0)

  def loss(x):
    y, _ = link(x, state, key, Mode.TRAIN)
    return jnp.sum(jnp.tanh(y @ w) ** 2)

  value, dx = jax.jit(jax.value_and_grad(loss))(x)
  y = link.fwd.codec(x, None)
  assert float(value) == pytest.approx(float(jnp.sum(jnp.tanh(y @ w) ** 2)), rel=1e-5)
  dy = jax.grad(lambda y: jnp.sum(jnp.tanh(y @ w) ** 2))(y)
  assert not np.allclose(np.asarray(dx), np.asarray(dy), atol=1e-6)  # the backward codec acted
  bwd_codec = link.bwd.codec
  if not getattr(getattr(bwd_codec, "inner", bwd_codec), "stochastic", False):
    np.testing.assert_allclose(np.asarray(dx), np.asarray(bwd_codec(dy, None)), rtol=1e-5, atol=1e-6)
  rel = float(jnp.linalg.norm(dx - dy) / jnp.linalg.norm(dy))
  assert rel < 0.3
