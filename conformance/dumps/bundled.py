"""The dump sets the package carries: `golden` (kimi-linear), what `--dumps` means wherever a user leaves
it out, and `golden-glm5-next` (the glm5-next family), which `--dumps golden-glm5-next` names.

A wheel holds each as package data, `conformance/golden/` and `conformance/golden_glm5_next/` (setup.py
maps the checkout's `golden/` and `golden-glm5-next/` there, so git holds one copy); a checkout, or an
editable install of one, reads its folders themselves. A `--dumps` that names a bundled set is that set
unless a folder of that name exists where the command runs (a path is read as a path first).
"""

from __future__ import annotations

from pathlib import Path

from kda_spec.dump_format import MANIFEST_FILE

_PACKAGE = Path(__file__).resolve().parents[1]  # conformance/
NAME = "golden"  # the default set
GLM5_NEXT_NAME = "golden-glm5-next"
# Each bundled set's name (its checkout folder) -> its package data folder in conformance/ of a wheel.
PACKAGE_FOLDERS = {NAME: "golden", GLM5_NEXT_NAME: "golden_glm5_next"}


def candidates(name: str) -> tuple[Path, ...]:
    """Where each kind of install keeps the bundled set `name`: an installed wheel, then a checkout."""
    return (_PACKAGE / PACKAGE_FOLDERS[name], _PACKAGE.parent / name)


class NoBundledSet(ValueError):
    """Neither place holds the bundled set (an install made without its package data)."""


def bundled_set(name: str) -> Path:
    """The folder of the bundled set `name`, or a NoBundledSet naming where it looked."""
    looked = candidates(name)
    for folder in looked:
        if (folder / MANIFEST_FILE).is_file():
            return folder
    where = " or ".join(str(folder / MANIFEST_FILE) for folder in looked)
    raise NoBundledSet(f"the package carries no {name} dump set (no {where}); give --dumps DIR_OR_URL")


def bundled_golden() -> Path:
    """The folder of the default set, golden/."""
    return bundled_set(NAME)


def dumps_or_bundled(url: str | None) -> str:
    """`url` as given, the bundled golden set's folder when it is None (the option left out), or the
    bundled set's folder when `url` is a bundled set's name and no folder of that name is here."""
    if url is None:
        return str(bundled_golden())
    if url in PACKAGE_FOLDERS and not Path(url).exists():
        return str(bundled_set(url))
    return url


def bundled_name(url: str) -> str | None:
    """The name of the bundled set whose folder `url` is (however it was spelled), else None."""
    for name in PACKAGE_FOLDERS:
        try:
            if Path(url).resolve() == bundled_set(name).resolve():
                return name
        except (NoBundledSet, OSError, ValueError):
            continue
    return None


def is_bundled(url: str) -> bool:
    """Whether `url` is the folder of a bundled set."""
    return bundled_name(url) is not None


def dump_set_label(url: str, manifest_sha256: str) -> str:
    """How a report names the set that ran: `golden (bundled, manifest sha256 …)` (or
    `golden-glm5-next (bundled, …)`), else the URL and its manifest's digest."""
    name = bundled_name(url)
    if name is not None:
        return f"{name} (bundled, manifest sha256 {manifest_sha256})"
    return f"{url} (manifest sha256 {manifest_sha256})"
