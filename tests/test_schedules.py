"""jaxcomp.parallel.schedules: a schedule is a table; what is read from it, and which tables are legal.
Pure Python: no program is traced here."""
import math

import numpy as np
import pytest

from jaxcomp.analysis import schedule_table
from jaxcomp.analysis.netsim import simulate_step
from jaxcomp.parallel import plan, schedules, timetable
from jaxcomp.parallel.timetable import Message, Op, Timetable

FUSED = [name for name in schedules.SCHEDULES if not schedules.parse(name).splits_backward]  # fused backwards
F, B, W, BW = (lambda c, m, kind=kind: Op(kind, c, m) for kind in ("F", "B", "W", "BW"))


def table(*rows, chunks=None, microbatches=1):
  """A schedule from rows of ticks, each tick an op or a tuple of ops (None: idle)."""
  as_tick = lambda ops: () if ops is None else (ops,) if isinstance(ops, Op) else tuple(ops)
  return Timetable("planted", chunks or len(rows), microbatches, tuple(tuple(map(as_tick, row)) for row in rows))


@pytest.mark.parametrize("name, ticks", [("gpipe", lambda S, M: 2 * M + 2 * S - 2),
                                         ("1f1b", lambda S, M: 2 * M + 2 * S - 2),
                                         ("1f1b-fused", lambda S, M: M + 2 * S - 2)])
def test_tables_have_their_ticks_bubble_and_messages(name, ticks):
  for S in range(1, 7):
    for M in range(1, 10):
      t = schedules.parse(name).train_table(S, M)
      assert t.ticks == ticks(S, M)
      assert timetable.bubble_fraction(t) == pytest.approx((S - 1) / (M + S - 1), abs=1e-12)
      sent = [msg for tick in range(t.ticks) for msg in timetable.messages(t, tick)]
      assert sorted((msg.forward, msg.boundary, msg.microbatch) for msg in sent) == sorted(
          (fwd, b, m) for fwd in (False, True) for b in range(S - 1) for m in range(M))


def test_messages_follow_from_the_ops():
  """F of a chunk before the last sends its activation on; BW of a chunk after the first sends its gradient back."""
  t = schedules.parse("1f1b-fused").train_table(2, 1)
  assert t.ops == (((F(0, 0),), (), (BW(0, 0),)), ((), (F(1, 0), BW(1, 0)), ()))
  assert [timetable.messages(t, tick) for tick in range(t.ticks)] == [
      (Message(True, 0, 0, 0, 1, 0),), (Message(False, 0, 0, 1, 0, 1),), ()]
  assert timetable.device_order(t, 1) == (F(1, 0), BW(1, 0))


def test_the_executors_lookups_are_read_off_the_table():
  """Per tick and device the microbatch of each op kind (-1: none), per tick and boundary the microbatch sent
  and the one taken in (the sending tick, or `forwarding_delay` ticks later with overlapped sends), for every
  schedule."""
  for S in range(1, 6):
    for M in range(2 * S, 2 * S + 3):
      for t in [schedules.parse(name, overlap).train_table(S, M) for name in schedules.SCHEDULES
                for overlap in (False, True)] + [
          schedules.parse(f"interleaved:{V}", overlap).train_table(S, S * (M // S)) for V in (2, 3)
          for overlap in (False, True)]:
        lookup = plan.lookup_of(t)
        where_run = timetable.positions(t).items()
        runs = {(op.kind, tick, d): op.microbatch for op, (tick, d, _) in where_run}
        chunk_slots = {(op.kind, tick, d): op.chunk // S for op, (tick, d, _) in where_run}
        for kind, ops in lookup.ops.items():
          assert {(kind, *where): int(m) for where, m in np.ndenumerate(ops) if m >= 0} == {
              key: m for key, m in runs.items() if key[0] == kind}
          assert {(kind, *where): int(lookup.chunks[kind][where]) for where, m in np.ndenumerate(ops) if m >= 0} == {
              key: v for key, v in chunk_slots.items() if key[0] == kind}
        msgs = [msg for tick in range(t.ticks) for msg in timetable.messages(t, tick)]
        for forward in (True, False):
          mine = [msg for msg in msgs if msg.forward == forward]
          assert {where: int(m) for where, m in np.ndenumerate(lookup.sent[forward]) if m >= 0} == {
              (msg.tick, msg.boundary): msg.microbatch for msg in mine}
          taken_in = 0 if t.forwarding_delay == 1 else t.forwarding_delay
          assert {where: int(m) for where, m in np.ndenumerate(lookup.received[forward]) if m >= 0} == {
              (msg.tick + taken_in, msg.boundary): msg.microbatch for msg in mine}


def test_the_executors_rings_hold_what_the_table_keeps():
  """The input ring has the table's stash slots for the fused schedules (a message is used the tick after it
  arrives) and ZB-H1's (its inputs wait for W); the cotangent ring one slot, ZB-H1's one for each W that
  waits (stage s defers s of them; the last stage's come from its loss)."""
  for S in range(1, 6):
    for M in range(1, 10):
      for name in schedules.SCHEDULES:
        t = schedules.parse(name).train_table(S, M)
        lookup = plan.lookup_of(t)
        assert lookup.stash_slots == timetable.most_inputs_held(t), (name, S, M)
        assert lookup.grad_slots == (max(1, min(M, S - 1)) if name == "zb-h1" else 1), (name, S, M)


def test_a_legal_table_in_any_order_runs_and_one_with_two_ops_of_a_kind_at_a_tick_does_not():
  """Backwards in reverse microbatch order (no stride): microbatch 1's input waits in its ring slot
  while 0's is used. Two forwards of one device at one tick (two messages on one link) are refused."""
  reversed_backwards = table((F(0, 0), F(0, 1), BW(0, 1), BW(0, 0)), microbatches=2)
  assert plan.lookup_of(reversed_backwards).ops["BW"][:, 0].tolist() == [-1, -1, 1, 0]
  assert plan.lookup_of(reversed_backwards).stash_slots == 2
  with pytest.raises(ValueError, match=r"at most one op of each kind \(and not a B beside a BW\) per device per "
                                       r"tick; schedule 'planted' runs F\(0, 0\), F\(0, 1\) on device 0 at tick 0"):
    plan.lookup_of(table(((F(0, 0), F(0, 1)), BW(0, 0), BW(0, 1)), microbatches=2))


@pytest.mark.parametrize("name", FUSED)
def test_overlapped_tables_take_two_ticks_a_message_and_s_minus_1_more_each_way(name):
  """The fused-BW tables (zb-h1's overlapped table: below). With overlapped sends every message is used two ticks after the op that sent it (it crosses during the
  tick between), never sooner; the table is S-1 ticks longer each way, and its bubble with free messages is
  the same."""
  for S in range(1, 7):
    for M in range(2 * S, 2 * S + 4):
      plain, overlapped = schedules.parse(name).train_table(S, M), schedules.parse(name, True).train_table(S, M)
      assert (overlapped.forwarding_delay, overlapped.ticks) == (2, plain.ticks + 2 * (S - 1))
      assert timetable.bubble_fraction(overlapped) == pytest.approx(timetable.bubble_fraction(plain), abs=1e-12)
      tick = {op: t for op, (t, _, _) in timetable.positions(overlapped).items()}
      for s in range(S - 1):
        for m in range(M):
          assert tick[F(s + 1, m)] == tick[F(s, m)] + 2 and tick[BW(s, m)] == tick[BW(s + 1, m)] + 2


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "interleaved:2"])
def test_overlap_needs_twice_as_many_microbatches_as_stages(name):
  with pytest.raises(ValueError, match=r"need at least 2S microbatches per data shard: got M=4 for S=4 stages; use "
                                       r"--microbatches 8 \(or more\), or drop --overlap"):
    schedules.parse(name, True).train_table(4, 4)


def test_every_schedule_overlaps_its_sends():
  """The executor runs every schedule with overlapped sends (interleaved:V too); an unknown name is refused."""
  for name in (*schedules.SCHEDULES, "interleaved:2"):
    schedules.parse(name, overlap=True).check(2, 4)
    assert schedules.parse(name, True).train_table(2, 4).forwarding_delay == 2
  with pytest.raises(ValueError, match=r"schedule must be one of \['gpipe', '1f1b', '1f1b-fused', 'zb-h1'\] or "
                                       r"interleaved:V \(V >= 1 chunks per device\), got 'zb-h2'"):
    schedules.parse("zb-h2", overlap=True).check(2, 4)


def test_overlapped_zero_bubble_h1_runs_1f1bs_overlapped_order_in_s_minus_1_more_ticks():
  """Hop 2: each device runs the overlapped 1F1B table's forwards and backwards in its order (B for BW), every
  message used two ticks or more after its op, in 3M+2(S-1) ticks (the plain table's 3M+S-1, S-1 more), with
  its bubble; the executor could run it (its lookups), each device holding min(M, 2S-1) inputs."""
  for S in range(1, 6):
    for M in (2 * S, 2 * S + 3):
      zb, ref = schedules.ZeroBubbleH1(forwarding_delay=2).train_table(S, M), schedules.OneFOneB(
          forwarding_delay=2).train_table(S, M)
      assert (zb.forwarding_delay, zb.ticks) == (2, 3 * M + 2 * (S - 1)) == (
          2, schedules.ZeroBubbleH1().train_table(S, M).ticks + S - 1)
      assert_every_message_waits(zb, 2)
      for d in range(S):
        as_1f1b = [Op("BW" if op.kind == "B" else op.kind, op.chunk, op.microbatch)
                   for op in timetable.device_order(zb, d) if op.kind != "W"]
        assert as_1f1b == list(timetable.device_order(ref, d))
      assert timetable.bubble_fraction(zb) == pytest.approx((S - 1) / (3 * M + S - 1), abs=1e-12)
      assert timetable.peak_inputs_held(zb) == (min(M, 2 * S - 1),) * S
      assert plan.lookup_of(zb).stash_slots == min(M, 2 * S - 1)


def test_overlapped_interleaved_places_megatrons_order_two_ticks_a_message():
  """interleaved:V with forwarding delay 2: each device's order as without, every message used two ticks or more
  after its op, one tick more per chunk boundary each way (2(SV-1) more ticks), the same bubble."""
  for S in (2, 3, 4):
    for V in (1, 2, 3):
      plain = schedules.Interleaved(V).train_table(S, 2 * S)
      overlapped = schedules.Interleaved(V, forwarding_delay=2).train_table(S, 2 * S)
      assert (overlapped.forwarding_delay, overlapped.ticks) == (2, plain.ticks + 2 * (S * V - 1)), (S, V)
      assert_every_message_waits(overlapped, 2)
      assert all(timetable.device_order(overlapped, d) == timetable.device_order(plain, d) for d in range(S))
      assert timetable.bubble_fraction(overlapped) == pytest.approx(timetable.bubble_fraction(plain), abs=1e-12)


def assert_every_message_waits(t, delay):
  """Every op that takes in a message (its input ran on another device) runs `delay` ticks or more after it was
  sent, and one op at most per device and tick."""
  where = timetable.positions(t)
  assert all(len(ops) <= 1 for row in t.ops for ops in row)
  for op, (tick, d, _) in where.items():
    for need in timetable.inputs(op, t.num_chunks):
      if need in where and where[need][1] != d:
        assert tick >= where[need][0] + delay, (t.name, op, need)


def test_a_two_tick_forwarding_delay_is_refused_where_a_message_is_used_the_next_tick():
  rows = (((F(0, 0),), (), (), (BW(0, 0),)), ((), (F(1, 0), BW(1, 0)), (), ()))
  Timetable("planted", 2, 1, rows)
  with pytest.raises(ValueError, match=r"F\(1, 0\) at device 1 tick 1 runs before its input F\(0, 0\) \(device 0 "
                                       r"tick 0, sent at its end, there at tick 2\)"):
    Timetable("planted", 2, 1, rows, forwarding_delay=2)


def test_a_legal_split_table_with_two_chunks_per_device():
  t = table((F(0, 0), None, None, B(0, 0), W(0, 0)), (None, F(1, 0), B(1, 0), W(1, 0), None), chunks=2)
  assert timetable.messages(t, 2) == (Message(False, 0, 0, 1, 0, 2),)
  assert [timetable.inputs_held(t, 1, tick) for tick in range(5)] == [0, 1, 1, 1, 0]
  assert timetable.most_inputs_held(t) == 1
  wrapped = table((F(0, 0), None, F(2, 0), BW(2, 0), None, BW(0, 0)), (None, F(1, 0), None, None, BW(1, 0), None),
                  chunks=3)
  assert timetable.messages(wrapped, 1) == (Message(True, 1, 0, 1, 0, 1),)  # chunk 1 (device 1) to chunk 2 (device 0)
  assert timetable.peak_inputs_held(wrapped) == (2, 1)


@pytest.mark.parametrize("rows, kwargs, message", [
    (((BW(0, 0), F(0, 0)),), {}, r"BW\(0, 0\) at device 0 tick 0 runs before its input F\(0, 0\)"),
    (((F(0, 0), W(0, 0), B(0, 0)),), {}, r"W\(0, 0\) at device 0 tick 1 runs before its input B\(0, 0\)"),
    (((F(0, 0), [B(1, 0), BW(0, 0)]), (F(1, 0), None)), {}, None),  # B(1, 0) on device 0: placed on the wrong device
    (((F(0, 0), None, BW(0, 0)), (F(1, 0), BW(1, 0), None)), {},
     r"F\(1, 0\) at device 1 tick 0 runs before its input F\(0, 0\) \(device 0 tick 0, sent at its end\)"),
    (((F(0, 0), None, BW(0, 0), None), (None, F(1, 0), None, BW(1, 0))), {},
     r"BW\(0, 0\) at device 0 tick 2 runs before its input BW\(1, 0\) \(device 1 tick 3"),
    (((F(0, 0), BW(0, 0), F(0, 0)),), {}, r"F\(0, 0\) runs twice \(ticks 0 and 2\)"),
    (((F(0, 0),),), {}, r"BW\(0, 0\) never runs"),
    (((F(0, 0), B(0, 0)),), {}, r"W\(0, 0\) never runs"),
    (((F(0, 0), B(0, 0), W(0, 0), BW(0, 0)),), {}, r"BW\(0, 0\) runs beside its split B and W"),
    (((F(0, 0), BW(0, 0)),), dict(microbatches=2), r"F\(0, 1\) never runs"),
    (((F(0, 3), BW(0, 3)),), {}, r"F\(0, 3\) at device 0 tick 0 is not an op of 1 chunks and 1 microbatches"),
    (((F(0, 0), BW(0, 0)), (None,)), dict(chunks=1), r"every device needs the same number of ticks, got \[2, 1\]"),
])
def test_validate_names_the_illegal_op(rows, kwargs, message):
  with pytest.raises(ValueError, match=message or r"B\(1, 0\) runs on device 0, but chunk 1 lives on device 1"):
    table(*rows, **kwargs)


def test_netsim_runs_the_table_and_sends_overlap_or_not():
  """Two stages, two microbatches, GPipe, 1 s ops, 2 s messages: stage 0's second forward runs while
  its first message crosses (makespan 12) or after it has left (14; hand timelines)."""
  args = ([1.0, 1.0], [1.0, 1.0], [2.0], [2.0], 2, 8.0)
  by_name = simulate_step(*args, schedule="gpipe")
  assert simulate_step(*args, schedule=schedules.GPipe().train_table(2, 2)) == by_name
  waiting = simulate_step(*args, schedule="gpipe", overlap_sends=False)
  start = lambda tl, kind, s, m: next(e.start for e in tl.events if (e.kind, e.index, e.microbatch) == (kind, s, m))
  assert (by_name.makespan, start(by_name, "fwd", 0, 1)) == (12.0, 1.0)
  assert (waiting.makespan, start(waiting, "fwd", 0, 1)) == (14.0, 3.0)


def test_netsim_refuses_a_table_of_other_sizes():
  args = ([1.0, 1.0], [1.0, 1.0], [2.0], [2.0], 2, math.inf)
  with pytest.raises(ValueError, match=r"schedule 'gpipe' has 3 chunks on 3 devices and 2 microbatches; netsim "
                                       r"was given times for 2 chunks"):
    simulate_step(*args, schedule=schedules.GPipe().train_table(3, 2))


def test_schedule_table_prints_the_docs_rows(capsys):
  """The table's rows, and the overlapped tables' (M >= 2S); the last two columns: idle under the executor's
  ticks, messages free and of one forward (with overlapped sends a message costs max, not +, so less idle)."""
  schedule_table.main(["--sizes", "4x8"])
  out = capsys.readouterr().out.splitlines()
  assert out[2:] == ["| `gpipe` | 4 | 8 | 22 | 0.2727 | 0.2727 | 1.000 | 8, 8, 8, 8 | 0.2727 | 0.5472 |",
                     "| `1f1b` | 4 | 8 | 22 | 0.2727 | 0.2727 | 1.000 | 4, 3, 2, 1 | 0.2727 | 0.5385 |",
                     "| `1f1b-fused` | 4 | 8 | 14 | 0.2727 | 0.2727 | 1.000 | 7, 5, 3, 1 | 0.2727 | 0.4783 |",
                     "| `zb-h1` | 4 | 8 | 27 | 0.1111 | 0.1111 | 0.407 | 4, 4, 4, 4 | 0.1111 | 0.5385 |",
                     "| `interleaved:2` | 4 | 8 | 38 | 0.1579 | 0.1579 | 0.579 | 11, 9, 7, 5 | 0.2727 | 0.6571 |",
                     "| `gpipe --overlap` | 4 | 8 | 28 | 0.2727 | 0.2727 | 1.000 | 8, 8, 8, 8 | 0.2727 | 0.3846 |",
                     "| `1f1b --overlap` | 4 | 8 | 28 | 0.2727 | 0.2727 | 1.000 | 7, 5, 3, 1 | 0.2727 | 0.3846 |",
                     "| `1f1b-fused --overlap` | 4 | 8 | 20 | 0.2727 | 0.2727 | 1.000 | 8, 8, 5, 1 | 0.2727 | 0.3846 |",
                     "| `zb-h1 --overlap` | 4 | 8 | 30 | 0.1111 | 0.1111 | 0.407 | 7, 7, 7, 7 | 0.1111 | 0.2000 |",
                     "| `interleaved:2 --overlap` | 4 | 8 | 52 | 0.1579 | 0.1579 | 0.579 | 11, 9, 7, 5 | 0.1579 | 0.5340 |"]


def test_interleaved_has_its_bubble_and_runs_on_a_ring():
  """V chunks per device, chunk c on device c mod S: bubble (S-1)/(VM+S-1), one op per device per tick, the
  last device's chunks send on to device 0."""
  for S in (1, 2, 3, 4):
    for V in (1, 2, 3):
      for M in (S, 2 * S, 3 * S):
        t = schedules.parse(f"interleaved:{V}").train_table(S, M)
        assert (t.num_devices, t.num_chunks) == (S, S * V)
        assert timetable.bubble_fraction(t) == pytest.approx((S - 1) / (V * M + S - 1), abs=1e-12), (S, V, M)
        assert all(len(ops) <= 1 for row in t.ops for ops in row)
  t = schedules.Interleaved(2).train_table(4, 4)
  ring = [msg for tick in range(t.ticks) for msg in timetable.messages(t, tick) if msg.boundary == 3]
  assert sorted((msg.forward, msg.sender, msg.receiver, msg.microbatch) for msg in ring) == [
      *((False, 0, 3, m) for m in range(4)), *((True, 3, 0, m) for m in range(4))]


def test_interleaved_runs_megatrons_order():
  """Device 0 of S=4, V=2, M=8: (S-1)*2 + (V-1)*S = 10 forwards (microbatches 0-3 on chunk 0, then on chunk 4,
  then 4-5 on chunk 0), then a forward and a backward in turn, the backwards from the last chunk."""
  order = timetable.device_order(schedules.Interleaved(2).train_table(4, 8), 0)
  assert order[:14] == (*(F(0, m) for m in range(4)), *(F(4, m) for m in range(4)), F(0, 4), F(0, 5),
                        F(0, 6), BW(4, 0), F(0, 7), BW(4, 1))


def test_interleaved_forwards_first_is_the_eval_pass_in_vm_plus_s_minus_1_ticks():
  """Eval steps run interleaved GPipe's forwards: every input is used the tick after it arrives, so one ring
  slot per chunk holds them and no cotangent is kept."""
  for S in range(1, 5):
    for V in (1, 2, 3):
      for M in (S, 2 * S, 3 * S):
        t = schedules.Interleaved(V).eval_table(S, M)
        where = timetable.positions(t)
        last_forward = max(where[op][0] for op in where if op.kind == "F")
        assert last_forward + 1 == V * M + S - 1, (S, V, M)
        assert last_forward < min(where[op][0] for op in where if op.kind == "BW"), (S, V, M)
        lookup = plan.lookup_of(t, forwards_only=True)
        assert (lookup.stash_slots, lookup.grad_slots) == (1, 1), (S, V, M)


def test_overlapped_interleaved_takes_two_ticks_a_message_and_sv_minus_1_more_each_way():
  """Each of the S V - 1 chunk boundaries holds a message one tick longer each way: 2 (S V - 1) more ticks
  (1F1B's 2 (S - 1) with V = 1), the same order of ops on every device."""
  for S in (2, 3, 4):
    for V in (1, 2, 3):
      for M in (2 * S, 4 * S):
        plain = schedules.Interleaved(V).train_table(S, M)
        overlapped = schedules.parse(f"interleaved:{V}", True).train_table(S, M)
        assert overlapped.forwarding_delay == 2 and overlapped.ticks == plain.ticks + 2 * (S * V - 1), (S, V, M)
        assert all(timetable.device_order(overlapped, d) == timetable.device_order(plain, d) for d in range(S))


def test_interleaved_refuses_microbatches_not_a_multiple_of_the_stages():
  with pytest.raises(ValueError, match=r"multiple of the stages, got M=6 for S=4 \(use M = 8\)"):
    schedules.parse("interleaved:2").train_table(4, 6)


def test_boundaries_run_on_a_ring_of_the_devices():
  """Boundary b goes from chunk b's device to chunk b+1's (c mod D): stage b to b+1 with one chunk per
  device, the last device on to device 0 with several, as the table's messages say."""
  assert [plan.link_perm(b, 4) for b in range(3)] == [((0, 1),), ((1, 2),), ((2, 3),)]
  t = schedules.Interleaved(2).train_table(4, 4)
  for msg in (msg for tick in range(t.ticks) for msg in timetable.messages(t, tick)):
    ends = plan.link_ends(msg.boundary, t.num_devices)
    assert ends == ((msg.sender, msg.receiver) if msg.forward else (msg.receiver, msg.sender)), msg
  assert plan.link_perm(3, 4) == ((3, 0),)


def test_orders_that_wait_on_each_other_are_refused():
  """At the first tick where no op can run and no message is in flight (F(0, 0)'s could arrive until tick
  `forwarding_delay`)."""
  for delay in (1, 2):
    with pytest.raises(ValueError, match=r"every device waits at tick 0, on \['BW\(0, 0\)', 'F\(1, 0\)'\]"):
      timetable.as_soon_as_ready("crossed", 2, 1, [[BW(0, 0), F(0, 0)], [F(1, 0), BW(1, 0)]], delay)
    with pytest.raises(ValueError, match=rf"every device waits at tick {delay}, on \['BW\(0, 0\)', 'BW\(1, 0\)'\]"):
      timetable.as_soon_as_ready("late", 2, 1, [[F(0, 0), BW(0, 0)], [BW(1, 0), F(1, 0)]], delay)


SIZES = [(S, M) for S in range(1, 7) for M in range(1, 13)]


def test_zero_bubble_h1_is_a_legal_table_with_1f1bs_order():
  """Built through `validate`; each device runs 1F1B's forwards and backwards in 1F1B's order, B for BW."""
  for S, M in SIZES:
    zb, ref = schedules.parse("zb-h1").train_table(S, M), schedules.OneFOneB().train_table(S, M)
    timetable.validate(zb)
    for d in range(S):
      as_1f1b = [Op("BW" if op.kind == "B" else op.kind, op.chunk, op.microbatch)
                 for op in timetable.device_order(zb, d) if op.kind != "W"]
      assert as_1f1b == list(timetable.device_order(ref, d))


def test_zero_bubble_h1_sends_the_input_gradient_at_its_b():
  """B(c, m) sends its gradient upstream at the end of its own tick (W sends nothing): the gradient never
  waits for the weight gradient."""
  for S, M in SIZES:
    t = schedules.parse("zb-h1").train_table(S, M)
    where = timetable.positions(t)
    sent = {(msg.boundary, msg.microbatch): msg.tick for tick in range(t.ticks)
            for msg in timetable.messages(t, tick) if not msg.forward}
    for c in range(1, S):
      for m in range(M):
        assert sent[(c - 1, m)] == where[B(c, m)][0]
    for tick in range(t.ticks):
      for msg in timetable.messages(t, tick):
        assert not msg.forward or F(msg.boundary, msg.microbatch) in t.ops[msg.sender][tick]
        assert msg.forward or B(msg.boundary + 1, msg.microbatch) in t.ops[msg.sender][tick]


def test_zero_bubble_h1_stashes_what_1f1b_does():
  """W(s, m) before F(s, m+S): at most min(M, S) inputs held on any device, 1F1B's stash slots."""
  for S, M in SIZES:
    zb = schedules.parse("zb-h1").train_table(S, M)
    one_f_one_b = schedules.OneFOneB().train_table(S, M)
    assert timetable.most_inputs_held(zb) == timetable.most_inputs_held(one_f_one_b) == min(M, S)


def test_zero_bubble_h1_bubble_is_below_1f1bs():
  """F, B, W of 1 unit: below 1F1B's (S-1)/(M+S-1) for S > 1, and (S-1)/(3M+S-1) once M >= S."""
  for S, M in SIZES:
    bubble = timetable.bubble_fraction(schedules.parse("zb-h1").train_table(S, M))
    assert S == 1 or bubble < timetable.bubble_fraction(schedules.OneFOneB().train_table(S, M))
    if M >= S:
      assert bubble == pytest.approx((S - 1) / (3 * M + S - 1), abs=1e-12)
