"""The exit codes of every command, the pytest plugin's and the call watchdog's (docs/cli.md)."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """How a command ends; an int, so that `main` returns it and `sys.exit` takes it as it is."""

    OK = 0  # everything holds
    FAIL = 1  # a check or stage out of tolerance, a gate breach, a search's finding
    USAGE = 2  # a usage error, unreadable input, an interrupted or incomplete run, nothing checked
    IMPLEMENTATION = 3  # the implementation under test raised, timed out or broke the adapter contract
