"""State of one suite run: the dump set, the runner, and the record of every check."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest

from conformance.adapter import load_adapter_class
from conformance.checks import CheckRunner, CheckSkipped, CheckSpec, plan
from conformance.metrics import Comparison
from conformance.positions import write_files as write_position_files
from conformance.reader import DumpSet
from conformance.report import Record, build_report, environment, markdown, write_json
from conformance.tolerances import TolerancePolicy
from kda_spec.dump_format import DTYPES


def parse_dtypes(text: str) -> list[str]:
    """`fp32,bf16` → ["fp32", "bf16"], or a ValueError naming the unknown."""
    dtypes = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [dtype for dtype in dtypes if dtype not in DTYPES]
    if unknown or not dtypes:
        raise ValueError(f"--dtypes {text!r}: expected a comma-separated subset of {list(DTYPES)}")
    return dtypes


@dataclasses.dataclass(frozen=True)
class SuiteOptions:
    dumps: str
    impl: str
    kernel: str
    dtypes: list[str]
    cases: list[str] | None
    report_dir: Path | None
    tolerances: Path
    impl_options: dict[str, str] = dataclasses.field(default_factory=dict)  # `--impl-option KEY=VALUE`


class ConformanceSession:
    """Opens the dump set and the implementation, runs checks and keeps their records."""

    def __init__(self, options: SuiteOptions):
        self.options = options
        self.dumps = DumpSet(options.dumps)
        self.policy = TolerancePolicy.load(options.tolerances)
        adapter_class = load_adapter_class(options.impl)
        adapter_class.parse_options(options.impl_options)  # a bad option stops the run before any check
        self.runner = CheckRunner(
            self.dumps, adapter_class, options.kernel, self.policy, options.impl_options
        )
        self.runner.weights()  # a broken weights file stops the run before any check
        self.specs = plan(self.dumps, self.dumps.case_ids(options.cases), options.dtypes)
        self.records: list[Record] = []
        self.comparisons: dict[str, Comparison] = {}
        self.started = time.monotonic()
        self._report: dict[str, Any] | None = None

    def check(self, spec: CheckSpec) -> Comparison:
        """Run one check; a check that cannot run skips the test with the reason."""
        try:
            comparison = self.runner.run(spec)
        except CheckSkipped as skip:
            pytest.skip(str(skip))
        self.comparisons[spec.id] = comparison
        return comparison

    def record(self, spec: CheckSpec, status: str, message: str, duration_s: float) -> None:
        comparison = self.comparisons.get(spec.id)
        if status == "failed" and comparison is None:
            status = "error"  # an exception, not a result out of tolerance
        self.records.append(Record(spec, status, message, duration_s, comparison))

    def report(self) -> dict[str, Any]:
        """The report of the run so far (built once, at the end)."""
        if self._report is None:
            adapters = self.runner.adapters
            meta = {
                "duration_s": round(time.monotonic() - self.started, 2),
                "dumps": {
                    "url": self.options.dumps,
                    "manifest_sha256": self.dumps.manifest_sha256,
                    "manifest": self.dumps.manifest,
                },
                "implementation": {
                    "impl": self.options.impl,
                    "name": next(
                        (adapter.name for adapter in adapters.values()), self.runner.adapter_class.name
                    ),
                    "kernel": self.options.kernel,
                    "options": self.options.impl_options,
                    "kernel_used": {dtype: adapter.kernel_used for dtype, adapter in adapters.items()},
                    "describe": {dtype: adapter.describe() for dtype, adapter in adapters.items()},
                },
                "environment": environment({dtype: a.kernel_used for dtype, a in adapters.items()}),
                "tolerances": self.policy.as_dict(),
                "selection": {
                    "cases": self.dumps.case_ids(self.options.cases),
                    "dtypes": self.options.dtypes,
                },
            }
            self._report = build_report(self.records, meta, self.policy.close_margin)
        return self._report

    def write_reports(self) -> list[Path]:
        """report.json and report.md under the report folder (junit.xml is pytest's own `--junitxml`)."""
        if self.options.report_dir is None:
            return []
        folder = self.options.report_dir
        folder.mkdir(parents=True, exist_ok=True)
        write_json(self.report(), folder / "report.json")
        # The long cases' error by position: its files beside report.md, and a section at its end.
        by_position = write_position_files(list(self.runner.position_profiles.values()), folder)
        (folder / "report.md").write_text(markdown(self.report()) + "\n".join(by_position))
        return [folder / "report.json", folder / "report.md"]
