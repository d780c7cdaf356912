"""The planner (`python -m jaxcomp.plan`): a user's own Flax pipeline through the API, the shipped step-inflation
table, the search's pieces, and the command's refusals."""
import json
import typing

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from jaxcomp import plan
from jaxcomp.analysis import netsim, step_cost, step_table, targets
from jaxcomp.analysis.link import Link
from jaxcomp.compress.spec import parse_boundary
from jaxcomp.parallel import schedules
from jaxcomp.pipeline import FlaxStage, Pipeline


class Hidden(nn.Module):
  """A user's own layer: x -> relu(x W + b), 64 wide."""

  @nn.compact
  def __call__(self, x, train: bool = False):
    return nn.relu(nn.Dense(64)(x))


class Classifier(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = False):
    return nn.Dense(4)(nn.relu(nn.Dense(64)(x)))


def test_a_user_built_flax_pipeline_gets_a_ranked_plan_through_the_api():
  """Two stages of the user's own modules on a slow link: every method that keeps the model gets a row (ReparamSSN,
  a change of the model, none); TopK sends a fraction of fp32's bytes and steps faster; rows with a T (a measured
  inflation) come first, ranked by it, then those with only a bound or none."""
  pipe = Pipeline((FlaxStage(Hidden()), FlaxStage(Classifier())), parse_boundary("none", "none"),
                  jaxcomp.losses.classification, "x", microbatches=2)
  x = jax.random.normal(jax.random.key(0), (16, 32))
  batch = {"x": x, "label": (x[:, 0] > 0).astype(jnp.int32), "id": jnp.arange(16)}
  link = Link.parse("1mbit:1ms")
  ranked = plan.for_pipeline(pipe, batch, [link], names=("fp32", "top10-q8-reuse", "bf16", "ssn"),
                             clock=step_cost.Measured(1), microbatches=[2, 4])
  rows = {r.choice.method: r for r in ranked[link]}
  assert set(rows) == {"fp32", "top10-q8-reuse", "bf16"}
  assert rows["top10-q8-reuse"].choice.bytes_per_token < rows["fp32"].choice.bytes_per_token / 5
  assert rows["top10-q8-reuse"].choice.step_s < rows["fp32"].choice.step_s
  full = [r.T is not None and r.T_high < float("inf") for r in ranked[link]]
  assert full == sorted(full, reverse=True)  # rows with a T first, then those with a bound or none
  with_t = [r.T for r, has_t in zip(ranked[link], full) if has_t]
  assert with_t == sorted(with_t) and rows["fp32"].T == pytest.approx(plan.DENSE_STEPS * rows["fp32"].choice.step_s)


def test_the_shipped_table_says_where_it_comes_from_and_projects_with_a_range():
  table = step_table.load()
  assert {"command", "commit", "machine", "date"} <= set(table["provenance"])
  fp32 = step_table.inflation(table, "fp32", 2925, 1024)
  assert (fp32.value, fp32.low, fp32.high, fp32.extrapolated) == (1.0, 1.0, 1.0, False)
  topk = step_table.inflation(table, "top10-q8-reuse", 2925, 1024)
  assert topk.low <= topk.value <= topk.high and topk.extrapolated and topk.value > 1
  assert step_table.inflation(table, "aqsgd-fw2-bw4", 2925, 1024) is None  # not on the ladder: no T
  tuned = step_table.load(regime="finetune")  # the fine-tuning study's runs, with their own provenance
  assert "experiments.finetune" in tuned["provenance"]["command"] and "experiments.ladder" in table["provenance"]["command"]
  assert step_table.inflation(tuned, "aqsgd-fw3-bw6", 2925, 1024).value > 1


def test_costs_between_the_compiled_microbatch_counts_are_affine_in_tokens():
  a = step_cost.StageCosts("s", (1.0, 2.0), (3.0, 4.0), ((0.1, 0.2),), ((0.3, 0.4),))
  b = step_cost.StageCosts("s", (3.0, 6.0), (7.0, 8.0), ((0.3, 0.6),), ((0.5, 0.8),))
  mid = plan.interpolate(a, 100, b, 300, 200)
  np.testing.assert_allclose(mid.fwd_s, (2.0, 4.0))
  np.testing.assert_allclose(mid.encode_s, ((0.2, 0.4),))
  assert plan.interpolate(a, 100, b, 300, 100).bwd_s == a.bwd_s


def test_microbatch_choices_divide_the_batch():
  assert plan.microbatch_choices(8, 512) == [8, 16, 32, 64]
  assert plan.microbatch_choices(4, 12) == [4]
  with pytest.raises(ValueError, match="each must divide the 12 examples"):
    plan.microbatch_choices(4, 12, [5])


@pytest.mark.parametrize("argv, match", [
    (["--model", "gpt5"], "--model gpt5: unknown model"),
    (["--model", "protocol", "--width", "2048"], "needs --width W and --depth L"),
    (["--device", "h999-8"], "--device h999-8: unknown target"),
    (["--stages", "9"], "--stages 9: --model protocol-203m has 8 blocks"),
    (["--methods", "fp32,top5"], "--methods: unknown method 'top5'"),
    (["--schedules", "2f2b"], "--schedules: schedule must be one of"),
    (["--dense-steps", "0"], "--dense-steps 0"),
])
def test_bad_input_is_refused_with_one_line_naming_the_flag(argv, match, tmp_path):
  with pytest.raises(ValueError, match=match):
    plan.main([*argv, "--out", str(tmp_path)])
  assert not any(tmp_path.iterdir())  # nothing written


def test_a_target_whose_compiler_is_missing_is_one_error_naming_the_device_and_the_install(tmp_path, monkeypatch):
  def missing(target):
    raise RuntimeError(f"compiling for {target.name} needs the CUDA PJRT plugin (pip install jax-cuda12-pjrt)")
  monkeypatch.setattr(targets, "compile_only_devices", missing)
  with pytest.raises(ValueError, match=r"^--device h100-8: compiling for h100-8 needs .*pip install"):
    plan.main(["--model", "protocol-tiny", "--stages", "2", "--device", "h100-8", "--out", str(tmp_path)])


def test_a_bad_link_is_an_argparse_error_naming_it(capsys):
  with pytest.raises(SystemExit):
    plan.main(["--link", "fast"])
  assert "--link" in capsys.readouterr().err


@pytest.mark.slow
def test_the_dense_and_reparamssn_records_steps_are_reproduced_on_h100(tmp_path):
  """Protocol NanoGPT's setting (protocol-203m, 8 stages, 1F1B, 200 Mb/s + 50 ms on the inbound meter, compute
  compiled for H100s): fp32's step at 64 microbatches within 5% of the dense record's 100.475 s, ReparamSSN's at 32
  within 10% of its record's 19.889 s (its model: the subspace blocks and the 11,292-wide MLP)."""
  pytest.importorskip("jax_plugins.xla_cuda12", reason="the CUDA PJRT plugin is not installed "
                      "(pip install jax-cuda12-pjrt==<jax version>)")
  ranked = plan.main(["--model", "protocol-203m", "--stages", "8", "--link", "200mbit:50ms", "--meter", "inbound",
                      "--device", "h100-8", "--methods", "fp32,ssn", "--schedules", "1f1b", "--microbatches", "32,64",
                      "--out", str(tmp_path)])
  (rows,) = ranked.values()
  step = {r.choice.method: r.choice for r in rows}
  assert step["fp32"].microbatches == 64 and step["fp32"].step_s == pytest.approx(100.475, rel=0.05)
  assert step["ssn"].microbatches == 32 and step["ssn"].step_s == pytest.approx(19.889, rel=0.10)
  assert step["ssn"].bytes_per_token == 644



def test_a_method_that_missed_its_target_at_the_longest_horizon_has_only_a_lower_bound():
  point = lambda v, censored=False: {"inflation": v, "censored": censored}
  table = {"rungs": {"w128-h100": {"width": 128, "horizon": 100, "methods": {"m": [point(1.5)]}},
                     "w128-h300": {"width": 128, "horizon": 300, "methods": {"m": [point(2.1, True)]}}}}
  got = step_table.inflation(table, "m", 2925, 1024)
  assert (got.low, got.high) == (2.1, float("inf")) and "did not reach the target" in got.source
  del table["rungs"]["w128-h300"]
  assert step_table.inflation(table, "m", 2925, 1024).value == 1.5


def test_a_target_missed_at_a_longer_horizon_leaves_the_horizons_it_reached_to_their_points():
  """Reached at H 100 (1.5 at width 128, 1.7 at 256), missed at H 300 (above 2.1): at H 100 the points give the
  inflation (extrapolated only outside the horizons and widths measured); between 100 and 300 it has the points' low
  end and no upper bound; from 300 on, only the bound."""
  point = lambda v, censored=False: {"inflation": v, "censored": censored}
  table = {"rungs": {"w128-h100": {"width": 128, "horizon": 100, "methods": {"m": [point(1.5)]}},
                     "w256-h100": {"width": 256, "horizon": 100, "methods": {"m": [point(1.7)]}},
                     "w128-h300": {"width": 128, "horizon": 300, "methods": {"m": [point(2.1, True)]}}}}
  at_100 = step_table.inflation(table, "m", 100, 128)
  assert (at_100.low, at_100.high) == (1.5, 1.7) and "did not reach" not in at_100.source
  assert not at_100.extrapolated and not step_table.inflation(table, "m", 100, 256).extrapolated
  assert step_table.inflation(table, "m", 100, 512).extrapolated and step_table.inflation(table, "m", 50, 128).extrapolated
  between = step_table.inflation(table, "m", 200, 128)
  assert (between.low, between.high) == (1.5, float("inf")) and "no upper bound between" in between.source
  assert (step_table.inflation(table, "m", 300, 128).low, step_table.inflation(table, "m", 300, 128).high) == (
      2.1, float("inf"))


def test_t_on_an_ideal_link_ranges_up_to_the_real_links_measured_slowdown_and_on_the_benchmarks_meter_1_percent():
  """The same step and inflation: on the per-direction link T's range reaches STEP_RANGE's +39% (what a real shaped
  link measured beyond the planned step); on Protocol NanoGPT's inbound meter +-1%; every meter has its range."""
  assert set(plan.STEP_RANGE) == set(typing.get_args(netsim.Meter))
  link = Link.parse("10mbit:5ms")
  choice = plan.Choice("fp32", 4, "gpipe", False, None, link, 2.0, {"link": 2.0}, 1024.0)
  table = {"rungs": {"h100": {"width": 128, "horizon": 100, "methods": {}}}}
  ideal = plan.rank([choice], table, 100, 128, "per_direction")[link][0]
  metered = plan.rank([choice], table, 100, 128, "inbound")[link][0]
  assert ideal.T == metered.T == 200.0
  assert (ideal.T_low, ideal.T_high) == pytest.approx((198.0, 278.0))
  assert (metered.T_low, metered.T_high) == pytest.approx((198.0, 202.0))


def test_the_winner_of_a_custom_protocol_model_is_python_that_builds_its_pipeline_and_executor():
  """`--model protocol` has no experiment flag: its winner is printed as Python, which runs as printed."""
  choice = plan.Choice("chan-tile64-fw3-bw4", 4, "1f1b", True, None, Link.parse("100mbit:30ms"), 1.0, {}, 1.0)
  code = plan.command(choice, "protocol", 2, 8, 32, (64, 2, 256))
  scope = {}
  exec(code, scope)
  assert scope["pipe"].microbatches == 4 and len(scope["pipe"].stages) == 2
  assert scope["executor"].schedule == schedules.parse("1f1b", overlap=True)


def test_inflation_measured_on_other_stages_than_the_users_says_so():
  """A table measured on 4 stages: at 4 stages a measured point is not extrapolated; at 8 (7 compressed boundaries,
  each costing steps) it is, and its source says on how many stages it was measured; the dense run is exact."""
  point = lambda v: {"inflation": v, "censored": False}
  table = {"stages": 4, "rungs": {"h100": {"width": 128, "horizon": 100, "methods": {"m": [point(1.2), point(1.3)]}}}}
  same = step_table.inflation(table, "m", 100, 128, stages=4)
  other = step_table.inflation(table, "m", 100, 128, stages=8)
  assert not same.extrapolated and other.extrapolated and (other.value, other.low, other.high) == (
      same.value, same.low, same.high)
  assert "measured on 4 stages (3 compressed boundaries), here 8" in other.source
  assert not step_table.inflation(table, "fp32", 100, 128, stages=8).extrapolated


def test_a_calibrated_table_raises_the_high_end_beyond_the_horizons_it_measured_by_the_records_log_ratio():
  """The calibration method measured 1.2 at H 100 and 300 and its record 1.44 at D 1,000: k = log 1.44 / log 1.2 = 2,
  so beyond H 300 every projection's high end is squared; a method with no inflation keeps none; inside the horizons
  measured, and without a calibration, nothing changes."""
  point = lambda v: {"inflation": v, "censored": False}
  rung = lambda h, **m: {"width": 128, "horizon": h, "methods": {k: [point(v) for v in vs] for k, vs in m.items()}}
  table = {"rungs": {"h100": rung(100, cal=[1.2, 1.2], m=[1.3, 1.5], flat=[1.0, 1.0]),
                     "h300": rung(300, cal=[1.2, 1.2], m=[1.4, 1.6], flat=[1.0, 1.0])},
           "calibration": {"method": "cal", "name": "the record", "record": {"250": 1.3, "1000": 1.44}}}
  plain = {**table, "calibration": None}
  far, far_plain = step_table.inflation(table, "m", 1000, 128), step_table.inflation(plain, "m", 1000, 128)
  assert far.value == far_plain.value and far.low == far_plain.low
  assert far.high == pytest.approx(far_plain.high ** 2) and "power 2.00" in far.source
  assert step_table.inflation(table, "flat", 1000, 128).high == 1.0
  assert step_table.inflation(table, "m", 200, 128) == step_table.inflation(plain, "m", 200, 128)
  assert step_table.recorded({"250": 1.3, "1000": 1.44}, 500) == pytest.approx(1.37)  # linear in log D
  assert step_table.recorded({"250": 1.3, "1000": 1.44}, 4000) == 1.44  # its nearest end outside


def test_a_rerun_reads_every_estimate_from_the_store_and_plans_the_same(tmp_path, capsys):
  """--device v5e-8 on a toy model: the first run compiles its programs and keeps their estimates, saying on
  stderr which method it is at; a second run with the same store compiles none and gives the same steps."""
  argv = ["--model", "protocol-tiny", "--stages", "2", "--batch", "4", "--seq", "16", "--device", "v5e-8",
          "--methods", "fp32,bf16", "--schedules", "gpipe", "--microbatches", "2,4",
          "--estimates", str(tmp_path / "estimates.json")]
  first = plan.main([*argv, "--out", str(tmp_path / "first")])
  err = capsys.readouterr().err
  assert "[plan] method 1/2: fp32 (" in err and "[plan] method 2/2: bf16 (" in err and "programs compiled)" in err
  kept = json.loads((tmp_path / "estimates.json").read_text())
  assert kept and all(k.startswith(f"v5e-8 jax {jax.__version__} ") for k in kept)
  second = plan.main([*argv, "--out", str(tmp_path / "second")])
  assert "0 programs compiled" in (tmp_path / "second" / "plan.md").read_text()
  assert "0 programs compiled" not in (tmp_path / "first" / "plan.md").read_text()
  steps = lambda ranked: {r.choice.method: r.choice.step_s for rows in ranked.values() for r in rows}
  assert steps(second) == steps(first)
