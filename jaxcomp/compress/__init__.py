"""The papers' math: payload packing, codecs, rotation, adaptive bits, schemes with state, the
custom_vjp boundary between stages, and the spec strings that name them."""
