"""The reliability battery's summary of a run's requests."""

from bench.battery import summary


def test_a_summary_keeps_the_words_of_unexpected_failures_only():
    def r(status, details=None, latency=1.0):
        return {"status": status, "details": details, "ttft": 0.1, "ttfa": None, "latency": latency}

    results = ([r("OK")] * 4 + [r("RESOURCE_EXHAUSTED", "at capacity", 0.002)] * 3 + [r("DEADLINE_EXCEEDED", "late")]
               + [r("INTERNAL", f"boom {i % 4}") for i in range(8)] + [r("UNAVAILABLE", "talker down")])
    s = summary(results, seconds=2.0)
    assert s["statuses"] == {"OK": 4, "RESOURCE_EXHAUSTED": 3, "DEADLINE_EXCEEDED": 1, "INTERNAL": 8, "UNAVAILABLE": 1}
    assert s["errors"] == {"INTERNAL": ["boom 0", "boom 1", "boom 2"], "UNAVAILABLE": ["talker down"]}
    assert s["goodput_rps"] == 2.0 and s["refusal_p50"] == 0.002
