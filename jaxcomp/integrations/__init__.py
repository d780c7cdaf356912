"""Integrations: jaxcomp inside other libraries' pipelines (the top layer: each module imports jaxcomp's public API
and the library it integrates; nothing in jaxcomp imports them). `maxtext`: MaxText's pipeline."""
