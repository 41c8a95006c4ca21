"""The import rules of docs/architecture.md ("Who imports whom"), read from every module's source: a
module-level import and one inside a function count alike."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROJECT = ("kda_spec", "kda_impl", "dump_gen", "conformance", "examples")
# The project's packages each package may import (itself always).
PACKAGE_IMPORTS = {
    "kda_spec": set(),
    "kda_impl": {"kda_spec"},
    "dump_gen": {"kda_spec"},
    "conformance": {"kda_spec", "kda_impl"},
    "examples": {"conformance", "kda_spec"},
}
# The only modules of conformance that import kda_impl: the built-in adapter and the defect injector on it.
KDA_IMPL_IN_CONFORMANCE = {
    "conformance/adapters/kda_impl_adapter.py",
    "conformance/adapters/kda_impl_serving.py",
    "conformance/adapters/defects.py",
    "conformance/adapters/serving_defects.py",
}
# conformance's parts along the data path, and the parts each may import (itself always): nothing
# imports a part above it.
CONFORMANCE_LAYERS = {
    "exit_codes": set(),
    "runtime": set(),
    "dumps": set(),
    "adapter": set(),
    "adapters": {"adapter", "exit_codes"},
    "judging": set(),
    "policy": {"judging", "runtime"},
    "checks": {"adapter", "adapters", "dumps", "judging", "policy"},
    "reports": {"checks", "exit_codes", "judging", "runtime"},
    "tools": {"adapter", "adapters", "checks", "dumps", "exit_codes", "judging", "policy", "reports",
              "runtime"},
    "search": {"adapter", "adapters", "checks", "dumps", "exit_codes", "judging", "policy", "reports",
               "runtime"},
    "suite": {"adapter", "adapters", "checks", "dumps", "exit_codes", "judging", "policy", "reports",
              "runtime"},
    "cli": {"adapter", "adapters", "checks", "dumps", "exit_codes", "judging", "policy", "reports", "runtime",
            "search", "suite", "tools"},
    "__main__": {"cli"},
    "__init__": set(),
}  # fmt: skip


def _imports(path: Path) -> list[str]:
    """The absolute module names `path` imports (`from a.b import c` as `a.b.c` and `a.b`)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return names


def _modules(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def _relative(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


@pytest.mark.parametrize("package", sorted(PACKAGE_IMPORTS))
def test_each_package_imports_only_the_packages_it_may(package: str) -> None:
    allowed = PACKAGE_IMPORTS[package] | {package}
    breaches = []
    for path in _modules(package):
        for name in _imports(path):
            top = name.split(".")[0]
            if top in PROJECT and top not in allowed:
                breaches.append(f"{_relative(path)} imports {name}")
    assert not breaches, breaches


def test_conformance_imports_kda_impl_only_in_its_adapters() -> None:
    importers = {
        _relative(path)
        for path in _modules("conformance")
        if any(name.split(".")[0] == "kda_impl" for name in _imports(path))
    }
    assert importers <= KDA_IMPL_IN_CONFORMANCE, importers - KDA_IMPL_IN_CONFORMANCE


def _part(path: Path) -> str:
    """The part of conformance `path` belongs to: its subpackage, or its top-level module's name."""
    parts = path.relative_to(REPO / "conformance").with_suffix("").parts
    return parts[0]


def test_every_part_of_conformance_is_in_the_layer_table() -> None:
    parts = {_part(path) for path in _modules("conformance")}
    assert parts == set(CONFORMANCE_LAYERS), parts ^ set(CONFORMANCE_LAYERS)


def test_no_part_of_conformance_imports_a_part_above_it() -> None:
    breaches = []
    for path in _modules("conformance"):
        part = _part(path)
        allowed = CONFORMANCE_LAYERS[part] | {part}
        for name in _imports(path):
            pieces = name.split(".")
            inside = pieces[0] == "conformance" and len(pieces) > 1 and pieces[1] in CONFORMANCE_LAYERS
            if inside and pieces[1] not in allowed:
                breaches.append(f"{_relative(path)} ({part}) imports {name}")
    assert not breaches, breaches


def test_the_adapter_contract_offers_the_kernel_choices_of_kda_impl() -> None:
    from conformance.adapter import KERNEL_CHOICES
    from kda_impl.kernels import KERNEL_CHOICES as KDA_IMPL_KERNELS

    assert set(KERNEL_CHOICES) == set(KDA_IMPL_KERNELS)
