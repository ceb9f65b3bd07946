"""A pytest plugin for device runs cut short by a time limit: every test's outcome and duration, and each failure's
traceback, appended to ``$PYTEST_LIVE_LOG`` as the report arrives (with xdist: in the controller), so a run killed
by ``timeout`` still says what failed and why, and which tests took the time.

    PYTHONPATH=dev PYTEST_LIVE_LOG=/tmp/live.log timeout 200 python -m pytest -p pytest_live_log -m gpu -n 8 tests
"""

from __future__ import annotations

import os


def pytest_runtest_logreport(report):
    path = os.environ.get("PYTEST_LIVE_LOG")
    if not path or os.environ.get("PYTEST_XDIST_WORKER") or (report.when != "call" and report.passed):
        return
    outcome = "xfailed" if hasattr(report, "wasxfail") and report.skipped else report.outcome
    with open(path, "a") as f:
        f.write(f"{outcome.upper():8} {report.duration:8.2f}s {report.when:8} {report.nodeid}\n")
        if report.failed:
            f.write("".join("    " + line + "\n" for line in report.longreprtext.splitlines()[-60:]))
