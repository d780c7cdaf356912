"""Loss functions with the executors' signature: (outputs, microbatch) -> (loss, metrics)."""
import jax.numpy as jnp
import optax


def classification(logits_BxC, batch):
  """Mean softmax cross-entropy against batch['label']; metrics: accuracy."""
  labels = batch["label"]
  loss = optax.softmax_cross_entropy_with_integer_labels(logits_BxC, labels).mean()
  return loss, {"accuracy": jnp.mean(jnp.argmax(logits_BxC, -1) == labels)}


def language_model(logits_BxTxV, batch):
  """Mean next-token cross-entropy: logits[:, t] predicts batch['tokens'][:, t + 1].

  Metrics: perplexity exp(loss) of this batch (average losses, not perplexities, across
  batches for a corpus perplexity).
  """
  targets = batch["tokens"][:, 1:]
  loss = optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV[:, :-1].astype(jnp.float32), targets).mean()
  return loss, {"perplexity": jnp.exp(loss)}
