"""One test per check; the ids read `<case>-<dtype>-<check>` (`T65-fp32-layer`)."""

from __future__ import annotations

from typing import Any

import pytest

from conformance.checks.catalogue import CheckSpec
from conformance.suite.hooks import SESSION
from conformance.suite.session import ConformanceSession


@pytest.fixture(scope="session")
def kda_conformance(request: pytest.FixtureRequest) -> ConformanceSession:
    """The run's session (`hooks.SuiteHooks`); defined here, so that no fixture of a repository that
    runs the suite in its own pytest (the plugin) meets it."""
    return request.config.stash[SESSION]


def test_check(spec: CheckSpec, kda_conformance: ConformanceSession, record_property: Any) -> None:
    comparison = kda_conformance.check(spec).comparison  # skips the test when the check cannot run
    for key in ("margin", "nrmse", "max_abs", "share_outside"):
        record_property(key, f"{getattr(comparison.measurement, key):.4g}")
    record_property("judged_by", comparison.judged_by)
    record_property("verdict", comparison.blame)  # against the float64 truth; n/a without one
    if not comparison.passed:
        pytest.fail(kda_conformance.failure_text(spec, comparison), pytrace=False)
