"""What the commands write: a run's report folder, and a file such as diff's PNG.

A run removes the previous run's reports before anything else, so that the reports on disk always
belong to the last run: a run that stops early leaves none that `gate` could pass.
"""

from __future__ import annotations

from pathlib import Path

from conformance.reports.positions import POSITION_FILES

REPORT_FILES = ("report.json", "report.md", "junit.xml", *POSITION_FILES)


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
