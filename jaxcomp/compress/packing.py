"""Dense bit packing of unsigned integer codes into uint8 streams: N codes of width b occupy exactly
ceil(N*b/8) bytes for any b in 1..16.

Widths 8 and 16 are the codes' bytes. Other widths go in groups of eight codes, whose 8*b bits fill b
bytes little-endian (code j of a group in bits [j*b, (j+1)*b)). The G = N // 8 full groups are planar:
group g holds codes g, G+g, ..., 7G+g and its byte k is stream byte k*G + g; the N - 8G codes left make
one last group, cut to the bytes they fill. Planes are contiguous slices, so a TPU packs them without
relaying out a minor axis of 8 codes (that layout took XLA:TPU 217 s, 2.7 GB of host memory and 834 MB of
HBM traffic to pack 6.3M 4-bit codes; planes: 4 s, 0.5 GB, 6 MB). The functions are jitted with their sizes
static, as `jax.numpy`'s are: an eager call compiles one program, not one per op.
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.arguments import is_integer


_WORDS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}  # unsigned word of each width in bytes


def as_bits(x):
  """A float array as the unsigned integers of its bit pattern (same width); others unchanged.

  What travels in a message: no backend may widen the values (XLA:CPU moves f8 as f16 in a
  collective-permute) or narrow them (XLA:TPU hoists a receiver's f32 -> bf16 cast above the
  collective-permute), so the bytes on the wire are the bytes counted.
  """
  if not jnp.issubdtype(x.dtype, jnp.floating):
    return x
  return jax.lax.bitcast_convert_type(x, _WORDS[x.dtype.itemsize])


def from_bits(bits, dtype):
  """Inverse of `as_bits` for an array that was of `dtype`."""
  return bits if bits.dtype == dtype else jax.lax.bitcast_convert_type(bits, dtype)


def _words(x, width: int):
  """An array's bit pattern as a flat array of `width`-byte unsigned words (its itemsize a multiple of `width`)."""
  return jax.lax.bitcast_convert_type(x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x, _WORDS[width]).reshape(-1)


def _unwords(words, like):
  """Inverse of `_words` for an array shaped and typed as `like`."""
  ratio = jnp.dtype(like.dtype).itemsize // words.dtype.itemsize
  bits = words.reshape(*like.shape, ratio) if ratio > 1 else words.reshape(like.shape)
  if like.dtype == jnp.bool_:
    return bits.astype(jnp.bool_)
  return jax.lax.bitcast_convert_type(bits, like.dtype)


def join(arrays) -> jnp.ndarray:
  """Several arrays' bit patterns as one flat buffer of unsigned words of their narrowest element width: its
  bytes are exactly theirs (no padding), array after array, each row-major."""
  width = min(jnp.dtype(a.dtype).itemsize for a in arrays)
  return jnp.concatenate([_words(a, width) for a in arrays])


def split(buffer, like) -> list:
  """Inverse of `join`: the arrays shaped and typed as the sequence `like` (arrays or ShapeDtypeStructs)."""
  ends = np.cumsum([0] + [int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize // buffer.dtype.itemsize for a in like])
  return [_unwords(buffer[int(start):int(end)], a) for start, end, a in zip(ends[:-1], ends[1:], like)]


def packed_size(n: int, bits: int) -> int:
  """Bytes needed for `n` codes of width `bits`: ceil(n*bits/8)."""
  return -(-n * bits // 8)


def _pack_groups(planes_8xG, bits: int):
  """Group g = (planes[0, g], ..., planes[7, g]) -> its `bits` bytes, as [bits, G] (byte k of group g at [k, g])."""
  words = [jnp.zeros(planes_8xG.shape[1], jnp.uint32) for _ in range(-(-8 * bits // 32))]
  for j in range(8):
    word, offset = divmod(j * bits, 32)
    words[word] = words[word] | (planes_8xG[j] << offset)
    if offset + bits > 32:
      words[word + 1] = words[word + 1] | (planes_8xG[j] >> (32 - offset))
  return jnp.stack([(w >> (8 * k)) & 0xFF for w in words for k in range(4)][:bits]).astype(jnp.uint8)


def _unpack_groups(byte_BxG, bits: int):
  """Inverse of `_pack_groups`: [bits, G] bytes -> the [8, G] planes of codes."""
  byte_BxG = jnp.pad(byte_BxG.astype(jnp.uint32), ((0, (-bits) % 4), (0, 0)))
  words = [sum(byte_BxG[4 * w + k] << (8 * k) for k in range(4)) for w in range(byte_BxG.shape[0] // 4)]
  planes = []
  for j in range(8):
    word, offset = divmod(j * bits, 32)
    c = words[word] >> offset
    if offset + bits > 32:
      c = c | (words[word + 1] << (32 - offset))
    planes.append(c & ((1 << bits) - 1))
  return jnp.stack(planes)


def code_dtype(bits: int):
  """The narrowest unsigned dtype that holds a code of `bits` bits (uint8 or uint16)."""
  return jnp.uint8 if bits <= 8 else jnp.uint16


def _laid_out(codes):
  """`codes` materialised as they are, so that XLA cannot move a reshape (a flattening) across them into the
  computation that makes or uses them: XLA:TPU lays a flat array out unlike a tiled one, and with the flattening
  moved up to the codec's fp32 inputs it relaid out each of them (a grouped max-abs encode compiled for v5e: 8.0
  passes over its input, 1.0 with the narrow codes kept). On GPU they stay unmaterialised: XLA:GPU fuses the
  unpacking into the dequantization that reads it (a 4-bit max-abs decode compiled for H100: 1.44 passes kept,
  1.00 fused); on CPU they are kept (the grouped default's encode about 5% faster)."""
  identity = lambda c: c
  return jax.lax.platform_dependent(codes, cuda=identity, rocm=identity, default=jax.lax.optimization_barrier)


@functools.partial(jax.jit, static_argnames=("bits",))
def pack(codes: jnp.ndarray, bits: int) -> jnp.ndarray:
  """Packs codes in [0, 2**bits) (any shape, read in C order: N entries) into uint8 [packed_size(N, bits)] (the
  module's layout); they are narrowed to `code_dtype(bits)` before they are flattened (`_laid_out`)."""
  codes_N = _laid_out(codes.astype(code_dtype(bits))).reshape(-1).astype(jnp.uint32)
  if bits == 8:
    return codes_N.astype(jnp.uint8)
  if bits == 16:
    return jnp.stack([codes_N & 0xFF, codes_N >> 8], axis=1).astype(jnp.uint8).reshape(-1)
  n = codes_N.shape[0]
  full = n // 8 * 8
  body = _pack_groups(codes_N[:full].reshape(8, -1), bits).reshape(-1)
  tail = _pack_groups(jnp.pad(codes_N[full:], (0, 8 - (n - full))).reshape(8, 1), bits).reshape(-1)
  return jnp.concatenate([body, tail[: packed_size(n - full, bits)]])


@functools.partial(jax.jit, static_argnames=("bits", "shape"))
def unpack(packed: jnp.ndarray, bits: int, shape) -> jnp.ndarray:
  """Inverse of `pack`: uint8 stream -> codes of `shape` (a tuple, or N for a flat [N]) in `code_dtype(bits)`,
  narrowed before they are reshaped (`_laid_out`)."""
  shape = (shape,) if isinstance(shape, int) else tuple(shape)
  return _laid_out(_unpacked(packed.astype(jnp.uint32), bits, math.prod(shape)).astype(code_dtype(bits))).reshape(shape)


def _unpacked(packed, bits: int, n: int):
  """uint32 stream -> uint32 codes [n]."""
  if bits == 8:
    return packed[:n]
  if bits == 16:
    pairs = packed.reshape(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 8))[:n]
  groups = n // 8
  body = _unpack_groups(packed[: bits * groups].reshape(bits, groups), bits).reshape(-1)
  tail = jnp.pad(packed[bits * groups:], (0, bits - packed_size(n - 8 * groups, bits)))
  return jnp.concatenate([body, _unpack_groups(tail.reshape(bits, 1), bits).reshape(-1)[: n - 8 * groups]])


CHUNK = 1024  # positions per row of the TPU's gathers (8 x 128 lanes)


def _in_chunks(a_RxN: jnp.ndarray, width: int) -> jnp.ndarray:
  """[R * ceil(N / width), width]: each row cut into chunks of `width`, the last padded with zeros."""
  return jnp.pad(a_RxN, ((0, 0), (0, (-a_RxN.shape[1]) % width))).reshape(-1, width)


def _byte_at_each_position(a_RxB: jnp.ndarray, f: int, top: int = 255, width: int = CHUNK) -> jnp.ndarray:
  """[R, f]: a[:, i // 8] at column i (the entry of the byte holding position i), for entries in [0, top], gathered
  a byte at a time (XLA:TPU gathers 32-bit entries through the 403 MB below, bytes through none) within chunks of
  `width` positions (CHUNK, or a row's own last axis; gathers along the whole row cost it 3 copies of the row in a
  transposed layout)."""
  r = a_RxB.shape[0]
  chunks = _in_chunks(a_RxB, width // 8)
  at = jnp.arange(width, dtype=jnp.int32) >> 3
  if top < 256:
    out = jnp.take(chunks, at, axis=1)
  else:
    out = jnp.zeros((chunks.shape[0], width), jnp.int32)
    for k in range(-(-top.bit_length() // 8)):
      byte = ((chunks >> (8 * k)) & 0xFF).astype(jnp.uint8)
      out = out | (jnp.take(byte, at, axis=1).astype(jnp.int32) << (8 * k))
  return out.reshape(r, -1)[:, :f]


MASK_LAYOUTS = ("platform", "gathers", "views")  # `how` of the mask functions: by the platform compiled for, or forced


def _lanes_or_bytes(how: str, on_tpu, elsewhere, *args):
  """`on_tpu(*args)` ("gathers") where the program is compiled for a TPU, `elsewhere(*args)` ("views") on other
  platforms (`how` "platform"), or the one `how` names. A TPU lays an
  array's minor axis out on its 128 lanes, so the [R, F/8, 8] views of a mask (a byte's 8 bits as the minor axis)
  took GPT-2 small's [8, 786432] TopK mask through 403 MB of temporaries and 812 MB of HBM traffic per pack or
  unpack, and its ranks through 1.7 GB; the TPU versions gather each position's byte within chunks of CHUNK
  positions instead (v5e: pack, unpack and ranks one pass over their bytes, no temporaries; gathers along the whole
  row took pack through 96 MiB and 5 passes, ranks through 20 MiB and 2.7). On a CPU the views are the faster ones
  (decode ~1.5x)."""
  if how not in MASK_LAYOUTS:
    raise ValueError(f"how must be one of {MASK_LAYOUTS}, got {how!r}")
  if how != "platform":
    return (on_tpu if how == "gathers" else elsewhere)(*args)
  return jax.lax.platform_dependent(*args, tpu=on_tpu, default=elsewhere)


@functools.partial(jax.jit, static_argnames=("how",))
def pack_mask(mask_RxF: jnp.ndarray, how: str = "platform") -> jnp.ndarray:
  """Bool [R, F] -> uint8 [R, ceil(F/8)] bitmask, one row at a time: bit j of byte b is position 8b + j. Rows
  [R, A, B] (positions i B + j, B % 8 == 0) are packed along B, so the mask keeps its own layout."""
  if mask_RxF.ndim == 3:
    r, a, b = mask_RxF.shape
    if a > 1 and b % 8:
      raise ValueError(f"rows of [{a}, {b}] pack along their last axis only in whole bytes (B % 8 == 0)")
    return pack_mask(mask_RxF.reshape(r * a, b), how).reshape(r, -1)
  r, f = mask_RxF.shape
  m = jnp.pad(mask_RxF.astype(jnp.uint8), ((0, 0), (0, (-f) % 8)))

  def by_gathers(m):  # within chunks of CHUNK positions: gathers along the whole row cost a TPU 96 MiB and 5 passes
    chunks = _in_chunks(m, CHUNK)
    first = 8 * jnp.arange(CHUNK // 8, dtype=jnp.int32)  # each byte's first position in its chunk
    packed = jnp.zeros((chunks.shape[0], CHUNK // 8), jnp.uint8)
    for j in range(8):
      packed = packed | (jnp.take(chunks, first + j, axis=1) << j)
    return packed.reshape(r, -1)[:, : m.shape[1] // 8]

  def by_bytes(m):
    return jnp.sum(m.astype(jnp.uint32).reshape(r, -1, 8) << jnp.arange(8, dtype=jnp.uint32), axis=2).astype(jnp.uint8)

  return _lanes_or_bytes(how, by_gathers, by_bytes, m)


@functools.partial(jax.jit, static_argnames=("f", "how"))
def unpack_mask(packed_RxF8: jnp.ndarray, f: int, how: str = "platform") -> jnp.ndarray:
  """uint8 [R, ceil(F/8)] -> bool [R, F]."""

  def by_gathers(packed):
    bit = jnp.arange(f, dtype=jnp.uint32) & 7
    return ((_byte_at_each_position(packed, f).astype(jnp.uint32) >> bit) & 1).astype(bool)

  def by_bytes(packed):
    bits = (packed.astype(jnp.uint32)[..., None] >> jnp.arange(8, dtype=jnp.uint32)) & 1
    return bits.reshape(packed.shape[0], -1)[:, :f].astype(bool)

  return _lanes_or_bytes(how, by_gathers, by_bytes, packed_RxF8)


def _prefix_sum(a_RxN: jnp.ndarray) -> jnp.ndarray:
  """Inclusive prefix sums along rows. XLA:CPU runs `associative_scan`'s strided halvings ~2x faster than
  `cumsum`; on a TPU those strided slices of the lane axis took XLA:TPU minutes to compile and millions of
  instructions (GPT-2 small's mask ranks: 116 s, 1.7 GB of HBM traffic), where `cumsum` is a reduce-window it
  rewrites to a scan of its own."""
  return jax.lax.platform_dependent(a_RxN, cpu=lambda a: jax.lax.associative_scan(jnp.add, a, axis=1),
                                    default=lambda a: jnp.cumsum(a, axis=1))


def _set_bits_before(packed_RxF8: jnp.ndarray):
  """Int32 [R, F/8] each: set bits per byte, and set bits in the bytes before it (exclusive prefix sum)."""
  per_byte = jax.lax.population_count(packed_RxF8.astype(jnp.int32))
  return per_byte, _prefix_sum(per_byte) - per_byte


def _gathered_ranks(packed_RxB: jnp.ndarray, before_RxB: jnp.ndarray, f: int, top: int, width: int = CHUNK):
  """(int32 ranks, uint32 bytes), [R, f] each: at each position of a row the mask bits set before it (`before` of
  its byte, at most `top`, plus the bits below it in its byte) and the byte holding it, gathered within chunks of
  `width` positions (`_byte_at_each_position`)."""
  byte = _byte_at_each_position(packed_RxB, f, width=width).astype(jnp.uint32)
  low_bits = (jnp.uint32(1) << (jnp.arange(f, dtype=jnp.uint32) & 7)) - 1  # the bits below each position's
  ranks = _byte_at_each_position(before_RxB, f, top=top, width=width)
  return ranks + jax.lax.population_count(byte & low_bits).astype(jnp.int32), byte


@functools.partial(jax.jit, static_argnames=("f", "how"))
def mask_ranks(packed_RxF8: jnp.ndarray, f: int, how: str = "platform") -> jnp.ndarray:
  """Int32 [R, F]: how many mask bits are set before each position (exclusive prefix count).

  rank(8b + j) = sum of popcount(byte) over bytes < b + popcount(byte b & (2^j - 1)): a prefix
  sum over the F/8 bytes, the rest elementwise.
  """
  _, before = _set_bits_before(packed_RxF8)

  def by_gathers(packed, before):
    return _gathered_ranks(packed, before, f, top=f)[0]

  def by_bytes(packed, before):
    low_bits = (jnp.uint32(1) << jnp.arange(8, dtype=jnp.uint32)) - 1
    within = jax.lax.population_count(packed.astype(jnp.uint32)[..., None] & low_bits).astype(jnp.int32)
    return (before[..., None] + within).reshape(packed.shape[0], -1)[:, :f]

  return _lanes_or_bytes(how, by_gathers, by_bytes, packed_RxF8, before)


# BIT_POSITIONS[v, i]: position of the i-th set bit of the byte value v (0 past its popcount)
BIT_POSITIONS = np.array([[j for j in range(8) if v >> j & 1] + [0] * (8 - bin(v).count("1")) for v in range(256)],
                         np.int32)


@functools.partial(jax.jit, static_argnames=("f", "k"))
def compact(packed_RxF8: jnp.ndarray, f: int, k: int, operand_RxF=None) -> jnp.ndarray:
  """[R, k]: operand ([R, F] or [R, A, B]: `at_positions`) at the first k set positions of each row, in position
  order (stream compaction).

  operand None: the positions themselves (int32); slots past a row's set count hold 0. Found
  byte-wise: with c(b) the set bits in bytes before byte b, each byte b marks slot c(b) with b
  (the largest mark wins: an empty byte shares its slot with the next non-empty one, which is
  larger); a running max over the k slots gives each slot's byte, `BIT_POSITIONS` the bit within
  it. Work: F/8 scatters and O(k) gathers per row, no pass of F scatters. c(b) never decreases
  along a row, so the scatter's indices are sorted (said to XLA: XLA:TPU on v6e sorts them
  otherwise, a sort of F/8 entries per row).
  """
  r, num_bytes = packed_RxF8.shape
  bytes_RxB = packed_RxF8.astype(jnp.int32)
  per_byte, before = _set_bits_before(packed_RxF8)
  rows = jnp.arange(r)[:, None]
  marks = jnp.full((r, k), -1, jnp.int32).at[rows, before].max(
      jnp.broadcast_to(jnp.arange(num_bytes, dtype=jnp.int32), (r, num_bytes)), mode="drop",
      indices_are_sorted=True)
  byte = jnp.maximum(jax.lax.cummax(marks, axis=1), 0)
  rank = jnp.arange(k, dtype=jnp.int32) - jnp.take_along_axis(before, byte, axis=1)
  value = jnp.take_along_axis(bytes_RxB, byte, axis=1)
  bit = jnp.asarray(BIT_POSITIONS)[value, jnp.clip(rank, 0, 7)]
  filled = jnp.arange(k) < jnp.sum(per_byte, axis=1, keepdims=True)
  positions = jnp.where(filled, 8 * byte + bit, 0)
  if operand_RxF is None:
    return positions
  return jnp.where(filled, at_positions(operand_RxF, positions), jnp.zeros((), operand_RxF.dtype))


def at_positions(operand, positions_RxK: jnp.ndarray) -> jnp.ndarray:
  """[R, K]: each row of `operand` ([R, F], or [R, A, B] with position i B + j at (i, j)) at its K positions. Rows
  [R, A, B] are gathered from in that shape on TPU (`in_row_shape`; flattened, a TPU relays x out: a pass to read
  it and one to write it), flattened elsewhere (XLA:GPU's gather of flat positions moves less)."""
  flat = lambda a, p: jnp.take_along_axis(a.reshape(a.shape[0], -1), p, axis=1)
  if operand.ndim == 2:
    return flat(operand, positions_RxK)
  return jax.lax.platform_dependent(operand, positions_RxK, tpu=in_row_shape, default=flat)


def in_row_shape(operand_RxAxB: jnp.ndarray, positions_RxK: jnp.ndarray) -> jnp.ndarray:
  """[R, K]: each row [A, B] of the operand at its K positions p, entry (p // B, p % B)."""
  rows, b = jnp.arange(operand_RxAxB.shape[0])[:, None], operand_RxAxB.shape[2]
  return operand_RxAxB[rows, positions_RxK // b, positions_RxK % b]


@functools.partial(jax.jit, static_argnames=("f",))
def expand(packed_RxF8: jnp.ndarray, f: int, values_RxK: jnp.ndarray) -> jnp.ndarray:
  """Inverse of `compact`: [R, F] with the k values at the set positions in order, 0 elsewhere."""
  k = values_RxK.shape[1]
  slots = jnp.minimum(mask_ranks(packed_RxF8, f), k - 1)
  gathered = jnp.take_along_axis(values_RxK, slots, axis=1)
  return jnp.where(unpack_mask(packed_RxF8, f), gathered, jnp.zeros((), values_RxK.dtype))


@functools.partial(jax.jit, static_argnames=("a", "b"))
def expand_rows(packed_RxF8: jnp.ndarray, a: int, b: int, values_RxK: jnp.ndarray) -> jnp.ndarray:
  """`expand` into rows [A, B] (position i B + j at (i, j)): [R, A, B]. On TPU built in that shape
  (`expand_in_row_shape`; built flat, [R, F] is relaid out to [R, A, B]: on v5e at GPT-2 small's shape 5.3 output
  sizes of traffic, against 1.8), elsewhere `expand`, reshaped."""
  flat = lambda packed, values: expand(packed, a * b, values).reshape(values.shape[0], a, b)
  if a == 1 or b % 8:
    return flat(packed_RxF8, values_RxK)
  return jax.lax.platform_dependent(packed_RxF8, values_RxK, default=flat,
                                    tpu=lambda packed, values: expand_in_row_shape(packed, a, b, values))


def expand_in_row_shape(packed_RxF8: jnp.ndarray, a: int, b: int, values_RxK: jnp.ndarray) -> jnp.ndarray:
  """`expand` built in rows [A, B] (B % 8 == 0): each row of B positions reads its B/8 bytes and their ranks
  (`_gathered_ranks` of width B), and the values are gathered at [R, A, B] slots."""
  r, k = values_RxK.shape
  _, before = _set_bits_before(packed_RxF8)
  by_row = lambda q: q.reshape(r * a, b // 8)
  rank, byte = _gathered_ranks(by_row(packed_RxF8), by_row(before), b, top=a * b, width=b)
  gathered = values_RxK[jnp.arange(r)[:, None, None], jnp.minimum(rank, k - 1).reshape(r, a, b)]
  is_set = (((byte >> (jnp.arange(b, dtype=jnp.uint32) & 7)) & 1) > 0).reshape(r, a, b)
  return jnp.where(is_set, gathered, jnp.zeros((), values_RxK.dtype))


def check_bits(bits) -> int:
  """Validates a code width: an int in 1..16."""
  if not is_integer(bits) or not 1 <= bits <= 16:
    raise ValueError(f"bits must be an integer in 1..16, got {bits!r}")
  return int(bits)
