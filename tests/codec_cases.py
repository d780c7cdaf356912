"""Inputs and error measures the codec tests share."""
import jax
import jax.numpy as jnp
import numpy as np


def normal_input(shape, dtype=jnp.float32, seed=0):
  return (jax.random.normal(jax.random.key(seed), shape) * 3 + 1).astype(dtype)


def relative_mse(x, x_hat):
  return float(np.mean((np.asarray(x_hat, np.float64) - np.asarray(x, np.float64)) ** 2) / np.mean(np.asarray(x, np.float64) ** 2))

