"""Learned low-rank boundaries: the sender sends z = x P (r << d features), the receiver rebuilds x_hat = z Q.

A bottleneck is not a codec (a codec is a parameter-free function of the message): P and Q are
weights trained by the loss. So it is a change of the stages on either side of each boundary,
and the boundary's codecs then compress what really crosses it, z forward and dz = dy Q^T backward
(both r wide; `maxabs:4` on z works as on any activation). Because z is the stage's output, every
executor sends, counts and checks against the compiled HLO exactly the r-wide message, with no
special case. P is a parameter of the sending stage and Q of the receiving stage, so each device
updates its own half with the pipeline's optimizer; checkpoints, resume and eval with compression
off (which still sends z: the bottleneck is part of the model) work as for any stage weight.

Two forms (`parse("proj:16")`, `parse("subspace:16")`):
  proj      P [d, r] and Q [r, d] free (a linear encoder-decoder trained end to end, as the
            residual bottleneck of ResBM without its residual path). Start: P = Q^T = r columns of
            a random orthogonal matrix, so x_hat starts as the projection of x onto a random
            r-dimensional subspace.
  subspace  one matrix W [d, r] per boundary, held by both ends as a tied pair (equal values,
            gradients summed, as GPT-2's tied embedding): P = orth(W), the Q factor of W's QR
            decomposition, and Q = P^T. The constraint (orthonormal columns, decoder = encoder^T)
            makes x_hat the orthogonal projection of x onto span(W): the fixed-subspace form of
            Protocol Models, with the subspace learned. The QR is part of the forward, so the
            constraint holds after every optimizer step without a projection step.
A model trained without a bottleneck (pretrained GPT-2) keeps its weights and gets P and Q started
as above (`insert_into`).
"""
import dataclasses
import re

import jax
import jax.numpy as jnp

from jaxcomp.arguments import is_integer

DOWN, UP = "bottleneck_down", "bottleneck_up"  # the parameters' names in a stage's params dict
KINDS = ("proj", "subspace")


@dataclasses.dataclass(frozen=True)
class Bottleneck:
  """A rank-r bottleneck at every boundary (`kind` in KINDS)."""
  kind: str
  rank: int

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"bottleneck kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
    if not is_integer(self.rank) or self.rank < 1:
      raise ValueError(f"bottleneck rank must be a positive integer, got {self.rank!r}")

  def encoder(self, w):
    """P [d, r] from the sender's parameter."""
    return orthonormal(w) if self.kind == "subspace" else w

  def decoder(self, w):
    """Q [r, d] from the receiver's parameter."""
    return orthonormal(w).T if self.kind == "subspace" else w


def parse(spec: str) -> Bottleneck:
  """'proj:R' or 'subspace:R'; ValueError naming the bad part."""
  match = re.fullmatch(r"([a-z]+):(\d+)", spec)
  if not match:
    raise ValueError(f"bottleneck spec must be KIND:RANK with KIND in {', '.join(KINDS)} (e.g. proj:16), got {spec!r}")
  return Bottleneck(match.group(1), int(match.group(2)))


def orthonormal(w):
  """The Q factor of w's reduced QR [d, r] with a non-negative diagonal of R: orthonormal columns spanning w's."""
  q, r = jnp.linalg.qr(w)
  return q * jnp.where(jnp.diagonal(r) < 0, -1.0, 1.0).astype(q.dtype)


def random_orthonormal(key, d: int, r: int):
  """r orthonormal columns [d, r] of a random orthogonal matrix."""
  return orthonormal(jax.random.normal(key, (d, r), jnp.float32))


@dataclasses.dataclass(frozen=True)
class BottleneckStage:
  """A stage with the encoder after it (sends z = y P) and/or the decoder before it (x = z Q)."""
  inner: object  # a pipeline stage: init(rng, x), apply(params, model_state, x, *, train, rng)
  bottleneck: Bottleneck
  width: int  # d: features of the activation at the boundary
  encode: bool  # a boundary follows this stage
  decode: bool  # a boundary precedes it

  def init(self, rng, z):
    key_in, key_extra = jax.random.split(rng)
    extra = start(self.bottleneck, self.width, key_extra, self.encode, self.decode)
    x = z @ self.bottleneck.decoder(extra[UP]) if self.decode else z
    params, model_state = self.inner.init(key_in, x)
    return insert(params, extra), model_state

  def apply(self, params, model_state, z, *, train: bool, rng):
    inner = {k: v for k, v in params.items() if k not in (DOWN, UP)}
    x = z @ self.bottleneck.decoder(params[UP]).astype(z.dtype) if self.decode else z
    y, model_state = self.inner.apply(inner, model_state, x, train=train, rng=rng)
    return (y @ self.bottleneck.encoder(params[DOWN]).astype(y.dtype) if self.encode else y), model_state


def start(bottleneck: Bottleneck, width: int, key, encode: bool, decode: bool) -> dict:
  """A stage's bottleneck parameters at the start: r orthonormal columns of a random orthogonal matrix
  (P [d, r]; Q [r, d] as P's transpose for `proj`; W [d, r] for `subspace`)."""
  key_up, key_down = jax.random.split(key)
  extra = {}
  if decode:
    w = random_orthonormal(key_up, width, bottleneck.rank)
    extra[UP] = w if bottleneck.kind == "subspace" else w.T
  if encode:
    extra[DOWN] = random_orthonormal(key_down, width, bottleneck.rank)
  return extra


def insert(params: dict, extra: dict) -> dict:
  """A stage's params with the bottleneck's added."""
  clash = set(params) & set(extra)
  if clash:
    raise ValueError(f"the stage already has parameters named {sorted(clash)}")
  return {**params, **extra}


def insert_into(stage_params, bottleneck: Bottleneck, width: int, key) -> tuple:
  """Per-stage params of a model trained without a bottleneck (e.g. pretrained GPT-2) with the
  bottleneck's parameters added as `BottleneckStage.init` starts them; `subspace`'s tied pairs are made
  equal by the pipeline's initialisation."""
  last = len(stage_params) - 1
  return tuple(insert(p, start(bottleneck, width, jax.random.fold_in(key, s), s < last, s > 0))
               for s, p in enumerate(stage_params))


def wrap(stages, bottleneck: Bottleneck, width: int) -> tuple:
  """The stages with an encoder after every stage but the last and a decoder before every stage but the first."""
  if bottleneck.rank > width:
    raise ValueError(f"bottleneck rank {bottleneck.rank} is larger than the {width} features at the boundaries; "
                     f"pass a rank of at most {width}")
  last = len(stages) - 1
  return tuple(BottleneckStage(stage, bottleneck, width, encode=s < last, decode=s > 0)
               for s, stage in enumerate(stages))


def tied(bottleneck: Bottleneck, num_stages: int) -> tuple:
  """The pipeline's tied pairs the bottleneck adds: for `subspace`, each boundary's W on both ends."""
  if bottleneck.kind != "subspace":
    return ()
  return tuple(((b, (DOWN,)), (b + 1, (UP,))) for b in range(num_stages - 1))
