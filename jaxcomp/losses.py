"""Loss functions with the executors' signature: (outputs, microbatch) -> (loss, metrics).

Metrics are per-batch means, which the driver averages over an evaluation set; quantities
that are not means (perplexity) are derived from those averages by a summary function.
"""
import math

import jax.numpy as jnp
import optax


def classification(logits_BxC, batch):
  """Mean softmax cross-entropy against batch['label']; metrics: accuracy."""
  labels = batch["label"]
  loss = optax.softmax_cross_entropy_with_integer_labels(logits_BxC, labels).mean()
  return loss, {"accuracy": jnp.mean(jnp.argmax(logits_BxC, -1) == labels)}


def language_model(logits_BxTxV, batch):
  """Mean next-token cross-entropy: logits[:, t] predicts batch['tokens'][:, t + 1]. No metrics:
  perplexity belongs to a whole corpus (`with_perplexity`)."""
  targets = batch["tokens"][:, 1:]
  loss = optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV[:, :-1].astype(jnp.float32), targets).mean()
  return loss, {}


def with_perplexity(means: dict) -> dict:
  """Adds corpus perplexity exp(mean token CE) to evaluation means.

  (The mean of per-batch perplexities would overstate it: mean(exp(l)) >= exp(mean(l)).)
  """
  return {**means, "perplexity": math.exp(means["loss"])}
