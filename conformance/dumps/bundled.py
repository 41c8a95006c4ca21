"""The golden dump set the package carries: what `--dumps` means wherever a user leaves it out.

A wheel holds it as the package data `conformance/golden/` (setup.py maps the checkout's `golden/`
there, so git holds one copy); a checkout, or an editable install of one, reads `golden/` itself.
"""

from __future__ import annotations

from pathlib import Path

from kda_spec.dump_format import MANIFEST_FILE

_PACKAGE = Path(__file__).resolve().parents[1]  # conformance/
# Where each kind of install keeps the set: an installed wheel, then a checkout.
CANDIDATES = (_PACKAGE / "golden", _PACKAGE.parent / "golden")
NAME = "golden"


class NoBundledSet(ValueError):
    """Neither place holds the golden set (an install made without its package data)."""


def bundled_golden() -> Path:
    """The folder of the golden set this package carries, or a NoBundledSet naming where it looked."""
    for folder in CANDIDATES:
        if (folder / MANIFEST_FILE).is_file():
            return folder
    looked = " or ".join(str(folder / MANIFEST_FILE) for folder in CANDIDATES)
    raise NoBundledSet(f"the package carries no golden dump set (no {looked}); give --dumps DIR_OR_URL")


def dumps_or_bundled(url: str | None) -> str:
    """`url` as given, or the bundled golden set's folder when it is None (the option left out)."""
    return str(bundled_golden()) if url is None else url


def is_bundled(url: str) -> bool:
    """Whether `url` is the folder of the bundled golden set (however it was spelled)."""
    try:
        return Path(url).resolve() == bundled_golden().resolve()
    except (NoBundledSet, OSError, ValueError):
        return False


def dump_set_label(url: str, manifest_sha256: str) -> str:
    """How a report names the set that ran: `golden (bundled, manifest sha256 …)`, else the URL and
    its manifest's digest."""
    if is_bundled(url):
        return f"{NAME} (bundled, manifest sha256 {manifest_sha256})"
    return f"{url} (manifest sha256 {manifest_sha256})"
