import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from jaxcomp.compress import codecs, schemes, spec

ROWS, FEAT = 4, (6, 5)


def _xs(n, seed=0):
  return [jax.random.normal(jax.random.key(seed + i), (ROWS, *FEAT)) for i in range(n)]


@pytest.mark.parametrize("scheme", [schemes.EF(codecs.TopK(0.1)), schemes.EF(codecs.MinMaxQuant(2)),
                                    schemes.EFMixed(codecs.TopK(0.2))], ids=repr)
def test_ef_telescopes(scheme):
  """sum of delivered messages + final error == sum of inputs."""
  state = scheme.init_sender(ROWS, FEAT, jnp.float32)
  delivered = jnp.zeros((ROWS, *FEAT))
  xs = _xs(12)
  for i, x in enumerate(xs):
    payload, state = scheme.send(x, state, jax.random.key(i))
    delivered += scheme.receive(payload, ())[0]
  np.testing.assert_allclose(np.asarray(delivered + state.error), np.asarray(sum(xs)), atol=1e-4)
  assert float(jnp.abs(state.error).max()) > 0  # compression really lost something each step


def test_efmixed_is_the_papers_definition():
  """Rudakov et al.'s EF-mixed (../shared/SPEC.md): per example m = TopK_a(x) + TopK_b(e), a = ceil(k/2) entries
  of x, b = floor(k/2) of the error buffer, k = ceil(K F); e' = x + e - m. Against a numpy reference, 3 steps."""
  scheme = schemes.EFMixed(codecs.TopK(0.1))
  state = scheme.init_sender(2, (30,), jnp.float32)  # k = 3: 2 entries of x, 1 of e
  error = np.zeros((2, 30))

  def top(v, n):
    kept = np.zeros_like(v)
    for row, order in enumerate(np.argsort(-np.abs(v), axis=1, kind="stable")[:, :n]):
      kept[row, order] = v[row, order]
    return kept

  for step in range(3):
    x = np.asarray(jax.random.normal(jax.random.key(step), (2, 30)))
    m = top(x, 2) + top(error, 1)
    payload, state = scheme.send(jnp.asarray(x, jnp.float32), state)
    np.testing.assert_allclose(np.asarray(scheme.receive(payload, ())[0]), m, rtol=1e-6)
    error = x + error - m
    np.testing.assert_allclose(np.asarray(state.error), error, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fraction, shape, k", [(0.2, (ROWS, *FEAT), 6), pytest.param(0.1, (ROWS, 4096), 410, marks=pytest.mark.slow),
                                                (0.1, (ROWS, 10), 1), (0.3, (ROWS, 10), 3)])
def test_efmixed_sends_exactly_ceil_kf_entries(fraction, shape, k):
  """ceil(K*F) values per row in total (ceil(k/2) of x, floor(k/2) of e), and bytes to match."""
  scheme = schemes.EFMixed(codecs.TopK(fraction))
  state = scheme.init_sender(ROWS, shape[1:], jnp.float32)
  for x in [jax.random.normal(jax.random.key(i), shape) for i in range(3)]:
    payload, state = scheme.send(x, state)
    assert sum(p.arrays.values.shape[1] for p in payload) == k
    nnz = np.count_nonzero(np.asarray(scheme.receive(payload, ())[0]).reshape(ROWS, -1), axis=1)
    assert np.all(nnz <= k) and np.all(nnz >= (k + 1) // 2)  # the two parts may overlap
    assert scheme.wire_bytes(shape, jnp.float32) == codecs.nbytes(payload)


@pytest.mark.parametrize("codec", [codecs.TopK(0.1), codecs.MaxAbsQuant(2, stochastic=True)], ids=repr)
def test_ef21_mirrors_stay_identical(codec):
  scheme = schemes.EF21(codec)
  s_state = scheme.init_sender(ROWS, FEAT, jnp.float32)
  r_state = scheme.init_receiver(ROWS, FEAT, jnp.float32)
  x = _xs(1)[0]
  errors = []
  for i, noise in enumerate(_xs(15, seed=100)):
    payload, s_state = scheme.send(x + 0.01 * noise, s_state, jax.random.key(i))
    y, r_state = scheme.receive(payload, r_state)
    np.testing.assert_array_equal(np.asarray(s_state.estimate), np.asarray(r_state.estimate))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(r_state.estimate))
    errors.append(float(jnp.abs(y - x).max()))
  assert errors[-1] < 0.2 * errors[0]  # g tracks a slowly moving x


def test_aqsgd_mirrors_and_compresses_changes():
  n = 10
  scheme = schemes.AQSGD(codecs.MaxAbsQuant(2, scale_dtype="float16"), num_examples=n)  # 5 channels: small scales
  s_table = scheme.init_sender(ROWS, FEAT, jnp.float32)
  r_table = scheme.init_receiver(ROWS, FEAT, jnp.float32)
  assert s_table.buffer.shape == (n, *FEAT) and s_table.buffer.dtype == jnp.float16
  ids = jnp.array([7, 2, 5, 0])
  a0 = _xs(1)[0]
  gather = lambda t: schemes.AQSGDState(t.buffer[ids])
  put = lambda t, rows: schemes.AQSGDState(t.buffer.at[ids].set(rows.buffer))

  payload, s_rows = scheme.warmup_send(a0, gather(s_table))  # first visit: dense
  assert codecs.nbytes(payload) == a0.size * 4
  y, r_rows = scheme.warmup_receive(payload, gather(r_table))
  np.testing.assert_array_equal(np.asarray(y), np.asarray(a0))
  s_table, r_table = put(s_table, s_rows), put(r_table, r_rows)
  untouched = np.setdiff1d(np.arange(n), np.asarray(ids))
  assert not np.any(np.asarray(s_table.buffer)[untouched])

  direct_err, aq_err = [], []
  for noise in _xs(4, seed=50):
    a = a0 + 0.05 * noise  # activations drift slowly between epochs
    payload, s_rows = scheme.send(a, gather(s_table))
    assert codecs.nbytes(payload) == scheme.wire_bytes(a.shape, a.dtype) < a.size * 4 / 10
    y, r_rows = scheme.receive(payload, gather(r_table))
    s_table, r_table = put(s_table, s_rows), put(r_table, r_rows)
    np.testing.assert_array_equal(np.asarray(s_table.buffer), np.asarray(r_table.buffer))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(r_rows.buffer, np.float32))
    aq_err.append(float(jnp.abs(y - a).max()))
    direct_err.append(float(jnp.abs(scheme.codec(a) - a).max()))
  assert max(aq_err) < 0.25 * min(direct_err)  # the change is small, so 2 bits suffice


def test_aqsgd_buffer_stays_near_a_noisy_activation():
  """Each visit sends Q(a_t - m) for a_t = a + noise (dropout-like, 0.3 ||a||), so the buffer
  error after a visit is noise plus Q's error on the delta. The default `maxabs:2:stoch` (midrise,
  clip=mse) errs by ~0.45 of what it encodes, and m stays within ~0.3 ||a|| of a; the 3-level
  zero grid unclipped errs by ~1.3 of it under stochastic rounding, more than the delta it
  corrects, and its buffer random-walks away (~3 ||a|| after 30 visits): AQ-SGD fw2's stall."""
  a = jax.random.normal(jax.random.key(0), (8, 32, 64))
  scheme = schemes.AQSGD(spec.parse_codec("maxabs:2:stoch"), num_examples=8)
  _, state = scheme.warmup_send(a, scheme.init_sender(8, a.shape[1:], jnp.float32))
  errors = []
  for t in range(30):
    _, state = scheme.send(a + 0.3 * jax.random.normal(jax.random.key(100 + t), a.shape), state, jax.random.key(t))
    errors.append(float(jnp.linalg.norm(state.buffer.astype(jnp.float32) - a) / jnp.linalg.norm(a)))
  assert max(errors[10:]) < 0.4


@pytest.mark.parametrize("make, match", [
    (lambda: schemes.EFMixed(codecs.MinMaxQuant(4)), "EF-mixed needs a TopK codec"),
    (lambda: schemes.AQSGD(codecs.MinMaxQuant(4), num_examples=0), "num_examples >= 1"),
    (lambda: schemes.EF("topk"), "needs a Codec"),
])
def test_bad_schemes(make, match):
  with pytest.raises(ValueError, match=match):
    make()


# Property suite: every scheme x codec, jitted and eager.
PROPERTY_CODECS = [codecs.MinMaxQuant(4), codecs.MaxAbsQuant(2, stochastic=True), codecs.TopK(0.3), codecs.ScaledCast()]
SCHEME_CASES = ([(kind, c) for kind in (schemes.Plain, schemes.EF, schemes.EF21) for c in PROPERTY_CODECS]
                + [(schemes.EFMixed, codecs.TopK(0.3))]
                + [(functools.partial(schemes.AQSGD, num_examples=ROWS), c) for c in PROPERTY_CODECS])


class SchemePropertiesTest(chex.TestCase):
  """Over 4 messages: what the receiver outputs keeps x's shape and dtype, each payload is `wire_bytes`, mirrored
  states (EF21's estimate, AQ-SGD's buffer) stay bitwise equal at both ends, error feedback telescopes
  (sum of delivered messages + final error == sum of inputs), and the same keys give the same messages."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(*range(len(SCHEME_CASES)))
  def test_scheme_properties(self, i):
    make, codec = SCHEME_CASES[i]
    scheme = make(codec)
    send, receive = self.variant(scheme.send), self.variant(scheme.receive)
    sender = scheme.init_sender(ROWS, FEAT, jnp.float32)
    receiver = scheme.init_receiver(ROWS, FEAT, jnp.float32)
    xs, delivered = _xs(4, seed=10 * i), []
    for step, x in enumerate(xs):
      key = jax.random.key(step)
      payload, new_sender = send(x, sender, key)
      chex.assert_trees_all_equal(send(x, sender, key), (payload, new_sender))
      chex.assert_equal(codecs.nbytes(payload), scheme.wire_bytes(x.shape, x.dtype))
      x_hat, receiver = receive(payload, receiver)
      chex.assert_shape(x_hat, x.shape)
      chex.assert_type(x_hat, x.dtype)
      if isinstance(new_sender, (schemes.EF21State, schemes.AQSGDState)):
        chex.assert_trees_all_equal(new_sender, receiver)
      sender = new_sender
      delivered.append(x_hat)
    if isinstance(sender, schemes.EFState):
      chex.assert_trees_all_close(sum(delivered) + sender.error, sum(xs), atol=1e-4)

  @parameterized.parameters(*range(len(SCHEME_CASES)))
  def test_state_fed_back_compiles_once(self, i):
    """As optax checks an optimizer: the states a step returns go into the next call of the same jitted step,
    which must not trace again, in fp32 and bf16 messages, warm-up steps (dense, AQ-SGD records) included: a
    state whose pytree structure, shapes or dtypes drift from what init made would retrace."""
    make, codec = SCHEME_CASES[i]
    scheme = make(codec)
    for dtype in (jnp.float32, jnp.bfloat16):
      for warmup in (False, True):
        chex.clear_trace_counter()

        @jax.jit
        @chex.assert_max_traces(n=1)
        def step(x, sender, receiver, key):
          payload, sender = scheme.warmup_send(x, sender) if warmup else scheme.send(x, sender, key)
          x_hat, receiver = (scheme.warmup_receive if warmup else scheme.receive)(payload, receiver)
          return x_hat, sender, receiver

        sender = scheme.init_sender(ROWS, FEAT, dtype)
        receiver = scheme.init_receiver(ROWS, FEAT, dtype)
        for n, x in enumerate(_xs(3, seed=10 * i)):
          _, sender, receiver = step(x.astype(dtype), sender, receiver, jax.random.key(n))
