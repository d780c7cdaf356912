"""Casts: the tensor itself, or in a narrower float type, optionally with an amax scale (fp8 recipes)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.compress import packing
from jaxcomp.compress.codecs.base import Codec, checked, compiled, num_entries, ratio
from jaxcomp.compress.codecs.wire import Dense, Narrow, Payload

_CAST_DTYPES = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
_FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")


@dataclasses.dataclass(frozen=True)
class Identity(Codec):
  """Sends the dense tensor: C(x) = x."""

  @checked
  @compiled
  def encode(self, x, key=None):
    return Payload(Dense(x), x.shape, x.dtype)

  @compiled
  def decode(self, payload):
    return payload.arrays.x

  def wire_bytes(self, shape, dtype):
    return num_entries(shape) * np.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Cast(Codec):
  """Sends x in a narrower float type: C(x) = float(dtype(x)).

  The narrow floats travel as their bit patterns (uint8 for fp8, uint16 for 16-bit), so no
  backend widens them on the wire (XLA:CPU moves f8 as f16 in a collective-permute).
  """
  dtype: str = "bfloat16"

  def __post_init__(self):
    if self.dtype not in _CAST_DTYPES:
      raise ValueError(f"Cast dtype must be one of {_CAST_DTYPES}, got {self.dtype!r}")

  @checked
  @compiled
  def encode(self, x, key=None):
    return Payload(Narrow(packing.as_bits(x.astype(self.dtype))), x.shape, x.dtype)

  @compiled
  def decode(self, payload):
    narrow = jax.lax.bitcast_convert_type(payload.arrays.bits, jnp.dtype(self.dtype))
    return narrow.astype(payload.dtype)

  def wire_bytes(self, shape, dtype):
    return num_entries(shape) * np.dtype(jnp.dtype(self.dtype)).itemsize


@dataclasses.dataclass(frozen=True)
class ScaledCast(Codec):
  """fp8 with an amax scale, as fp8 training recipes send tensors: C(x) = s * fp8(x / s).

  s = amax / FMAX per tensor (granularity="tensor") or per channel (last axis), amax = max|x|
  and FMAX the format's largest finite value (448 for e4m3fn, 57344 for e5m2), so the
  largest entry maps to FMAX and small ones (activation gradients) stay out of fp8's
  subnormals. The fp8 values travel as their uint8 bit patterns (as `Cast`), s in fp32:
  size + 4 bytes per scale. An all-zero scale group decodes to 0; a NaN makes its group NaN;
  +-inf decodes to +-inf and the other entries of its group to NaN (s is inf, as in
  MaxAbsQuant). fp32 scales hold amax / FMAX for any finite amax down to ~FMAX 2^-126 (about
  5e-36 for e4m3fn); below that s is subnormal, which XLA flushes to zero, and the group
  decodes to 0.
  """
  dtype: str = "float8_e4m3fn"
  granularity: str = "tensor"

  def __post_init__(self):
    if self.dtype not in _FP8_DTYPES:
      raise ValueError(f"ScaledCast dtype must be one of {_FP8_DTYPES}, got {self.dtype!r}")
    if self.granularity not in ("tensor", "channel"):
      raise ValueError(f"ScaledCast granularity must be 'tensor' or 'channel', got {self.granularity!r}")

  @property
  def fmax(self) -> float:
    return float(jnp.finfo(jnp.dtype(self.dtype)).max)

  def _axes(self, ndim):
    return tuple(range(ndim - 1)) if self.granularity == "channel" else None

  @checked
  @compiled
  def encode(self, x, key=None):
    x32 = x.astype(jnp.float32)
    s = jnp.max(jnp.abs(x32), axis=self._axes(x.ndim)) / self.fmax
    y = jnp.where(jnp.isinf(x32), jnp.sign(x32) * self.fmax, ratio(x32, s))
    narrow = y.astype(self.dtype)  # |y| <= FMAX up to fp32 rounding, which the cast rounds to FMAX
    return Payload(Narrow(packing.as_bits(narrow), packing.as_bits(s)), x.shape, x.dtype)

  @compiled
  def decode(self, payload):
    a = payload.arrays
    y = packing.from_bits(a.bits, jnp.dtype(self.dtype)).astype(jnp.float32)
    return (y * packing.from_bits(a.scale, jnp.float32)).astype(payload.dtype)  # beside an inf, y = 0 and 0 * inf = NaN

  def wire_bytes(self, shape, dtype):
    scales = shape[-1] if self.granularity == "channel" else 1
    return num_entries(shape) * np.dtype(jnp.dtype(self.dtype)).itemsize + 4 * scales
