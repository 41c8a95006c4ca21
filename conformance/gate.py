"""The CI gate: does a report hold, and did any error grow too much over a baseline report?

Nothing in a report is taken on trust: each check's verdict is recomputed from the numbers and the
limits it records (the absolute gate's, and where its mode and a truth call for it, the relative
gate's: both sides' errors against the float64 truth, the factor and the floors; and where its mode
and a model call for it, the bf16 precision contract's: the nRMSE and gain and their limits), a check the
baseline has and the report lacks is a breach, and two reports are only compared when they were
made on the same dump set (the sha256 of its manifest).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from conformance.report import REPORT_FORMAT, REPORT_VERSION, STATUSES
from conformance.tolerances import ABSOLUTE_MODES, CONTRACT_FIELDS, CONTRACT_MODE, GATE_MODES, RELATIVE_FIELDS

_CHECK_TEXT_FIELDS = ("id", "status", "message")


class ReportError(Exception):
    """A report file the gate cannot read, or one whose content is malformed."""


def load_report(path: str | Path) -> dict[str, Any]:
    """A report whose structure is sound (every check with its fields, of the right types)."""
    path = Path(path)
    try:
        report = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ReportError(f"{path}: cannot read the report ({err})") from None
    if not isinstance(report, dict) or report.get("format") != REPORT_FORMAT:
        raise ReportError(f"{path}: not a conformance report (no 'format': {REPORT_FORMAT!r})")
    if report.get("version") != REPORT_VERSION:
        raise ReportError(
            f"{path}: report version {report.get('version')!r}; this gate reads {REPORT_VERSION}"
        )
    checks = report.get("checks")
    if not isinstance(checks, list):
        raise ReportError(f"{path}: report has no 'checks' list")
    seen: set[str] = set()
    for index, check in enumerate(checks):
        _check_structure(check, f"{path}: checks[{index}]")
        if check["id"] in seen:
            raise ReportError(f"{path}: checks[{index}]: check id {check['id']!r} appears twice")
        seen.add(check["id"])
    _check_complete(report.get("completion"), len(checks), path)
    dumps = report.get("dumps", {})
    if not isinstance(dumps, dict) or not isinstance(dumps.get("manifest_sha256", ""), str):
        raise ReportError(f"{path}: 'dumps' must be an object whose 'manifest_sha256' is a string")
    return report


def _check_complete(completion: Any, checks: int, path: Path) -> None:
    """An incomplete run (interrupted, stopped by a call timeout or `-x`) is no verdict: a ReportError.
    The count of its checks is held against its plan, not its own word."""
    if not isinstance(completion, dict) or not isinstance(completion.get("planned"), int):
        raise ReportError(f"{path}: report has no 'completion' block with the number of 'planned' checks")
    stopped = completion.get("stopped")
    if stopped is not None or checks != completion["planned"] or completion.get("complete") is not True:
        raise ReportError(
            f"{path}: the run is incomplete: {checks} of {completion['planned']} planned checks ran"
            f" ({stopped or 'stopped early'}); an incomplete run is no verdict"
        )


def has_implementation_faults(report: dict[str, Any]) -> bool:
    """Whether the run records a fault of the implementation under test (it raised, timed out or broke
    the adapter contract): the gate then exits 3, as `run` did."""
    return bool(report.get("faults"))


def _check_structure(check: Any, label: str) -> None:
    if not isinstance(check, dict):
        raise ReportError(f"{label}: expected an object, found {check!r}")
    for field in _CHECK_TEXT_FIELDS:
        if not isinstance(check.get(field), str):
            raise ReportError(f"{label}: {field!r} must be a string, found {check.get(field)!r}")
    if check["status"] not in STATUSES:
        raise ReportError(f"{label}: 'status' must be one of {list(STATUSES)}, found {check['status']!r}")
    metrics = check.get("metrics")
    if metrics is not None and not isinstance(metrics, dict):
        raise ReportError(f"{label}: 'metrics' must be an object or null, found {metrics!r}")
    if check["status"] == "passed":
        if metrics is None:
            raise ReportError(f"{label} ({check['id']}): a passed check must record its 'metrics'")
        _passed_metrics(metrics, f"{label} ({check['id']})")


def _number(container: dict[str, Any], key: str, label: str) -> float:
    """A recorded number; report.json stores NaN and Inf as the strings 'nan', 'inf', '-inf'."""
    value = container.get(key)
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ReportError(f"{label}: {key!r} must be a number, found {value!r}")
    return float(value)


def _passed_metrics(metrics: dict[str, Any], label: str) -> dict[str, Any]:
    """The numbers a passed check's verdict rests on, read and type-checked."""
    tolerance = metrics.get("tolerance")
    if not isinstance(tolerance, dict):
        raise ReportError(f"{label}: metrics 'tolerance' must be an object, found {tolerance!r}")
    gated = metrics.get("nrmse_gated")
    if not isinstance(gated, bool):
        raise ReportError(f"{label}: metrics 'nrmse_gated' must be true or false, found {gated!r}")
    failures = metrics.get("failures", [])
    if not isinstance(failures, list):
        raise ReportError(f"{label}: metrics 'failures' must be a list, found {failures!r}")
    # The nRMSE the limit applies to: `gated_nrmse` (a state's long-enough sequences), else the whole.
    nrmse_key = "gated_nrmse" if metrics.get("gated_nrmse") is not None else "nrmse"
    numbers = {key: _number(metrics, key, label) for key in ("margin", "nonfinite", "n_outside")}
    numbers["nrmse"] = _number(metrics, nrmse_key, label)
    numbers |= {key: _number(tolerance, key, f"{label}: tolerance") for key in ("atol", "rtol")}
    numbers["max_nrmse"] = _number(tolerance, "max_nrmse", f"{label}: tolerance") if gated else None
    mode = metrics.get("mode", "absolute")  # reports made before the relative gate: absolute
    if mode not in GATE_MODES:
        raise ReportError(f"{label}: metrics 'mode' must be one of {list(GATE_MODES)}, found {mode!r}")
    truth = metrics.get("truth", {"available": False})
    if not isinstance(truth, dict) or not isinstance(truth.get("available"), bool):
        raise ReportError(f"{label}: metrics 'truth' must be an object with 'available' true or false")
    relative = _relative_numbers(truth, f"{label}: truth") if truth["available"] else None
    contract = None
    if mode == CONTRACT_MODE:
        recorded = metrics.get("contract", {"available": False})
        if not isinstance(recorded, dict) or not isinstance(recorded.get("available"), bool):
            raise ReportError(f"{label}: metrics 'contract' must be an object with 'available' true or false")
        contract = _contract_numbers(recorded, f"{label}: contract") if recorded["available"] else None
        if contract is not None and relative is not None:
            contract["impl_truth_nrmse"] = relative["impl_nrmse"]
    # The gates that decide, recomputed: the relative one needs a truth, the contract its model
    # (docs/tolerance-policy.md).
    if relative is None:
        judged_by = "absolute"
    elif mode == CONTRACT_MODE and contract is None:
        judged_by = "relative"
    else:
        judged_by = mode
    return {
        **numbers,
        "nrmse_gated": gated,
        "failures": failures,
        "judged_by": judged_by,
        "relative": relative,
        "contract": contract,
    }


def _contract_numbers(contract: dict[str, Any], label: str) -> dict[str, float]:
    """The implementation's nRMSE and gain against the contract's model and the limits, as recorded."""
    impl, limits = contract.get("impl"), contract.get("limits")
    if not isinstance(impl, dict):
        raise ReportError(f"{label}: 'impl' must be an object, found {impl!r}")
    if not isinstance(limits, dict):
        raise ReportError(f"{label}: 'limits' must be an object, found {limits!r}")
    fp32_stage = contract.get("fp32_stage")
    if not isinstance(fp32_stage, bool):
        raise ReportError(f"{label}: 'fp32_stage' must be true or false, found {fp32_stage!r}")
    numbers = {f"impl_{key}": _number(impl, key, f"{label}: impl") for key in ("nrmse", "gain")}
    numbers |= {key: _number(limits, key, f"{label}: limits") for key in CONTRACT_FIELDS}
    numbers["tokens"] = _number(contract, "tokens", label)
    truth_nrmse = contract.get("truth_nrmse")
    if not isinstance(truth_nrmse, dict):
        raise ReportError(f"{label}: 'truth_nrmse' must be an object, found {truth_nrmse!r}")
    numbers["model_truth_nrmse"] = _number(truth_nrmse, "model", f"{label}: truth_nrmse")
    return numbers | {"fp32_stage": fp32_stage}


def _contract_verdict(c: dict[str, Any]) -> tuple[list[str], float]:
    """The precision contract recomputed from the recorded numbers and limits: reasons, ratio."""
    if (
        not all(0 < c[key] < math.inf for key in CONTRACT_FIELDS)
        or not c["tokens"] >= 0
        or c["closer_factor"] < 1
    ):
        recorded = [c[key] for key in CONTRACT_FIELDS]
        reason = f"recorded contract limits {recorded} are not finite numbers > 0 (closer_factor >= 1)"
        return [reason], math.nan
    if c["tokens"] < c["min_tokens"]:  # gated over enough tokens only
        return [], 0.0
    # Closer to the truth than the model (the implementation's nRMSE against the truth from the
    # relative gate's record of the same check): it rounds less than the contract, not worse.
    if c["impl_truth_nrmse"] * c["closer_factor"] <= c["model_truth_nrmse"]:
        return [], 0.0
    max_nrmse = c["max_nrmse_fp32_stage"] if c["fp32_stage"] else c["max_nrmse"]
    reasons = []
    if not c["impl_nrmse"] <= max_nrmse:
        reasons.append(f"nRMSE vs the contract's model {c['impl_nrmse']:g} > {max_nrmse:g}")
    if not abs(c["impl_gain"]) <= c["max_gain"]:
        reasons.append(f"|gain| vs the contract's model {abs(c['impl_gain']):g} > {c['max_gain']:g}")
    return reasons, max(c["impl_nrmse"] / max_nrmse, abs(c["impl_gain"]) / c["max_gain"])


def _relative_numbers(truth: dict[str, Any], label: str) -> dict[str, float]:
    """Both sides' errors against the truth and the relative gate's limits, as recorded."""
    sides = {}
    for side in ("impl", "reference"):
        if not isinstance(truth.get(side), dict):
            raise ReportError(f"{label}: {side!r} must be an object, found {truth.get(side)!r}")
        sides |= {
            f"{side}_{key}": _number(truth[side], key, f"{label}: {side}") for key in ("margin", "nrmse")
        }
    limits = truth.get("limits")
    if not isinstance(limits, dict):
        raise ReportError(f"{label}: 'limits' must be an object, found {limits!r}")
    return sides | {key: _number(limits, key, f"{label}: limits") for key in RELATIVE_FIELDS}


def _relative_verdict(r: dict[str, float]) -> tuple[list[str], float]:
    """The relative gate recomputed: why the implementation is further from the truth than the
    recorded factor and floors allow against the reference, and its ratio to that bound."""
    limits_sound = (
        1 <= r["factor"] < math.inf and 0 < r["margin_floor"] < math.inf and 0 < r["nrmse_floor"] < math.inf
    )
    if not limits_sound:
        return [
            f"recorded relative limits {r['factor']:g}, {r['margin_floor']:g}, {r['nrmse_floor']:g} are "
            "not a factor >= 1 and floors > 0"
        ], math.nan
    margin_bound = r["factor"] * r["reference_margin"] + r["margin_floor"]
    nrmse_bound = r["factor"] * r["reference_nrmse"] + r["nrmse_floor"]
    reasons = []
    if not r["impl_margin"] <= margin_bound:
        reasons.append(f"margin vs truth {r['impl_margin']:g} > {margin_bound:g} (relative to the reference)")
    if not r["impl_nrmse"] <= nrmse_bound:
        reasons.append(f"nRMSE vs truth {r['impl_nrmse']:g} > {nrmse_bound:g} (relative to the reference)")
    return reasons, max(r["impl_margin"] / margin_bound, r["impl_nrmse"] / nrmse_bound)


def _recomputed(check: dict[str, Any]) -> tuple[list[str], float | None]:
    """Why a check's recorded numbers do not hold under its recorded limits, and its ratio to the
    limit (the largest criterion of the deciding gate as a share of its limit), recomputed; ([], None)
    without numbers. The deciding gate is the absolute one, the relative one, or both (`mode`)."""
    if check["status"] != "passed":
        return [], None
    n = _passed_metrics(check["metrics"], check["id"])
    reasons = []
    if n["nonfinite"] != 0:
        reasons.append(f"{n['nonfinite']:g} NaN/Inf value(s)")
    ratios = []
    if n["judged_by"] in ABSOLUTE_MODES:
        absolute_reasons, absolute_ratio = _absolute_verdict(n)
        reasons += absolute_reasons
        ratios.append(absolute_ratio)
    if n["judged_by"] != "absolute":
        relative_reasons, relative_ratio = _relative_verdict(n["relative"])
        reasons += relative_reasons
        ratios.append(relative_ratio)
    if n["judged_by"] == CONTRACT_MODE:
        contract_reasons, contract_ratio = _contract_verdict(n["contract"])
        reasons += contract_reasons
        ratios.append(contract_ratio)
    if n["failures"]:
        reasons.append(f"recorded failures {n['failures']}")
    return reasons, (max(ratios) if not reasons else None)


def _absolute_verdict(n: dict[str, Any]) -> tuple[list[str], float]:
    """The absolute gate recomputed from the recorded numbers and limits: reasons, ratio to the limit."""
    reasons = [
        f"recorded {key} {n[key]:g} is not a finite limit >= 0"
        for key in ("atol", "rtol")
        if not 0 <= n[key] < math.inf
    ]
    if not n["margin"] <= 1:
        reasons.append(f"margin {n['margin']:g} > 1")
    if n["n_outside"] != 0:
        reasons.append(f"{n['n_outside']:g} element(s) outside the tolerance")
    ratio = n["margin"]
    if n["nrmse_gated"]:
        if not 0 < n["max_nrmse"] < math.inf:
            reasons.append(f"recorded max_nrmse {n['max_nrmse']:g} is not a finite limit > 0")
        elif not n["nrmse"] <= n["max_nrmse"]:
            reasons.append(f"nRMSE {n['nrmse']:g} > {n['max_nrmse']:g}")
        else:
            ratio = max(ratio, n["nrmse"] / n["max_nrmse"])
    return reasons, ratio


def status_counts(report: dict[str, Any]) -> dict[str, int]:
    """How many checks of each status the report holds (counted, not read from its summary)."""
    return {status: sum(check["status"] == status for check in report["checks"]) for status in STATUSES}


def dump_set_mismatch(report: dict[str, Any], baseline: dict[str, Any]) -> str | None:
    """Why the two reports cannot be compared (different or unrecorded dump sets), or None."""
    digests = [r.get("dumps", {}).get("manifest_sha256") for r in (report, baseline)]
    if digests[0] is None or digests[1] is None:
        which = "the report" if digests[0] is None else "the baseline"
        return f"{which} records no dump-set digest (dumps.manifest_sha256), so the sets cannot be compared"
    if digests[0] != digests[1]:
        return (
            f"the report was made on another dump set than the baseline "
            f"(manifest sha256 {digests[0][:12]}… against {digests[1][:12]}…)"
        )
    return None


def breaches(
    report: dict[str, Any],
    baseline: dict[str, Any] | None = None,
    growth_factor: float = 2.0,
    growth_min_ratio: float = 0.1,
) -> list[str]:
    """Why the report does not pass the gate, one line per reason; empty when it passes.

    A report breaches when a check failed or errored, when a check recorded as passed has numbers
    outside its recorded limits (or NaN), when no check passed at all, and, against a baseline, when
    a check of the baseline is missing, when a check's ratio to its limit grew more than
    `growth_factor` times (ignored while it stays below `growth_min_ratio`), or when a check the
    baseline passed is now skipped.
    """
    found = [
        f"{check['id']}: {check['status']}: {check['message']}"
        for check in report["checks"]
        if check["status"] in ("failed", "error")
    ]
    ratios: dict[str, float | None] = {}
    for check in report["checks"]:
        reasons, ratios[check["id"]] = _recomputed(check)
        if reasons:
            found.append(f"{check['id']}: recorded as passed, but its numbers fail: {'; '.join(reasons)}")
    if not any(check["status"] == "passed" for check in report["checks"]):
        found.append(f"no check passed ({len(report['checks'])} checks in the report)")
    if baseline is None:
        return found
    now = {check["id"]: check for check in report["checks"]}
    for old in baseline["checks"]:
        check = now.get(old["id"])
        if check is None:
            found.append(f"{old['id']}: in the baseline ({old['status']}), missing from this report")
            continue
        if old["status"] != "passed":
            continue
        if check["status"] == "skipped":
            found.append(f"{check['id']}: passed in the baseline, now skipped: {check['message']}")
            continue
        new_ratio, old_ratio = ratios[check["id"]], _recomputed(old)[1]
        if new_ratio is None or old_ratio is None:
            continue
        if new_ratio > growth_min_ratio and new_ratio > growth_factor * old_ratio:
            growth = new_ratio / old_ratio if old_ratio > 0 else float("inf")
            found.append(
                f"{check['id']}: error grew over the baseline: ratio to the limit {old_ratio:.3g} → "
                f"{new_ratio:.3g} (×{growth:.3g}, allowed ×{growth_factor:g})"
            )
    return found
