"""The package's optional dependencies, the one rule every command follows without one: a single
`error:` line naming the `pip install` that brings it, exit 2, never a traceback.

Each optional module belongs to one extra of pyproject.toml. A command that needs one either asks
first (`require`), or lets the import fail and turns the ModuleNotFoundError into the same message at
its top (`missing_extra`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Iterable

DISTRIBUTION = "kda-conformance"
# module (top-level name) → the extra of pyproject.toml that installs it
EXTRA_OF_MODULE = {
    "flax": "kda-impl",  # the built-in implementation under test (kda_impl)
    "matplotlib": "png",  # diff's heatmap, the long cases' positions.png
    "gcsfs": "gcs",  # gs:// dump sets
    "torch": "torch-cpu",  # the dump writer's references (kda-dump)
    "transformers": "torch-cpu",
    "fla": "torch-cpu",
    "einops": "torch-cpu",
    "triton": "torch-cpu",
    "tqdm": "torch-cpu",
}
# What the message adds for an extra with another flavour on other hosts.
_ALTERNATIVE = {"torch-cpu": f" (on an NVIDIA GPU host: '{DISTRIBUTION}[torch-gpu]')"}


class MissingExtra(Exception):
    """An optional dependency is not installed; the message is the one line the user sees."""

    def __init__(self, needed_by: str, module: str):
        extra = EXTRA_OF_MODULE[module]
        super().__init__(
            f"{needed_by} needs {module}, which is not installed: "
            f"pip install '{DISTRIBUTION}[{extra}]'{_ALTERNATIVE.get(extra, '')}"
        )
        self.module, self.extra = module, extra


def require(module: str, needed_by: str) -> None:
    """A MissingExtra unless `module` (a key of EXTRA_OF_MODULE) can be imported."""
    if importlib.util.find_spec(module) is None:
        raise MissingExtra(needed_by, module)


def missing_extra(err: ImportError, needed_by: str) -> MissingExtra | None:
    """The MissingExtra that `err` is, when the module it did not find is an optional dependency;
    None for any other import error (a bug, or a dependency of someone else's code)."""
    top = (err.name or "").partition(".")[0]
    if isinstance(err, ModuleNotFoundError) and top in EXTRA_OF_MODULE:
        return MissingExtra(needed_by, top)
    return None


def installed_versions(distributions: Iterable[str]) -> dict[str, str]:
    """The version of each of `distributions` that is installed, by name (the others left out)."""
    versions = {}
    for distribution in distributions:
        try:
            versions[distribution] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions
