"""jaxcomp.compress.rotation: the randomized Hadamard rotation around a codec."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcomp.compress import codecs
from jaxcomp.compress.rotation import Hadamard, fwht


def _x(shape, dtype=jnp.float32, seed=0):
  return (jax.random.normal(jax.random.key(seed), shape) * 3 + 1).astype(dtype)


@pytest.mark.parametrize("n", [2, 16, 512])
def test_fwht_is_the_orthonormal_hadamard_matrix(n):
  h = np.array([[1.0]])
  while len(h) < n:
    h = np.block([[h, h], [h, -h]])
  x = _x((3, n))
  np.testing.assert_allclose(np.asarray(fwht(x)), np.asarray(x) @ h.T / np.sqrt(n), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(fwht(fwht(x))), np.asarray(x), rtol=1e-5, atol=1e-5)


@settings(max_examples=4, deadline=None)
@given(st.integers(1, 4), st.sampled_from([(8, 8), (64, 16), (48, 16), (24, None)]), st.integers(0, 10**6),
       st.sampled_from(codecs.MAXABS_GRIDS))
def test_rotation_keeps_the_inner_error_in_2_norm(rows, features_block, seed, grid):
  f, block = features_block
  x = _x((rows, f), seed=seed)
  inner = codecs.MaxAbsQuant(3, "group", group=f // 2 if f % 2 == 0 else f, grid=grid)
  rot = Hadamard(inner, block=block, seed=seed % 7)
  np.testing.assert_allclose(np.asarray(jax.jit(Hadamard(codecs.Identity(), block, seed % 7))(x)), np.asarray(x),
                             rtol=1e-5, atol=1e-4)
  y = jax.jit(rot.rotate)(x)
  np.testing.assert_allclose(np.linalg.norm(np.asarray(y)), np.linalg.norm(np.asarray(x)), rtol=1e-5)
  inner_err = np.linalg.norm(np.asarray(jax.jit(inner)(y) - y))
  np.testing.assert_allclose(np.linalg.norm(np.asarray(jax.jit(rot)(x) - x)), inner_err, rtol=1e-4, atol=1e-5)


def test_rotation_spreads_an_outlier_and_lowers_the_error():
  x = _x((64, 64), seed=3).at[:, 5].mul(40.0)  # one outlier channel, as in LLM activations
  plain = codecs.MaxAbsQuant(3, "group", clip=1.0, group=64, grid="zero")
  rotated = Hadamard(plain)
  assert float(jnp.max(jnp.abs(rotated.rotate(x)))) < 0.5 * float(jnp.max(jnp.abs(x)))
  assert float(jnp.linalg.norm(rotated(x) - x)) < 0.9 * float(jnp.linalg.norm(plain(x) - x))  # 148 vs 184


def test_rotation_signs_depend_on_the_seed_and_nothing_extra_travels():
  x = _x((2, 32))
  a, b = Hadamard(codecs.Identity(), seed=0), Hadamard(codecs.Identity(), seed=1)
  assert not np.allclose(np.asarray(a.rotate(x)), np.asarray(b.rotate(x)))
  assert set(a.encode(x).parts()) == {"x"}
