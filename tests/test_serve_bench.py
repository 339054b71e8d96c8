"""`benchmarks.serve.rates`: the aggregate runs from the first request sent to the last end, the steady
state counts only the tokens that arrived while every stream was decoding."""

from __future__ import annotations

import pytest

from benchmarks.serve import rates


def test_rates_from_per_chunk_token_counts():
    # stream a: sent 0, tokens at 1 (1), 2 (5), 3 (9), ends 3; stream b: sent 0.5, tokens at 1.5 (4),
    # 2.5 (8), 4 (12), ends 4. All decode from 1.5 (b's first) to 3 (a's last).
    a = (0.0, 1.0, 3.0, 9, [(1.0, 1), (2.0, 5), (3.0, 9)])
    b = (0.5, 1.5, 4.0, 12, [(1.5, 4), (2.5, 8), (4.0, 12)])
    r = rates([a, b])
    assert r["tokens"] == 21 and r["wall"] == 4.0 and r["agg"] == pytest.approx(21 / 4)
    assert r["window"] == pytest.approx(1.5)
    # in (1.5, 3]: a gets 9 - 1 = 8 tokens, b 8 - 4 = 4 tokens
    assert r["steady"] == pytest.approx(12 / 1.5)
    # after each stream's first event: a 8 tokens over 2 s, b 8 tokens over 2.5 s
    assert sorted(r["decode"]) == pytest.approx([8 / 2.5, 8 / 2.0])


def test_rates_without_counts_spread_each_stream_evenly():
    a = (0.0, 1.0, 3.0, 9, None)
    b = (0.5, 1.5, 4.0, 12, None)
    r = rates([a, b])
    assert r["steady"] == pytest.approx(8 / 2.0 + 11 / 2.5)


def test_no_window_when_a_stream_ends_before_another_starts():
    a = (0.0, 0.5, 1.0, 4, [(0.5, 1), (1.0, 4)])
    b = (0.0, 2.0, 3.0, 4, [(2.0, 1), (3.0, 4)])
    r = rates([a, b])
    assert r["steady"] is None and r["window"] == 0.0 and r["agg"] == pytest.approx(8 / 3)


def test_no_steady_state_when_the_events_bunch():
    """One stream whose later events all arrived within a millisecond of its first: no steady state (its
    'rate' would be tokens over almost no time)."""
    a = (0.0, 1.0, 1.001, 32, [(1.0, 1), (1.0005, 17), (1.001, 32)])
    r = rates([a])
    assert r["steady"] is None and r["agg"] == pytest.approx(32 / 1.001)
