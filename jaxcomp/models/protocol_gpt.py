"""Protocol NanoGPT's GPT (Pluralis Research's benchmark of pipeline training over WAN links) in Flax, cut into stages.

The architecture of the benchmark's `train_gpt.py` (github PluralisResearch/ProtocolNanoGPT, adapted from
modded-nanogpt), read there and written anew:

    x = rms(wte[tokens])                                          # stage 0: the embedding, then RMSNorm with gains
    block: h = x + proj(attn(rms(x)));  y = h + mlp_proj(relu(fc(rms(h)))^2)
    attn: q, k, v = x Wq + bq, ...  per head (head_dim wide); q, k = rms(q), rms(k) (no gains);
          rotary on q, k; causal softmax(0.12 q k^T) v
    logits = 15 z / sqrt(z^2 + 15^2),  z = rms(x) Wh + bh           # last stage: RMSNorm, the head, a soft cap

Every linear layer has a bias; the MLP is 4x wide; the embedding and head are separate matrices (untied); there is
no position embedding and no dropout. Rotary is half-truncated: of a head's head_dim/2 frequency pairs the first
head_dim/4 have angular frequencies (1/1024)^(i / (head_dim/4 - 1)) and the rest 0 (those channels are not
rotated); dimension i pairs with i + head_dim/2. RMSNorm's epsilon is the compute dtype's machine epsilon (torch's
`F.rms_norm` default). Initialisation as the benchmark's: q, k, v and fc weights N(0, 0.33 / fan_in), the two
output projections and the head zero, the embedding N(0, 1), biases zero, gains one.

`ProtocolConfig.b203m()` is the benchmark's model: 8 blocks of width 1024, head dim 128, GPT-2's vocabulary padded
to 50,304: 203,828,352 parameters. It runs in bfloat16 (parameters fp32, as jaxcomp keeps them; the benchmark
stores its embedding in bf16), so what crosses a stage boundary is bf16, 2,048 bytes per token each way.
`ProtocolConfig.tiny()` is the same architecture scaled to train on 2 CPU cores over byte tokens.

Stages: stage 0 holds the embedding and its norm with the first blocks, the last stage the final norm and head
with the last blocks (the benchmark: one block per stage on 8 stages). A stage's blocks run as one `nn.scan` over
stacked parameters (`params["blocks"]`, leaves [n_blocks, ...]), as `gpt2`'s do. `param_groups` says which
parameters are the blocks' matrices (Muon's) and which the embedding, the head and the vectors (AdamW's).
"""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxcomp.models.gpt2 import block_splits
from jaxcomp.pipeline import FlaxStage


@dataclasses.dataclass(frozen=True)
class ProtocolConfig:
  vocab_size: int = 50304
  n_layer: int = 8
  n_embd: int = 1024
  head_dim: int = 128
  mlp_ratio: int = 4
  rotary_base: float = 1024.0  # the lowest nonzero angular frequency is 1 / rotary_base
  attn_scale: float = 0.12  # softmax(attn_scale q k^T), q and k RMS-normed
  logit_cap: float = 15.0  # logits = cap z / sqrt(z^2 + cap^2)
  dtype: str = "bfloat16"  # compute dtype; parameters stay fp32
  remat: bool = True  # a block's backward recomputes it from its input (saves its input only)

  def __post_init__(self):
    if self.n_embd % self.head_dim or self.head_dim % 4:
      raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of head_dim ({self.head_dim}), itself a multiple of "
                       "4 (half-truncated rotary pairs head_dim/4 rotated channels)")

  @property
  def n_head(self) -> int:
    return self.n_embd // self.head_dim

  @classmethod
  def b203m(cls, **kw):
    """The benchmark's model: 203,828,352 parameters."""
    return cls(**kw)

  @classmethod
  def tiny(cls, **kw):
    """The same architecture for 2 CPU cores: 4 blocks of width 128, head dim 32, byte tokens, fp32."""
    return cls(**{"vocab_size": 257, "n_layer": 4, "n_embd": 128, "head_dim": 32, "dtype": "float32", **kw})


def rms_norm(name: str, dtype, scale: bool = True) -> nn.RMSNorm:
  """x / sqrt(mean(x^2) + eps) (times gains when `scale`), eps the dtype's machine epsilon."""
  return nn.RMSNorm(epsilon=float(jnp.finfo(dtype).eps), dtype=dtype, use_scale=scale, name=name)


def rotary(x_BxTxNxH, base: float):
  """Half-truncated rotary (module doc): channel i < H/2 and i + H/2 rotate by position x frequency i."""
  h = x_BxTxNxH.shape[-1]
  freq = jnp.concatenate([(1.0 / base) ** jnp.linspace(0.0, 1.0, h // 4), jnp.zeros(h // 4)])
  theta_TxF = jnp.arange(x_BxTxNxH.shape[1], dtype=jnp.float32)[:, None] * freq[None, :]
  cos, sin = jnp.cos(theta_TxF)[:, None, :], jnp.sin(theta_TxF)[:, None, :]
  x1, x2 = jnp.split(x_BxTxNxH.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos + x2 * sin, x2 * cos - x1 * sin], axis=-1).astype(x_BxTxNxH.dtype)


def soft_cap(z, cap: float):
  """cap z / sqrt(z^2 + cap^2): logits bounded by +-cap."""
  return cap * z * jax.lax.rsqrt(z * z + cap * cap)


def _dense(features: int, name: str, dtype, zero: bool = False):
  """A linear layer with a bias; weights N(0, 0.33 / fan_in) (fan_in: the kernel's first axis), or zero."""
  kernel = nn.initializers.zeros if zero else nn.initializers.variance_scaling(0.33, "fan_in", "normal")
  return nn.Dense(features, kernel_init=kernel, dtype=dtype, name=name)


class Block(nn.Module):
  cfg: ProtocolConfig

  @nn.compact
  def __call__(self, x_BxTxD):
    cfg, dtype = self.cfg, self.cfg.dtype
    b, t, d = x_BxTxD.shape
    h = rms_norm("norm1", dtype)(x_BxTxD)
    q, k, v = (_dense(d, name, dtype)(h).reshape(b, t, cfg.n_head, cfg.head_dim) for name in ("q", "k", "v"))
    q = rotary(rms_norm("q_norm", dtype, scale=False)(q), cfg.rotary_base)
    k = rotary(rms_norm("k_norm", dtype, scale=False)(k), cfg.rotary_base)
    attn = jax.nn.dot_product_attention(q, k, v, scale=cfg.attn_scale, is_causal=True).reshape(b, t, d)
    x = x_BxTxD + _dense(d, "attn_proj", dtype, zero=True)(attn)
    h = _dense(cfg.mlp_ratio * d, "fc", dtype)(rms_norm("norm2", dtype)(x))
    return x + _dense(d, "mlp_proj", dtype, zero=True)(jnp.square(nn.relu(h)))


class ProtocolStage(nn.Module):
  """Blocks [first_block, first_block + num_blocks), with the embedding and/or the head if at an end."""
  cfg: ProtocolConfig
  first_block: int
  num_blocks: int
  embed: bool
  head: bool

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train  # no dropout
    cfg = self.cfg
    if self.embed:
      wte = self.param("wte", nn.initializers.normal(1.0), (cfg.vocab_size, cfg.n_embd))
      x = rms_norm("embed_norm", cfg.dtype)(wte[x].astype(cfg.dtype))
    block = nn.remat(Block, policy=jax.checkpoint_policies.nothing_saveable) if cfg.remat else Block
    scanned = nn.scan(lambda block, x, _: (block(x), None), variable_axes={"params": 0}, split_rngs={"params": True},
                      length=self.num_blocks)
    x, _ = scanned(block(cfg, name="blocks"), x, None)
    if self.head:
      z = _dense(cfg.vocab_size, "head", cfg.dtype, zero=True)(rms_norm("head_norm", cfg.dtype)(x))
      return soft_cap(z.astype(jnp.float32), cfg.logit_cap)
    return x


def protocol_stages(cfg: ProtocolConfig, num_stages: int = 8) -> tuple[FlaxStage, ...]:
  """The model as pipeline stages, blocks split evenly (`gpt2.block_splits`): the embedding on the first stage, the
  head on the last; 8 stages of `b203m()`: one block each, as the benchmark places them."""
  splits = block_splits(cfg.n_layer, num_stages)
  last = num_stages - 1
  return tuple(FlaxStage(ProtocolStage(cfg, first, n, embed=s == 0, head=s == last))
               for s, (first, n) in enumerate(splits))


def param_group(path: tuple, leaf) -> str:
  """One parameter's group by its path in a stage's (or the pipeline's) params: "matrix" for a block's
  2-D weight (stacked [n_blocks, in, out]), "embedding", "head" (the head's weight), "vector" otherwise (biases,
  gains, the head's bias)."""
  keys = [getattr(k, "key", None) for k in path]
  if "blocks" in keys and leaf.ndim == 3:
    return "matrix"
  if "wte" in keys:
    return "embedding"
  if "head" in keys and leaf.ndim == 2:
    return "head"
  return "vector"


def param_groups(params):
  """`param_group` of every leaf of `params` (a tree of the same structure, e.g. for `optax.partition`)."""
  return jax.tree_util.tree_map_with_path(param_group, params)
