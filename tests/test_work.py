"""Long work (model build, checkpoint pull, log replay) as /status and the log show it: node.services.WorkBoard."""

import logging

import pytest

from swarmd.node.services import WorkBoard

pytestmark = pytest.mark.beside  # pure computation or virtual time (tests/conftest.py)


def test_work_in_progress_is_listed_logged_at_intervals_and_gone_when_done(caplog):
    now = [100.0]
    board = WorkBoard(logging.getLogger("test.work"), every=5.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="test.work"):
        with board.track("checkpoint pull", total=4_000_000, unit="B") as work:
            assert board.view() == [{"what": "checkpoint pull", "done": 0, "total": 4_000_000, "unit": "B",
                                     "percent": 0.0, "elapsed_s": 0.0}]
            now[0] += 1
            work.update(1_000_000)  # within the interval: shown, not logged
            assert board.view()[0]["percent"] == 25.0 and not caplog.records
            now[0] += 5
            work.update(3_000_000)
            assert [r.getMessage() for r in caplog.records] == [
                "checkpoint pull: 75% (3.0 MB of 4.0 MB), 6 s, about 2 s left"]
            with board.track("model build") as build:  # no total: elapsed time only
                now[0] += 1
                assert [w["what"] for w in board.view()] == ["checkpoint pull", "model build"]
                assert build.text() == "1 s" and board.view()[1]["percent"] is None
        now[0] += 1
    assert board.view() == []
    assert caplog.records[-1].getMessage() == "checkpoint pull: done in 7.0 s"
