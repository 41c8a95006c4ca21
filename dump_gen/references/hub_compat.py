"""The hub's files imported into the installed transformers and fla, unchanged: names that moved are aliased.

The hub's `modeling_kimi.py` imports transformers names of its time (4.56/4.57), and a few have moved
since (`OutputRecorder`: `transformers.utils.generic` → `transformers.utils.output_capturing` in 5.2).
Before the import, every absolute `from MODULE import NAME` of the snapshot's two files is checked
against the installed packages. A name that moved is bound under its old module for the duration of
the import only (the hub module keeps its own binding; the transformers module is put back as it was),
and each such alias goes into the manifest's `patches` with the transformers version. A name that is
neither there nor a known move is one DumpError naming it and the installed versions. The user's files
on disk are never changed.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import importlib.metadata
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from dump_gen.errors import DumpError

# (old module, name) → (the module it lives in now, the transformers release that moved it).
MOVED_NAMES: dict[tuple[str, str], tuple[str, str]] = {
    ("transformers.utils.generic", "OutputRecorder"): ("transformers.utils.output_capturing", "5.2"),
}
# The distributions that install a top-level package, for the error messages.
_DISTRIBUTIONS = {"transformers": ("transformers",), "fla": ("fla-core", "flash-linear-attention")}
_FLA_HINT = "the torch extras install flash-linear-attention at fla-core's version"


@dataclasses.dataclass(frozen=True)
class ImportedName:
    """One `from module import name` of a snapshot file, where it is."""

    file: str
    line: int
    module: str
    name: str


@dataclasses.dataclass(frozen=True)
class Alias:
    """`module.name` bound, for the import, to the same object at `home`."""

    module: str
    name: str
    home: str
    moved_in: str

    def note(self) -> str:
        return (
            f"import of the hub files: `from {self.module} import {self.name}` served by "
            f"{self.home}.{self.name} (moved in transformers {self.moved_in}; installed "
            f"{installed_versions('transformers')})"
        )


def imported_names(path: Path) -> list[ImportedName]:
    """Every absolute `from MODULE import NAME` of the Python file at `path` (relative ones skipped)."""
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except SyntaxError as err:
        raise DumpError(f"{path}: not a Python file this Python can read: {err}") from None
    return [
        ImportedName(path.name, node.lineno, node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
        for alias in node.names
    ]


def installed_versions(package: str) -> str:
    """'dist X.Y, other not installed' for the distributions that install top-level `package`."""
    parts = []
    for dist in _DISTRIBUTIONS.get(package, (package,)):
        try:
            parts.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{dist} not installed")
    return ", ".join(parts)


def _import(module: str, where: ImportedName) -> ModuleType:
    try:
        return importlib.import_module(module)
    except Exception as err:  # third-party import code: any failure is the environment's
        top = module.split(".")[0]
        hint = f"; {_FLA_HINT}" if top == "fla" else ""
        raise DumpError(
            f"{where.file}:{where.line} imports {where.name} from {module}, which cannot be imported "
            f"({type(err).__name__}: {err}) with {installed_versions(top)}{hint}"
        ) from None


def _has(module: ModuleType, name: str) -> bool:
    """Whether `from module import name` finds `name`: an attribute, or a submodule of that name."""
    if name == "*" or hasattr(module, name):
        return True
    with contextlib.suppress(ImportError):
        importlib.import_module(f"{module.__name__}.{name}")
        return True
    return False


def plan_aliases(names: list[ImportedName]) -> list[Alias]:
    """The aliases that make every one of `names` importable; a DumpError for one that nothing serves."""
    aliases: dict[tuple[str, str], Alias] = {}
    for where in names:
        if _has(_import(where.module, where), where.name):
            continue
        moved = MOVED_NAMES.get((where.module, where.name))
        if moved is None or not _has(_import(moved[0], where), where.name):
            top = where.module.split(".")[0]
            raise DumpError(
                f"{where.file}:{where.line} imports {where.name} from {where.module}: "
                f"{installed_versions(top)} has no such name there, and dump_gen knows no new home for it"
            )
        aliases[where.module, where.name] = Alias(where.module, where.name, *moved)
    return list(aliases.values())


@contextlib.contextmanager
def aliases_installed(aliases: list[Alias]) -> Iterator[None]:
    """Each alias bound under its old module inside the block, removed again after it."""
    bound = []
    try:
        for alias in aliases:
            old = importlib.import_module(alias.module)
            setattr(old, alias.name, getattr(importlib.import_module(alias.home), alias.name))
            bound.append((old, alias.name))
        yield
    finally:
        for old, name in bound:
            delattr(old, name)
