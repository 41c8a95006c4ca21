"""junit.xml for CI, written from the report: one test case per check that ran, and one more that
errs when the run is incomplete, so that no CI dashboard shows a half-finished run as green."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

SUITE_NAME = "kda-conformance"
TEST_CLASS = "conformance.suite.test_conformance"
INCOMPLETE_CASE = "run-complete"
_OUTCOME_TAGS = {"failed": "failure", "error": "error", "skipped": "skipped"}


def junit_tree(report: dict[str, Any]) -> ET.ElementTree:
    """The report's checks as a JUnit test suite (the test names pytest gives them)."""
    checks, completion = report["checks"], report["completion"]
    suite = ET.Element("testsuite", name=SUITE_NAME, time=f"{report['duration_s']:.2f}")
    properties = ET.SubElement(suite, "properties")
    for name, value in (
        ("complete", str(completion["complete"]).lower()),
        ("planned", str(completion["planned"])),
        ("ran", str(completion["ran"])),
        ("stopped", completion["stopped"] or ""),
    ):
        ET.SubElement(properties, "property", name=name, value=value)
    for check in checks:
        case = ET.SubElement(
            suite, "testcase", classname=TEST_CLASS, name=f"test_check[{check['id']}]",
            time=f"{check['duration_s']:.3f}",
        )  # fmt: skip
        tag = _OUTCOME_TAGS.get(check["status"])
        if tag:
            ET.SubElement(case, tag, message=check["message"]).text = check["message"]
    if not completion["complete"]:
        case = ET.SubElement(suite, "testcase", classname=TEST_CLASS, name=INCOMPLETE_CASE, time="0")
        ran, planned = completion["ran"], completion["planned"]
        text = f"incomplete: {ran} of {planned} planned checks ran ({completion['stopped']})"
        ET.SubElement(case, "error", message=text).text = text
    statuses = [check["status"] for check in checks]
    suite.set("tests", str(len(checks) + (not completion["complete"])))
    suite.set("failures", str(statuses.count("failed")))
    suite.set("errors", str(statuses.count("error") + (not completion["complete"])))
    suite.set("skipped", str(statuses.count("skipped")))
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    return ET.ElementTree(root)


def write_junit(report: dict[str, Any], path: Path) -> None:
    junit_tree(report).write(path, encoding="utf-8", xml_declaration=True)
