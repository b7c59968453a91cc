"""The heartbeat's latency bucket counts, and the dashboard's history made from several workers' intervals."""

import json

import pytest

from monitor.dashboard.data import history
from monitor.percentiles import quantile
from producer.keys import Keys
from worker.latency_window import TTFT_BUCKETS, LatencyWindow, bucket_of


def test_bucket_of_and_quantile():
    assert bucket_of(TTFT_BUCKETS, 0.01) == "0.01" and bucket_of(TTFT_BUCKETS, 0.011) == "0.025"
    assert bucket_of(TTFT_BUCKETS, 1e9) == "+Inf"
    assert quantile({}, 0.5) is None
    # 10 observations in (0, 0.1], 10 in (0.1, 0.2]: the median is the first bucket's top.
    assert quantile({"0.1": 10, "0.2": 10}, 0.5) == pytest.approx(0.1)
    assert quantile({"0.1": 10, "0.2": 10}, 0.75) == pytest.approx(0.15)
    assert quantile({"1.0": 1, "+Inf": 3}, 0.9) == 1.0  # past the last bound: the last bound


def test_window_take_starts_a_new_interval():
    w = LatencyWindow()
    w.generated(5)
    w.ttft(0.2)
    w.tpot(0.02)
    assert w.take() == (5, {"0.25": 1}, {"0.025": 1})
    assert w.take() == (0, {}, {})


def test_history_merges_workers_exactly(rds, queue):
    # Two workers in one slot: one saw fast first tokens, the other slow ones. The fleet's median lies between;
    # an average of per-worker medians could not be told from the counts.
    k = Keys(queue)
    rds.xadd(k.stats, {"w": "a", "tokens": 100, "ttft": json.dumps({"0.1": 3}), "tpot": "{}"})
    rds.xadd(k.stats, {"w": "b", "tokens": 50, "ttft": json.dumps({"1.0": 1}), "tpot": json.dumps({"0.05": 2})})
    h = history(rds, [queue], minutes=1, step_s=10)
    last = h["slots"][-1]
    assert sum(s["tokens_per_s"] for s in h["slots"]) * 10 == pytest.approx(150)
    assert last["jobs"] == 4 and last["ttft_p50"] == pytest.approx(0.1 * 2 / 3)
    assert last["tpot_p50"] == pytest.approx(0.025)
