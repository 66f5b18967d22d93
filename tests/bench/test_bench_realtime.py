"""bench.realtime against the session's CPU mesh: sessions speak at a microphone's pace, the server's turn detection
commits each turn, the spoken answer's first audio is timed from the commit, and speech over an answer stops it."""

import pytest

from bench import realtime, results


@pytest.mark.timeout(600)
def test_realtime_sessions_are_timed_from_the_commit_and_barge_in(mesh, tmp_path):
    out = tmp_path / "realtime.json"
    realtime.main(["--config", str(mesh.config_path), "--sessions", "1,2", "--turns", "1", "--speech-seconds", "1",
                   "--silence-seconds", "0.8", "--tokens", "8", "--frames", "400", "--barge-after", "0.1",
                   "--out", str(out)])
    cells = results.read(out)["cells"]
    assert [c["sessions"] for c in cells] == [1, 2]
    for c in cells:
        assert c["failures"] == [] and c["turns"] == c["sessions"], c
        assert 0 < c["first_audio_p50"] <= c["first_audio_p99"] < 10.0, c
        # every answer is cut by the speech over it, long before its 400 frames end
        assert c["barge_ins"] == c["sessions"] and 0 <= c["barge_in_p50"] <= c["barge_in_p99"] < 3.0, c
        assert 0 <= c["stopped_p50"] <= c["stopped_p99"] < 1.0, c  # the detector's start ends the turn at once
