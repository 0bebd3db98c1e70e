"""pytest plugin: append every test phase's duration to $PEAGLE_TEST_DURATIONS as it finishes
(``nodeid<TAB>phase<TAB>seconds<TAB>outcome``), so a run stopped by a time limit still says
where its time went (pytest's own ``--durations`` prints only at the end). Under pytest-xdist the
controller writes (workers' reports reach it).

    PEAGLE_TEST_DURATIONS=$OUT/durations.tsv PYTHONPATH=tools \\
        python -m pytest -p pytest_durations_log -n 8 tests
"""

from __future__ import annotations

import os


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("PEAGLE_TEST_DURATIONS")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(path, "a") as f:
        f.write(f"{report.nodeid}\t{report.when}\t{report.duration:.3f}\t{report.outcome}\n")
