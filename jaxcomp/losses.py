"""Loss functions with the executors' signature: (outputs, microbatch) -> (loss, metrics)."""
import jax.numpy as jnp
import optax


def classification(logits_BxC, batch):
  """Mean softmax cross-entropy against batch['label']; metrics: accuracy."""
  labels = batch["label"]
  loss = optax.softmax_cross_entropy_with_integer_labels(logits_BxC, labels).mean()
  return loss, {"accuracy": jnp.mean(jnp.argmax(logits_BxC, -1) == labels)}
