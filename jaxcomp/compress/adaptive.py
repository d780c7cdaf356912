"""Token-level adaptive bit widths: outlier-heavy tokens get more bits (TAH-Quant's idea).

Rows are tokens (every position of the leading axes; the last axis is the features). Per row
the sender computes the peakiness p = max|x| / rms(x) (in [1, sqrt(F)]: a cheap kurtosis
proxy; large p means a few outliers stretch the max-abs scale). The ceil(`fraction` R) rows
of largest p are quantized with `high` bits, the rest with `low` bits, both by max-abs with
one scale per `group` features of a row (default: one per row). A fixed count of high rows,
not a threshold on p, keeps the payload a static size (exact `wire_bytes`); the choice
travels as an R-bit bitmap, the rows' codes in row order within each width (a width with no
rows, e.g. the low one of a single row, sends nothing).
"""
import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.arguments import is_number
from jaxcomp.compress import packing
from jaxcomp.compress.codecs import Codec, MaxAbsQuant, Payload, checked, compiled


class Mixed(NamedTuple):
  """TokenAdaptive's message: `bitmap`, which rows are high (R bits packed into uint8 [ceil(R / 8)]); `high` and
  `low`, the Quantized payloads of those rows in row order (None for a width with no rows)."""
  bitmap: jax.Array
  high: Payload | None = None
  low: Payload | None = None


def peakiness(rows: jax.Array) -> jax.Array:
  """max|x| / rms(x) per row of [R, F] (0 for an all-zero row)."""
  rows = rows.astype(jnp.float32)
  rms = jnp.sqrt(jnp.mean(jnp.square(rows), axis=-1))
  peak = jnp.max(jnp.abs(rows), axis=-1)
  return jnp.where(rms > 0, peak / jnp.where(rms > 0, rms, 1.0), 0.0)


@dataclasses.dataclass(frozen=True)
class TokenAdaptive(Codec):
  """ceil(fraction * R) rows (largest peakiness) in `high` bits, the others in `low` bits."""
  low: int = 3
  high: int = 4
  fraction: float = 0.25
  group: int | None = None  # features per scale; None: one scale per row
  stochastic: bool = False
  scale_dtype: str = "float32"
  grid: str | None = None  # MaxAbsQuant's grid and clip of both widths; None: each width's default
  clip: float | str | None = None

  def __post_init__(self):
    if not 2 <= self.low < self.high <= 16:
      raise ValueError(f"adaptive bit widths need 2 <= low < high <= 16, got low={self.low}, high={self.high}")
    if not is_number(self.fraction) or not 0 < self.fraction < 1:
      raise ValueError(f"adaptive fraction of high-bit tokens must be in (0, 1), got {self.fraction!r}")
    self.quantizer(self.low, 2)  # validates group, scale_dtype, grid and clip

  def quantizer(self, bits: int, features: int) -> MaxAbsQuant:
    return MaxAbsQuant(bits, "group", self.stochastic, self.scale_dtype, clip=self.clip, group=self.group or features,
                       grid=self.grid)

  def split(self, shape) -> tuple[int, int, int]:
    """(rows R, high rows, features F)."""
    r, f = int(np.prod(shape[:-1], dtype=np.int64)), shape[-1]
    if self.group is not None and f % self.group:
      raise ValueError(f"adaptive group={self.group} does not divide the {f} features of the last axis; "
                       f"pick a divisor of {f}")
    return r, min(r, math.ceil(round(self.fraction * r, 6))), f

  def _parts(self, r, n_high, is_high):
    """(name, bits, rows) of each width that has rows."""
    parts = (("high", self.high, self._rows_of(is_high, n_high)),
             ("low", self.low, self._rows_of(~is_high, r - n_high)))
    return [(name, bits, rows) for name, bits, rows in parts if rows.shape[0]]

  def _rows_of(self, mask, count):
    return jnp.nonzero(mask, size=count, fill_value=0)[0]

  @checked
  @compiled
  def encode(self, x, key=None) -> Payload:
    r, n_high, f = self.split(x.shape)
    rows = x.reshape(r, f)
    chosen = jax.lax.top_k(peakiness(rows), n_high)[1]
    is_high = jnp.zeros((r,), bool).at[chosen].set(True)
    keys = dict(zip(("high", "low"), jax.random.split(key) if key is not None else (None, None)))
    return Payload(Mixed(packing.pack_mask(is_high[None])[0],
                         **{name: self.quantizer(bits, f).encode(rows[part], keys[name])
                            for name, bits, part in self._parts(r, n_high, is_high)}), x.shape, x.dtype)

  @compiled
  def decode(self, payload: Payload) -> jax.Array:
    r, n_high, f = self.split(payload.shape)
    a = payload.arrays
    is_high = packing.unpack_mask(a.bitmap[None], r)[0]
    rows = jnp.zeros((r, f), payload.dtype)
    for name, bits, part in self._parts(r, n_high, is_high):
      rows = rows.at[part].set(self.quantizer(bits, f).decode(getattr(a, name)))
    return rows.reshape(payload.shape)

  def wire_bytes(self, shape, dtype) -> int:
    r, n_high, f = self.split(shape)
    return (-(-r // 8) + self.quantizer(self.high, f).wire_bytes((n_high, f), dtype)
            + self.quantizer(self.low, f).wire_bytes((r - n_high, f), dtype))
