"""One-case dump sets of both KDA families, written on the fly by the checks' tests, and the check runner
on one of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.checks.runner import CheckRunner
from conformance.dumps.reader import DumpSet
from conformance.policy import TolerancePolicy
from conformance.search.dumpcase import write_case_set
from conformance.search.space import SearchCase
from conformance.search.weight_sets import weight_sets

KIMI = "synthetic"  # Kimi-Linear's synthetic mini weights
GLM_AT_MINUS_THREE = "glm5-next@L-3/synthetic"  # GLM's lower-bound gate at L = -3
# (weight set, run): Kimi-Linear in both runs, GLM at L = -3 in fp32.
BOTH_RUNS_AND_GLM = ((KIMI, "fp32"), (KIMI, "bf16"), (GLM_AT_MINUS_THREE, "fp32"))


def write_case_sets(
    tmp_path_factory: pytest.TempPathFactory,
    runs: tuple[tuple[str, str], ...],
    seq_lens: tuple[int, ...],
) -> dict[tuple[str, str], Path]:
    """One set per (weight set, run) of `runs`, each one case of `seq_lens` with small initial states;
    their folders by (family, run)."""
    sets = weight_sets(None, "mini", 0, {"kimi-linear", "glm5-next"})
    folders = {}
    for name, dtype in runs:
        folder = tmp_path_factory.mktemp("case-set") / "set"
        weight_set = sets[name]
        case = SearchCase(dtype, name, seq_lens, init="small")
        write_case_set(str(folder), case, weight_set.weights, weight_set.config, weight_set.source, {})
        folders[weight_set.config.family, dtype] = folder
    return folders


def check_runner(folder: Path, adapter_class: type) -> CheckRunner:
    """The check runner of `adapter_class` on the set in `folder`, the default tolerance policy."""
    return CheckRunner(DumpSet(str(folder)), adapter_class, "auto", TolerancePolicy.load(), {})
