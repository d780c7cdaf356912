"""The gradient exchange of tied parameters (a pair of copies on two stages kept equal), compressed.

A tied pair's members a and b hold one parameter each; its gradient is g_a + g_b on both. Exchanged
dense, each member sends its g to the other. Compressed by a Plain or EF scheme (the data-parallel
gradient schemes, `dataparallel`), each member sends one message of a [1, n] row:
  m_a = C(g_a + e_a),  e_a' = g_a + e_a - m_a   (EF; Plain: m_a = C(g_a), no state)
and both use the same total, its own message decoded too, in the same order:
  g = D(m_a) + D(m_b)   on a and on b,
so the two copies take the same update and stay bitwise equal. Each member draws its own key
(`member_key`: stochastic codecs), the same wherever the pair runs. A member's error state is the
scheme's sender state of one [1, n] row per data-parallel replica ([D, n] leaves).
"""
import jax

from jaxcomp.compress import schemes


def check_scheme(scheme):
  """ValueError unless `scheme` is None (a dense exchange) or a Plain or EF scheme."""
  if scheme is not None and not schemes.sender_only(scheme):
    raise ValueError(f"the tied exchange's scheme must be a Plain or EF scheme (no receiver state), got {scheme!r}")


def init_member(scheme, size: int, replicas: int = 1):
  """One member's state: the scheme's sender state of one [size] row per replica (leaves [replicas, size])."""
  return scheme.init_sender(replicas, (size,), jax.numpy.float32)


def member_key(step_key, pair: int, member):
  """The key of member `member` (0: a, 1: b; may be traced) of tied pair `pair` in the step of `step_key`."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(step_key, 3), pair), member)


def send(scheme, g_n, state, key):
  """(payload m = C(g + e) of one member's gradient segment [n], its state') for its state of one replica ([1, n]
  leaves): the scheme's own `send` (EF's error feedback)."""
  return scheme.send(g_n[None], state, key)


def total(scheme, payload_a, payload_b):
  """The pair's gradient [n] on both members: D(m_a) + D(m_b), a's first."""
  return (scheme.codec.decode(payload_a) + scheme.codec.decode(payload_b))[0]
