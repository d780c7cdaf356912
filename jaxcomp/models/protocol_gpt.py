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

ReparamSSN (`reparam_ssn(cfg)`; the benchmark's `train_gpt_ssn.py`, its record 20260918_reparamssn_baseline): a
fixed U [d, r] (orthonormal columns, the Q of a standard normal matrix's QR) and a fixed table F [vocab, d] (standard
normal), both drawn from `ssn_seed` (never trained, never sent), and every projection that writes the residual in
the blocks before the last produces r values followed by U^T (`z U^T`, the bias r wide); the embedding is r wide
too, and no norm follows it:

    x_0 = F[tokens] + E[tokens] U^T          blocks before the last: x += attn_proj(...) U^T, x += mlp_proj(...) U^T

so at every stage boundary x = F[tokens] + U c, and a stage sends [c, tokens] (r + 1 channels, float32; the ids as
exact integer values, which `ids+CODEC` sends as an integer array of their own) and the next rebuilds x exactly:
dL/dc = dL/dx U is the exact backward message. The last block is full rank. The parameters freed go to a wider MLP
in every block: `mlp_hidden` the largest width whose parameter count is at most the dense model's (the record:
11,292 at d = 1,024, 203,822,240 parameters; r = 160, and r/d = 160/1,024 at other widths).

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
  mlp_hidden: int | None = None  # the MLP's hidden width (None: mlp_ratio x n_embd)
  ssn_rank: int | None = None  # ReparamSSN's subspace rank r (None: the dense model; `reparam_ssn`)
  ssn_seed: int = 1337  # draws ReparamSSN's fixed U and token table (the benchmark's generator seed)

  def __post_init__(self):
    if self.n_embd % self.head_dim or self.head_dim % 4:
      raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of head_dim ({self.head_dim}), itself a multiple of "
                       "4 (half-truncated rotary pairs head_dim/4 rotated channels)")

    if self.ssn_rank is not None and not 0 < self.ssn_rank < self.n_embd:
      raise ValueError(f"ssn_rank must be in 1..{self.n_embd - 1} (below the width), got {self.ssn_rank}")

  @property
  def n_head(self) -> int:
    return self.n_embd // self.head_dim

  @property
  def hidden(self) -> int:
    """The MLP's hidden width."""
    return self.mlp_hidden or self.mlp_ratio * self.n_embd

  @classmethod
  def b203m(cls, **kw):
    """The benchmark's model: 203,828,352 parameters."""
    return cls(**kw)

  @classmethod
  def tiny(cls, **kw):
    """The same architecture for 2 CPU cores: 4 blocks of width 128, head dim 32, byte tokens, fp32."""
    return cls(**{"vocab_size": 257, "n_layer": 4, "n_embd": 128, "head_dim": 32, "dtype": "float32", **kw})


SSN_RATIO = 160 / 1024  # the record's subspace rank over its width


def num_params(cfg: ProtocolConfig) -> int:
  """Parameters of the model (closed form; what `init` gives): per block two gains, q/k/v, the two residual
  projections (r wide before the last block under ReparamSSN) and the MLP, each with biases; the embedding (r wide
  under ReparamSSN, then no norm); the head's norm, weight and bias."""
  d, h, v, r = cfg.n_embd, cfg.hidden, cfg.vocab_size, cfg.ssn_rank
  common = 2 * d + 3 * (d * d + d) + d * h + h

  def block(out: int) -> int:  # the two projections writing the residual produce `out` values
    return common + d * out + out + h * out + out

  blocks = cfg.n_layer * block(d) if r is None else (cfg.n_layer - 1) * block(r) + block(d)
  embed = v * d + d if r is None else v * r
  return embed + blocks + d + d * v + v


def reparam_ssn(cfg: ProtocolConfig, rank: int | None = None) -> ProtocolConfig:
  """`cfg` as ReparamSSN (module doc): rank `rank` (default round(d x 160/1024)), the MLP as wide as the dense
  model's parameter count allows."""
  r = rank if rank is not None else max(1, round(cfg.n_embd * SSN_RATIO))
  dense = num_params(dataclasses.replace(cfg, ssn_rank=None))
  at = lambda h: num_params(dataclasses.replace(cfg, ssn_rank=r, mlp_hidden=h))
  hidden = (dense - at(1)) // (at(2) - at(1)) + 1  # parameters grow linearly with the hidden width
  if hidden < 1:
    raise ValueError(f"ReparamSSN of rank {r} does not fit the dense model's {dense:,} parameters")
  return dataclasses.replace(cfg, ssn_rank=r, mlp_hidden=hidden)


def ssn_constants(cfg: ProtocolConfig) -> tuple[jax.Array, jax.Array]:
  """ReparamSSN's fixed (U [d, r] with orthonormal columns, F [vocab, d]), float32, from `cfg.ssn_seed`."""
  k_u, k_f = jax.random.split(jax.random.key(cfg.ssn_seed))
  u, _ = jnp.linalg.qr(jax.random.normal(k_u, (cfg.n_embd, cfg.ssn_rank), jnp.float32))
  return u, jax.random.normal(k_f, (cfg.vocab_size, cfg.n_embd), jnp.float32)


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
  """One block; `subspace`: its two residual projections write r values through U^T (ReparamSSN)."""
  cfg: ProtocolConfig
  subspace: bool = False

  @nn.compact
  def __call__(self, x_BxTxD, u_DxR=None):
    cfg, dtype = self.cfg, self.cfg.dtype
    b, t, d = x_BxTxD.shape

    def residual_write(name, y):
      if not self.subspace:
        return _dense(d, name, dtype, zero=True)(y)
      return _dense(cfg.ssn_rank, name, dtype, zero=True)(y) @ u_DxR.T.astype(dtype)

    h = rms_norm("norm1", dtype)(x_BxTxD)
    q, k, v = (_dense(d, name, dtype)(h).reshape(b, t, cfg.n_head, cfg.head_dim) for name in ("q", "k", "v"))
    q = rotary(rms_norm("q_norm", dtype, scale=False)(q), cfg.rotary_base)
    k = rotary(rms_norm("k_norm", dtype, scale=False)(k), cfg.rotary_base)
    attn = jax.nn.dot_product_attention(q, k, v, scale=cfg.attn_scale, is_causal=True).reshape(b, t, d)
    x = x_BxTxD + residual_write("attn_proj", attn)
    h = _dense(cfg.hidden, "fc", dtype)(rms_norm("norm2", dtype)(x))
    return x + residual_write("mlp_proj", jnp.square(nn.relu(h)))


class ProtocolStage(nn.Module):
  """Blocks [first_block, first_block + num_blocks), with the embedding and/or the head if at an end. Under
  ReparamSSN a stage takes (first stage: tokens; others: [c, ids] float32 [B, T, r + 1]) and sends [c, ids]; its
  subspace blocks are scanned as `blocks`, the last (full-rank) block as `final_blocks` (a scan of one)."""
  cfg: ProtocolConfig
  first_block: int
  num_blocks: int
  embed: bool
  head: bool

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train  # no dropout
    cfg = self.cfg
    if cfg.ssn_rank is not None:
      return self.reparam_ssn(x)
    if self.embed:
      wte = self.param("wte", nn.initializers.normal(1.0), (cfg.vocab_size, cfg.n_embd))
      x = rms_norm("embed_norm", cfg.dtype)(wte[x].astype(cfg.dtype))
    x = self.blocks("blocks", self.num_blocks, False, x)
    return self.output(x)

  def blocks(self, name: str, n: int, subspace: bool, x, u_DxR=None):
    """`n` blocks as one scan over stacked parameters `name` (leaves [n, ...])."""
    cfg = self.cfg
    block = nn.remat(Block, policy=jax.checkpoint_policies.nothing_saveable) if cfg.remat else Block
    scanned = nn.scan(lambda block, x, u: (block(x, u), None), variable_axes={"params": 0},
                      split_rngs={"params": True}, in_axes=nn.broadcast, length=n)
    x, _ = scanned(block(cfg, subspace, name=name), x, u_DxR)
    return x

  def reparam_ssn(self, x):
    """The stage under ReparamSSN (module doc): x = F[ids] + U c in, [c, ids] out (or the head's logits)."""
    cfg = self.cfg
    u_DxR, f_VxD = (self.variable("constants", name, lambda i=i: ssn_constants(cfg)[i]).value
                    for i, name in enumerate(("ssn_u", "ssn_fixed")))
    if self.embed:
      ids_BxT = x
      wte = self.param("wte", nn.initializers.normal(1.0), (cfg.vocab_size, cfg.ssn_rank))
      x = wte[ids_BxT] @ u_DxR.T + f_VxD[ids_BxT]
    else:
      ids_BxT = jnp.round(x[..., -1]).astype(jnp.int32)
      x = x[..., :-1].astype(jnp.float32) @ u_DxR.T + f_VxD[ids_BxT]
    x = x.astype(cfg.dtype)
    last = self.first_block + self.num_blocks == cfg.n_layer  # this stage holds the full-rank last block
    if self.num_blocks - last:
      x = self.blocks("blocks", self.num_blocks - last, True, x, u_DxR)
    if last:
      x = self.blocks("final_blocks", 1, False, x)
    if self.head:
      return self.output(x)
    c_BxTxR = (x.astype(jnp.float32) - f_VxD[ids_BxT]) @ u_DxR
    return jnp.concatenate([c_BxTxR, ids_BxT.astype(jnp.float32)[..., None]], axis=-1)

  def output(self, x):
    """The head's soft-capped logits on the last stage, else x."""
    cfg = self.cfg
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
  if {"blocks", "final_blocks"} & set(keys) and leaf.ndim == 3:
    return "matrix"
  if "wte" in keys:
    return "embedding"
  if "head" in keys and leaf.ndim == 2:
    return "head"
  return "vector"


def param_groups(params):
  """`param_group` of every leaf of `params` (a tree of the same structure, e.g. for `optax.partition`)."""
  return jax.tree_util.tree_map_with_path(param_group, params)
