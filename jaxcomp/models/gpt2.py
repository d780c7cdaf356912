"""GPT-2 (Radford et al.) in Flax, numerically matching Hugging Face's, cut into stages.

Block: h = x + attn(ln_1(x)); y = h + mlp(ln_2(h)), causal attention softmax(q k^T / sqrt(d_h)),
mlp = c_proj(gelu_tanh(c_fc(.))), LayerNorm eps 1e-5, logits = ln_f(x) wte^T (tied head).
Stage 0 embeds tokens (wte[tokens] + wpe[:T]); the last stage has ln_f and the head. A
stage's blocks run as one `nn.scan` over their stacked parameters (`params["blocks"]`, leaves
[n_blocks, ...], block `first_block + i` at index i), as MaxText's `scan_layers`: the program
holds one block body whatever the depth, so GPT-2 XL compiles in seconds rather than one
unrolled copy per block.

Outliers (`outlier_channels`, `outlier_scale`, `massive`): pretrained transformers' residual streams
carry a few channels tens to hundreds of times larger than the rest (Dettmers et al. 2022, LLM.int8:
systematic outlier features in a handful of dimensions, across tokens) and a few "massive" activations,
thousands of times the median, at fixed channels of the first token (Sun et al. 2024: constant, acting as
biases). A model trained from scratch for a few hundred steps grows neither. With these fields, what a
stage hands to the next is the residual r carried as r * g + m: g = `outlier_scale` on `outlier_channels`
channels spread over the width (1 elsewhere), m = `massive` at token 0 in the first two of them (0
elsewhere); the next stage reads (x - m) / g back. The function is the same model's (exactly for a
power-of-two g and m = 0, up to fp32 rounding of m otherwise): only the tensors that cross the
boundaries have the outlier pattern, so a compressor's error on them is what changes.
"""
import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.arguments import is_integer
from jaxcomp.pipeline import FlaxStage


@dataclasses.dataclass(frozen=True)
class GPT2Config:
  vocab_size: int = 50257
  n_positions: int = 1024
  n_embd: int = 768
  n_layer: int = 12
  n_head: int = 12
  dropout: float = 0.1  # HF resid_pdrop = embd_pdrop = attn_pdrop
  dtype: str = "float32"  # compute dtype; parameters stay fp32
  remat: str = "block"  # what a block's backward saves: "block" its input only, "dots" matmul outputs, "none" all
  outlier_channels: int = 0  # channels carried times outlier_scale across stage boundaries (module doc)
  outlier_scale: float = 1.0
  massive: float = 0.0  # added at token 0 to the first two outlier channels across stage boundaries

  def __post_init__(self):
    if not 0 <= self.outlier_channels <= self.n_embd:
      raise ValueError(f"outlier_channels must be in 0..{self.n_embd} (the width), got {self.outlier_channels}")
    if not (math.isfinite(self.outlier_scale) and self.outlier_scale > 0 and math.isfinite(self.massive)):
      raise ValueError(f"outlier_scale must be a finite positive number and massive finite, got "
                       f"{self.outlier_scale} and {self.massive}")
    if self.massive and self.outlier_channels < 2:
      raise ValueError(f"massive={self.massive} sits in two outlier channels: give outlier_channels >= 2")

  def outliers(self) -> np.ndarray:
    """The outlier channels: `outlier_channels` indices spread evenly over the width."""
    n = self.outlier_channels
    return (np.arange(n) * self.n_embd) // max(n, 1) + self.n_embd // (2 * max(n, 1))

  def to_boundary(self, r_BxTxD):
    """What crosses a stage boundary for the residual r: r * g + m (module doc); r itself without outliers."""
    if not self.outlier_channels:
      return r_BxTxD
    gain, bias = self._boundary_terms(r_BxTxD.shape[1])
    return (r_BxTxD * gain + bias).astype(r_BxTxD.dtype)

  def from_boundary(self, x_BxTxD):
    """Inverse of `to_boundary`: (x - m) / g."""
    if not self.outlier_channels:
      return x_BxTxD
    gain, bias = self._boundary_terms(x_BxTxD.shape[1])
    return ((x_BxTxD - bias) / gain).astype(x_BxTxD.dtype)

  def _boundary_terms(self, t):
    channels = self.outliers()
    gain = np.ones(self.n_embd, np.float32)
    gain[channels] = self.outlier_scale
    bias = np.zeros((t, self.n_embd), np.float32)
    bias[0, channels[:2]] = self.massive
    return jnp.asarray(gain), jnp.asarray(bias)

  @classmethod
  def small(cls, **kw):
    return cls(**kw)

  @classmethod
  def medium(cls, **kw):
    return cls(n_embd=1024, n_layer=24, n_head=16, **kw)

  @classmethod
  def large(cls, **kw):
    return cls(n_embd=1280, n_layer=36, n_head=20, **kw)

  @classmethod
  def xl(cls, **kw):
    return cls(n_embd=1600, n_layer=48, n_head=25, **kw)

  @classmethod
  def tiny(cls, **kw):
    """For tests and offline runs: 4 blocks of width 64 over a byte-level vocabulary."""
    return cls(**{"vocab_size": 257, "n_positions": 256, "n_embd": 64, "n_layer": 4, "n_head": 4, **kw})


_LN = dict(epsilon=1e-5)
_REMAT = {"block": jax.checkpoint_policies.nothing_saveable, "dots": jax.checkpoint_policies.dots_saveable,
          "none": None}
_INIT = nn.initializers.normal(0.02)


class Block(nn.Module):
  cfg: GPT2Config

  @nn.compact
  def __call__(self, x_BxTxD, train: bool):
    cfg = self.cfg
    b, t, d = x_BxTxD.shape
    hd = d // cfg.n_head
    drop = lambda y: nn.Dropout(cfg.dropout, deterministic=not train)(y)
    dense = lambda n, name: nn.Dense(n, kernel_init=_INIT, dtype=cfg.dtype, name=name)

    h = nn.LayerNorm(**_LN, dtype=cfg.dtype, name="ln_1")(x_BxTxD)
    qkv = dense(3 * d, "c_attn")(h)
    q, k, v = (a.reshape(b, t, cfg.n_head, hd) for a in jnp.split(qkv, 3, axis=-1))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(hd).astype(jnp.float32)
    causal = jnp.tril(jnp.ones((t, t), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(jnp.float32).min), axis=-1)
    probs = drop(probs.astype(cfg.dtype))
    attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d)
    x = x_BxTxD + drop(dense(d, "c_proj")(attn))

    h = nn.LayerNorm(**_LN, dtype=cfg.dtype, name="ln_2")(x)
    h = dense(d, "mlp_c_proj")(nn.gelu(dense(4 * d, "mlp_c_fc")(h), approximate=True))
    return x + drop(h)


class GPT2Stage(nn.Module):
  """Blocks [first_block, first_block + num_blocks), with the embedding and/or head if at an end."""
  cfg: GPT2Config
  first_block: int
  num_blocks: int
  embed: bool
  head: bool

  @nn.compact
  def __call__(self, x, train: bool = False):
    cfg = self.cfg
    if self.embed:
      wte = self.param("wte", _INIT, (cfg.vocab_size, cfg.n_embd))
      wpe = self.param("wpe", nn.initializers.normal(0.01), (cfg.n_positions, cfg.n_embd))
      x = (wte[x] + wpe[: x.shape[1]]).astype(cfg.dtype)
      x = nn.Dropout(cfg.dropout, deterministic=not train)(x)
    else:
      x = cfg.from_boundary(x)
    block = nn.remat(Block, static_argnums=(2,), policy=_REMAT[cfg.remat]) if cfg.remat != "none" else Block
    scanned = nn.scan(lambda block, x, _: (block(x, train), None), variable_axes={"params": 0},
                      split_rngs={"params": True, "dropout": True}, length=self.num_blocks)
    x, _ = scanned(block(cfg, name="blocks"), x, None)
    if self.head:
      x = nn.LayerNorm(**_LN, dtype=cfg.dtype, name="ln_f")(x)
      wte = wte if self.embed else self.param("wte", _INIT, (cfg.vocab_size, cfg.n_embd))
      x = jnp.einsum("btd,vd->btv", x, wte.astype(cfg.dtype))
      return x
    return cfg.to_boundary(x)


def block_splits(n_layer: int, num_stages: int, cuts=None) -> list[tuple[int, int]]:
  """(first block, block count) per stage. `cuts` = last block index of every stage but the last;
  by default blocks split evenly (GPT-2 small, 4 stages: cuts after blocks 2, 5, 8)."""
  if not is_integer(num_stages) or not 1 <= num_stages <= n_layer:
    raise ValueError(f"num_stages must be an integer in 1..{n_layer} (n_layer), got {num_stages!r}")
  if cuts is None:
    sizes = [n_layer // num_stages + (s < n_layer % num_stages) for s in range(num_stages)]
    cuts = [sum(sizes[: s + 1]) - 1 for s in range(num_stages - 1)]
  cuts = list(cuts)
  out_of_range = bool(cuts) and (cuts[0] < 0 or cuts[-1] > n_layer - 2)
  if len(cuts) != num_stages - 1 or cuts != sorted(set(cuts)) or out_of_range:
    raise ValueError(f"cuts must be {num_stages - 1} increasing block indices in 0..{n_layer - 2}, got {cuts}")
  bounds = [-1, *cuts, n_layer - 1]
  return [(bounds[s] + 1, bounds[s + 1] - bounds[s]) for s in range(num_stages)]


def gpt2_stages(cfg: GPT2Config, num_stages: int = 4, cuts=None) -> tuple[FlaxStage, ...]:
  """GPT-2 as pipeline stages: embedding on the first, ln_f and the tied head on the last."""
  splits = block_splits(cfg.n_layer, num_stages, cuts)
  last = num_stages - 1
  return tuple(FlaxStage(GPT2Stage(cfg, first, n, embed=s == 0, head=s == last))
               for s, (first, n) in enumerate(splits))


def gpt2_tied(num_stages: int) -> tuple:
  """The embedding on stage 0 and the head's copy on the last stage stay equal (grads summed)."""
  return () if num_stages == 1 else (((0, ("wte",)), (num_stages - 1, ("wte",))),)
