"""Prints the fault table (one row per scenario run) at the end of the session."""

from __future__ import annotations


def pytest_terminal_summary(terminalreporter):
    from tests.faults.ledger import table
    from tests.faults.test_faults import ROWS

    if ROWS:
        terminalreporter.write_sep("=", "fault scenarios (tests/faults)")
        terminalreporter.write_line(table(ROWS))
        for row in ROWS:
            if row["errors"]:
                terminalreporter.write_line(f"  {row['scenario']}: errored as {row['errors']}")
