"""benchmarks.protocol_records at toy size: protocol-tiny on 4 stages with a stub clock whose times we choose (no
compile for a GPU here), the records' arithmetic checked against netsim and the stated formulas."""
import jax
import pytest

from benchmarks import protocol_records as pr
from jaxcomp import methods as registry
from jaxcomp.analysis.step_cost import op_seconds
from jaxcomp.analysis import netsim
from jaxcomp.analysis.link import Link
from jaxcomp.compress.spec import parse_boundary

OP_S = 2e-3  # every stage op and every codec op the stub clock times
LINK = Link.parse("1mbit:10ms")
# toy records: (name, bytes/token both ways, microbatches of the 16-block batch, published step s, steps, T)
RECORDS = (pr.Record("dense", 1024, 4, 20.0, 100, 2000.0), pr.Record("small", 160, 2, 4.0, 300, 1200.0))


class StubClock:
  """Abstract shapes, every op OP_S seconds."""
  source = "stub"

  def input(self, shape):
    return jax.ShapeDtypeStruct(shape.shape, shape.dtype)

  def output(self, fn, *args):
    return jax.eval_shape(fn, *args)

  def seconds(self, fn, *args):
    return OP_S


@pytest.fixture(scope="module")
def setup():
  return pr.protocol_setup("protocol-cpu", LINK, StubClock(), train_examples=16)


def test_a_record_sends_half_its_bytes_per_token_each_way_per_microbatch_token(setup):
  """protocol-cpu: 16 blocks of 128 tokens; 4 microbatches of 4 x 128 = 512 tokens, each message 512 x 1024 / 2 B;
  the step is netsim's on 1F1B with the inbound meter, each stage's ops the stub's OP_S plus its codecs' (OP_S
  each: encode after a forward and a backward, decode before them, none at the pipeline's ends)."""
  rows = pr.record_rows(setup, RECORDS)
  assert [r["tokens_per_microbatch"] for r in rows] == [512, 1024]
  assert [r["message_bytes"] for r in rows] == [512 * 1024 / 2, 1024 * 160 / 2]
  for r, rec in zip(rows, RECORDS):
    fwd_s = bwd_s = [2 * OP_S, 3 * OP_S, 3 * OP_S, 2 * OP_S]
    sent = [r["message_bytes"]] * 3
    expected = netsim.simulate_step(fwd_s, bwd_s, sent, sent, rec.microbatches, LINK, schedule="1f1b",
                                    overlap_sends=False, ticks=True, meter="inbound")
    assert r["step_s"] == pytest.approx(expected.makespan, rel=1e-12)
    assert r["error"] == pytest.approx(r["step_s"] / rec.step_s - 1)
    wire = 2 * rec.microbatches * (8 * r["message_bytes"] / 1e6 + 0.01)
    assert r["inbound_wire_s"] == pytest.approx(wire) and wire < r["step_s"]  # the wire bounds the step below
  assert "| dense | 1,024 | 4 x 512 | 262,144 |" in pr.render_records(rows)


def test_a_method_ties_a_record_at_its_T_over_its_faster_step_times_the_dense_records_steps(setup):
  """tie inflation = record T / (step s x the dense record's 2,925 steps), the method's faster step of the records'
  microbatch counts; its bytes per token from its boundary's wire_bytes at protocol-tiny's [mb, 128, 128] fp32."""
  methods = {n: registry.METHODS[n] for n in ("fp32", "tile64-fw3-bw4")}
  rows = {r["method"]: r for r in pr.method_rows(setup, methods, RECORDS)}
  assert rows["fp32"]["bytes_per_token"] == 2 * 128 * 4
  tile = parse_boundary(methods["tile64-fw3-bw4"].fwd, methods["tile64-fw3-bw4"].bwd)
  x = jax.ShapeDtypeStruct((4, 128, 128), "float32")
  assert rows["tile64-fw3-bw4"]["bytes_per_token"] == sum(tile.wire_bytes(x.shape, x.dtype)) / 512
  for r in rows.values():
    for rec in RECORDS:
      cfg = setup.run_config(r["fwd"], r["bwd"], None, rec.microbatches)
      assert r["step_s"][rec.microbatches] == setup.step_times.timeline(cfg).makespan
    best = min(r["step_s"].values())
    assert r["best_step_s"] == best
    assert r["tie"] == {rec.name: pytest.approx(rec.T / (best * 2925)) for rec in RECORDS}
  assert rows["tile64-fw3-bw4"]["best_step_s"] < rows["fp32"]["best_step_s"]  # fewer bytes on a slow link
  assert "| fp32 | `none` | `none` | 1,024.0 |" in pr.render_methods(list(rows.values()), RECORDS)


def test_the_stub_times_reach_netsim_through_op_seconds(setup):
  """The record rows' compute is the clock's: StepTimes' stage costs of the dense boundary, codecs added."""
  cfg = setup.run_config("none", "none", None, 4)
  setup.step_times.timeline(cfg)
  (costs_of,) = [c for key, c in setup.step_times.stage_costs.items() if key[2] == 4]
  assert op_seconds(costs_of(parse_boundary("none", "none"))) == ([2 * OP_S, 3 * OP_S, 3 * OP_S, 2 * OP_S],) * 2


def test_bad_flags_are_one_clear_error(capsys):
  with pytest.raises(SystemExit):
    pr.main(["--compile-for", "h100", "--methods", "none"])
  assert "the records' 8 stages need 8 chips, it has 1" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    pr.main(["--methods", "fp33"])
  assert "--methods: unknown ['fp33']" in capsys.readouterr().err
