"""What the commands write: a run's report folder, and a file such as diff's PNG.

A run removes the previous run's reports before anything else, so that the reports on disk always
belong to the last run: a run that stops early leaves none that `gate` could pass.
"""

from __future__ import annotations

import json
from pathlib import Path

from conformance.positions import POSITION_FILES

REPORT_FILES = ("report.json", "report.md", "junit.xml", *POSITION_FILES)
_PYTEST_NO_TESTS_COLLECTED = 5


def clear_report_dir(folder: Path) -> None:
    """Remove the previous run's reports from `folder` and make sure new ones can be written there;
    a ValueError says why not."""
    try:
        for name in REPORT_FILES:
            (folder / name).unlink(missing_ok=True)
        folder.mkdir(parents=True, exist_ok=True)
        check_writable_file(folder / ".write-probe", "--report-dir")
    except OSError as err:
        raise ValueError(f"--report-dir {folder}: cannot write the reports there ({err})") from None


def check_writable_file(path: Path, option: str) -> None:
    """A ValueError unless `path` can be written (it is left as it was)."""
    existed = path.exists()
    try:
        with path.open("ab"):
            pass
        if not existed:
            path.unlink()
    except OSError as err:
        raise ValueError(f"{option} {path}: cannot write there ({err.strerror or err})") from None


def nothing_checked(folder: Path, pytest_code: int, keyword: str | None) -> str | None:
    """Why a finished run compared nothing (no check selected, or every check skipped), else None."""
    if pytest_code == _PYTEST_NO_TESTS_COLLECTED:
        if keyword:
            return (
                f"nothing was checked: -k {keyword!r} matches no check "
                "(check ids read <case>-<dtype>-<check>, as T65-fp32-layer)"
            )
        return "nothing was checked: no check was selected"
    try:
        checks = json.loads((folder / "report.json").read_text())["checks"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # the run stopped before writing its report; pytest said why
    if checks and all(check["status"] == "skipped" for check in checks):
        first = checks[0]
        return (
            f"nothing was checked: all {len(checks)} checks were skipped "
            f"(as {first['id']}: {first['message']})"
        )
    return None
