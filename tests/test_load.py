"""Load: ``dew-ray serve`` at four times its slots, through bench/load.py's driver at a test's size.

Nothing is timed here (bench/load.py prints the latency and memory figures); what must
hold under load is checked: every request answered once with its own prompt, the bad ones
refused with a 400 that names the problem, and the server's memory not growing from one
wave of requests to the next.
"""

import pytest
from conftest import import_from

load = import_from("bench", "load")


@pytest.mark.slow
def test_the_front_answers_every_request_once_under_four_times_its_slots():
    result = load.front_load(requests=96, concurrency=32, waves=2, slots=8, capacity=64, max_tokens=8, bad_every=8)
    assert (result["lost"], result["lost_examples"]) == (0, [])
    assert (result["good"], result["bad"]) == (168, 24)
    assert (result["wrong"], result["duplicate_ids"], result["unnamed_errors"], result["misrefused"]) == (0, 0, 0, 0)
    assert result["statuses"] == [200, 400]
    after_first, after_second = result["rss_mib"][1:]
    assert after_second - after_first < 64, result["rss_mib"]  # a leak per request would show between equal waves
