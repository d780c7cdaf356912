"""Tied parameters: a pair of copies on two stages kept equal, and their gradient exchange, exact or compressed.

A tied pair ((stage a, param path), (stage b, param path)) holds one parameter in each member; both start as a's
value (`tie_params`) and both take the pair's gradient g_a + g_b. Exchanged dense, each member sends its g to the
other. Compressed by a Plain or EF scheme (the data-parallel gradient schemes, `dataparallel`), each member sends
one message of a [1, n] row:
  m_a = C(g_a + e_a),  e_a' = g_a + e_a - m_a   (EF; Plain: m_a = C(g_a), no state)
and both use the same total, its own message decoded too, in the same order:
  g = D(m_a) + D(m_b)   on a and on b,
so the two copies take the same update and stay bitwise equal. Each member draws its own key
(`member_key`: stochastic codecs), the same wherever the pair runs. A member's error state is the
scheme's sender state of one [1, n] row per data-parallel replica ([D, n] leaves).

`tie_grads` runs the exchange with both members in one program (the simulate layout); `member_total` runs one
member's half, the other's message arriving through `exchange` (the sharded layout, a device per member).
"""
import jax
import jax.numpy as jnp

from jaxcomp.compress import schemes


def check_scheme(scheme):
  """ValueError unless `scheme` is None (a dense exchange) or a Plain or EF scheme."""
  if scheme is not None and not schemes.sender_only(scheme):
    raise ValueError(f"the tied exchange's scheme must be a Plain or EF scheme (no receiver state), got {scheme!r}")


def _at(tree, path):
  for p in path:
    tree = tree[p]
  return tree


def _set(tree, path, value):
  if not path:
    return value
  return {**tree, path[0]: _set(tree[path[0]], path[1:], value)}


def tie_params(params: tuple, pairs) -> tuple:
  """Per-stage parameter trees in which each pair's second member holds a copy of the first's value."""
  params = list(params)
  for (sa, pa), (sb, pb) in pairs:
    params[sb] = _set(params[sb], pb, jnp.array(_at(params[sa], pa)))
  return tuple(params)


def sizes(pairs, params) -> list[int]:
  """Each pair's parameter size (entries of one member)."""
  return [int(jnp.size(_at(params[sa], pa))) for (sa, pa), _ in pairs]


def init_member(scheme, size: int, replicas: int = 1):
  """One member's state: the scheme's sender state of one [size] row per replica (leaves [replicas, size])."""
  return scheme.init_sender(replicas, (size,), jnp.float32)


def init_exchange(pairs, scheme, params, replicas: int = 1) -> tuple:
  """The compressed exchange's state: per pair (member a's, member b's) `init_member` states; () when `scheme` is
  None (an exact exchange)."""
  if scheme is None:
    return ()
  return tuple((init_member(scheme, n, replicas), init_member(scheme, n, replicas)) for n in sizes(pairs, params))


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


def tie_grads(grads: tuple, pairs, scheme=None, state=(), step_key=None) -> tuple:
  """(gradients, state'): each pair's members both get g_a + g_b, exact (`scheme` None), or D(m_a) + D(m_b) of
  their compressed messages (`state`: the pairs' member states of one replica, `step_key` the step's)."""
  grads, states = list(grads), []
  for k, ((sa, pa), (sb, pb)) in enumerate(pairs):
    g_a, g_b = _at(grads[sa], pa), _at(grads[sb], pb)
    if scheme is None:
      pair_total = g_a + g_b
    else:
      sent = [send(scheme, g.reshape(-1), member_state, member_key(step_key, k, member))
              for member, (g, member_state) in enumerate(zip((g_a, g_b), state[k]))]
      pair_total = total(scheme, sent[0][0], sent[1][0]).reshape(g_a.shape).astype(g_a.dtype)
      states.append((sent[0][1], sent[1][1]))
    grads[sa] = _set(grads[sa], pa, pair_total)
    grads[sb] = _set(grads[sb], pb, pair_total)
  return tuple(grads), tuple(states)


def member_total(scheme, mine, state, key, is_a, exchange):
  """(the pair's gradient [n], state') on the member holding gradient segment `mine` [n] (`is_a`: member a; may be
  traced): its message (`mine`, or with `scheme` m = C(g + e) from its `state` of one replica, [1, n] leaves, and
  its `key`) goes out through `exchange` (message -> the other member's message), and both members sum in a's-first
  order: g_a + g_b, or D(m_a) + D(m_b). `state'` is () for an exact exchange."""
  if scheme is not None:
    mine, state = send(scheme, mine, state, key)
  other = exchange(mine)
  pick = lambda first, second: jax.tree.map(lambda x, y: jnp.where(is_a, x, y), first, second)
  a, b = pick(mine, other), pick(other, mine)
  return (a + b, ()) if scheme is None else (total(scheme, a, b), state)
