"""batchkit.metrics: the whole-run histogram, the recent window, and summaries that merge."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchkit.metrics import RELATIVE_ERROR, LatencyHistogram, LatencySummary, SampleWindow, summarize

QS = (0, 1, 10, 50, 90, 99, 99.9, 100)


def _histogram(seconds: list[float]) -> LatencyHistogram:
    h = LatencyHistogram()
    h.record_many(seconds)
    return h


class TestSampleWindow:
    def test_summary_counts_every_sample_past_the_window(self) -> None:
        """``summary()`` is the whole run: after more samples than the window holds, its count is
        every sample added and its max the run's max, even when the max left the window."""
        w = SampleWindow(size=10)
        w.add(5.0)
        for _ in range(24):
            w.add(0.001)
        s = w.summary()
        assert (s.count, s.max_ms) == (25, 5000.0)
        assert s.mean_ms == pytest.approx((5.0 + 24 * 0.001) / 25 * 1e3)

    def test_recent_summarises_only_the_window_exactly(self) -> None:
        """``recent()`` is the last ``size`` samples, with exact (interpolated) percentiles."""
        w = SampleWindow(size=4)
        w.extend([9.0, 1.0, 2.0, 3.0, 4.0])
        assert w.recent() == summarize([1.0, 2.0, 3.0, 4.0])
        assert w.recent().count == len(w) == 4
        assert w.recent().histogram is None

    def test_since_reads_the_samples_still_in_the_window(self) -> None:
        """``since(seen)`` (what AdaptiveTuner reads) returns the samples after the first ``seen``
        that the window still holds, and the new total."""
        w = SampleWindow(size=3)
        w.extend([0.1, 0.2, 0.3, 0.4, 0.5])
        assert w.since(3) == ([0.4, 0.5], 5)
        assert w.since(0) == ([0.3, 0.4, 0.5], 5)
        assert w.since(5) == ([], 5)

    def test_clear_empties_the_window_and_keeps_the_run(self) -> None:
        """``clear()`` forgets the recent window only: the whole-run count stays."""
        w = SampleWindow(size=3)
        w.extend([0.1, 0.2])
        w.clear()
        assert (len(w), w.total, w.summary().count, w.recent().count) == (0, 2, 2, 0)

    def test_a_size_below_one_is_refused(self) -> None:
        """A window of no sample is a ValueError naming ``size``."""
        with pytest.raises(ValueError, match="size must be positive"):
            SampleWindow(size=0)


class TestLatencyHistogram:
    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.floats(min_value=1e-8, max_value=1e5), min_size=1, max_size=300), st.sampled_from(QS))
    def test_a_percentile_is_within_the_relative_error_of_the_nearest_rank_sample(
        self, samples: list[float], q: float
    ) -> None:
        """Each percentile is within RELATIVE_ERROR (1/128) of the sample of its nearest rank."""
        exact = float(np.percentile(samples, q, method="inverted_cdf"))
        assert abs(_histogram(samples).percentile(q) - exact) <= RELATIVE_ERROR * exact

    def test_the_error_bound_holds_on_a_long_heavy_tailed_run(self) -> None:
        """50,000 log-normal latencies (folded in several bulks): p50, p90, p99 within 1/128 of the
        exact ones; count and max exact, mean exact up to float rounding."""
        samples = np.random.default_rng(0).lognormal(-4.0, 1.5, 50_000)
        s = _histogram(samples.tolist()).summary()
        for got, q in ((s.p50_ms, 50), (s.p90_ms, 90), (s.p99_ms, 99)):
            exact = float(np.percentile(samples, q, method="inverted_cdf")) * 1e3
            assert abs(got - exact) <= RELATIVE_ERROR * exact
        assert (s.count, s.max_ms) == (50_000, float(samples.max()) * 1e3)
        assert s.mean_ms == pytest.approx(float(samples.mean()) * 1e3, rel=1e-12)

    def test_samples_outside_the_bucket_range_report_the_exact_min_and_max(self) -> None:
        """Zero, a negative clock step and a sample past 12 days land in the edge buckets, whose
        percentiles are the exact min and max."""
        h = _histogram([-0.5, 0.0, 0.0, 2.0e6])
        assert (h.percentile(0), h.percentile(50), h.percentile(100)) == (-0.5, 0.0, 2.0e6)

    def test_an_empty_histogram_summarises_as_nan(self) -> None:
        """No sample: count 0 and ``nan`` percentiles."""
        s = LatencyHistogram().summary()
        assert s.count == 0
        assert all(math.isnan(v) for v in (s.mean_ms, s.p50_ms, s.p99_ms, s.max_ms))
        assert math.isnan(LatencyHistogram().percentile(50))

    def test_a_percentile_outside_0_to_100_is_refused(self) -> None:
        """``percentile(q)`` takes q in 0..100 and names it otherwise."""
        with pytest.raises(ValueError, match=r"q must be a percentile in 0\.\.100"):
            _histogram([1.0]).percentile(101)

    def test_a_summary_keeps_its_own_copy(self) -> None:
        """Samples recorded after a summary was taken change neither it nor its histogram."""
        h = _histogram([0.001])
        s = h.summary()
        h.record_many([1.0] * 5000)
        assert s.count == 1
        assert s.histogram is not None
        assert s.histogram.count == 1

    def test_buckets_hold_their_samples_below_their_upper_bound(self) -> None:
        """``buckets()`` lists each non-empty bucket's upper bound and count, in order."""
        buckets = _histogram([0.001, 0.001, 0.5, 1e7]).buckets()
        assert [n for _, n in buckets] == [2, 1, 1]
        bounds = [b for b, _ in buckets]
        assert bounds == sorted(bounds)
        assert 0.001 < bounds[0] <= 0.001 * (1 + 2 * RELATIVE_ERROR)
        assert bounds[-1] == math.inf

    def test_merge_adds_the_other_histogram(self) -> None:
        """``merge`` adds the other's samples in place and leaves the other unchanged."""
        a, b = _histogram([0.1]), _histogram([0.2, 0.3])
        a.merge(b)
        assert (a.count, b.count, a.percentile(100)) == (3, 2, 0.3)
        with pytest.raises(TypeError, match=r"other must be a batchkit\.metrics\.LatencyHistogram"):
            a.merge(object())  # type: ignore[arg-type]


class TestMergingSummaries:
    def test_merged_summaries_are_the_summary_of_all_their_samples(self) -> None:
        """Summaries of three histograms merge into the summary of one histogram of all the
        samples: percentiles of the merged run, not averages of percentiles."""
        samples = np.random.default_rng(1).exponential(0.02, 9_000).tolist()
        parts = [_histogram(samples[i::3]).summary() for i in range(3)]
        merged, whole = LatencySummary.merge(*parts), _histogram(samples).summary()
        assert (merged.count, merged.p50_ms, merged.p90_ms, merged.p99_ms, merged.max_ms) == (
            9_000,
            whole.p50_ms,
            whole.p90_ms,
            whole.p99_ms,
            whole.max_ms,
        )
        assert merged.mean_ms == pytest.approx(whole.mean_ms, rel=1e-12)

    def test_none_and_empty_summaries_add_nothing(self) -> None:
        """None (a statistics field never filled) and an empty summary contribute no sample."""
        s = _histogram([0.004]).summary()
        assert LatencySummary.merge(None, LatencyHistogram().summary(), s) == s
        assert LatencySummary.merge().count == 0

    def test_a_summary_without_histogram_is_refused(self) -> None:
        """A recent-window summary (exact, no buckets) cannot be merged: ValueError names the
        whole-run field to merge instead."""
        with pytest.raises(ValueError, match=r"merge whole-run summaries \(statistics\(\).latency\)"):
            LatencySummary.merge(summarize([0.1, 0.2]))

    def test_a_summary_survives_pickling_with_its_histogram(self) -> None:
        """A summary read from another process (a Ray replica's statistics) still merges."""
        s = _histogram([0.01, 0.02]).summary()
        back = pickle.loads(pickle.dumps(s))
        assert LatencySummary.merge(back, s).count == 4
