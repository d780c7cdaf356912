"""jaxcomp: compressed activations and activation-gradients for pipeline training."""
