"""One test per check; the ids read `<case>-<dtype>-<check>` (`T65-fp32-layer`)."""

from __future__ import annotations

import pytest

from conformance.checks.catalogue import CheckSpec
from conformance.suite.hooks import SESSION
from conformance.suite.session import ConformanceSession


@pytest.fixture(scope="session")
def kda_conformance(request: pytest.FixtureRequest) -> ConformanceSession:
    """The run's session (`hooks.SuiteHooks`); defined here, so that no fixture of a repository that
    runs the suite in its own pytest (the plugin) meets it."""
    return request.config.stash[SESSION]


def test_check(spec: CheckSpec, kda_conformance: ConformanceSession) -> None:
    kda_conformance.check(spec)  # records the outcome, then skips or fails the test as pytest counts it
