"""`jaxcomp.analysis.link`: a link written as `100mbit:20ms`, read back and printed the same."""
import math

import pytest

from jaxcomp.analysis.link import Link


@pytest.mark.parametrize("text, bandwidth_bps, latency_s", [
    ("100mbit:20ms", 1e8, 0.02), ("200mbit:50ms", 2e8, 0.05), ("1gbit", 1e9, 0.0), ("10Mbit:500us", 1e7, 5e-4),
    ("2.5gbit:0.05s", 2.5e9, 0.05), ("unshaped:1ms", math.inf, 1e-3), ("300kbit:0ms", 3e5, 0.0)])
def test_a_link_parses_its_rate_and_latency(text, bandwidth_bps, latency_s):
  link = Link.parse(text)
  assert link.bandwidth_bps == pytest.approx(bandwidth_bps) and link.latency_s == pytest.approx(latency_s)
  assert Link.parse(str(link)) == link


def test_a_link_prints_as_written():
  assert [str(Link.parse(t)) for t in ("100mbit:20ms", "1gbit", "unshaped", "10mbit:500us")] == [
      "100mbit:20ms", "1gbit", "unshaped", "10mbit:500us"]


@pytest.mark.parametrize("text, named", [("100mb:20ms", "'100mb'"), ("100mbit:20", "'20'"), ("fast", "'fast'"),
                                         ("0mbit", "'0mbit'"), ("100mbit:-1ms", "'-1ms'"), ("", "''")])
def test_a_bad_link_names_the_bad_part_and_the_form(text, named):
  with pytest.raises(ValueError, match=named) as err:
    Link.parse(text)
  assert "e.g." in str(err.value)


def test_a_message_pays_the_latency_once_and_its_bits_at_the_rate():
  link = Link.parse("100mbit:20ms")
  assert link.seconds(1_250_000) == pytest.approx(0.02 + 0.1)
  assert link.seconds(1_250_000, messages=3) == pytest.approx(0.06 + 0.1)
  assert Link.parse("unshaped").seconds(10**9) == 0.0
