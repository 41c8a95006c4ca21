"""The tolerance policy: which limits each check is held to, read from `tolerances.toml`.

`TolerancePolicy.load` refuses a policy it cannot use with one ValueError naming the file, the table and
the key at fault; each table's fields are those of the limits class it makes (`judging.limits`)."""

from __future__ import annotations

import dataclasses
import fnmatch
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conformance.judging.limits import (
    TOLERANCE_FIELDS,
    ContractLimits,
    RelativeLimits,
    Tolerance,
    finite_number,
)
from conformance.judging.verdict import CONTRACT_MODE, MODE_GATES
from conformance.runtime.run_platform import check_required_platform
from kda_spec.dump_format import DTYPES

DEFAULT_POLICY_FILE = Path(__file__).with_name("tolerances.toml")
_REQUIRED = object()  # `_setting`'s default of a key the policy must set


def check_growth_factor(value: Any, name: str) -> float:
    """`value` if it is a finite number > 1 (an allowed growth over a baseline), else a ValueError."""
    return finite_number(value, name, 1.0, strict=True)


@dataclasses.dataclass(frozen=True)
class ModeRule:
    check: str  # a check name or fnmatch pattern
    dtype: str
    mode: str  # one of verdict.MODE_GATES
    reason: str


@dataclasses.dataclass(frozen=True)
class Override:
    check: str  # a check name or fnmatch pattern
    dtype: str
    limits: dict[str, float]
    reason: str


@dataclasses.dataclass(frozen=True)
class TolerancePolicy:
    gate: dict[str, Tolerance]  # by dtype
    rfc: dict[str, Tolerance]  # by dtype: the RFC's numbers, reported only
    overrides: tuple[Override, ...]
    relative: dict[str, RelativeLimits]  # by dtype
    contract: ContractLimits | None  # bf16 only (fp32 has no rounding point); None: no rule uses it
    min_tokens: int  # `[statistics] min_tokens`: what a fixed-limit whole-output statistic decides over
    modes: tuple[ModeRule, ...]
    close_margin: float
    growth_factor: float
    growth_min_ratio: float
    source: str
    require_platform: str | None = None  # `[platform] require`: the gate refuses a report made elsewhere

    @classmethod
    def load(cls, path: str | Path = DEFAULT_POLICY_FILE) -> TolerancePolicy:
        """Read and validate a policy file; a ValueError names the offending entry."""
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise ValueError(f"{path}: cannot read the tolerance policy ({err})") from None
        try:
            modes = tuple(_mode_rule(entry, i) for i, entry in enumerate(data.get("mode", [])))
            return cls(
                gate={dtype: _limits(Tolerance, data, f"gate.{dtype}") for dtype in DTYPES},
                rfc={dtype: _limits(Tolerance, data, f"rfc.{dtype}") for dtype in DTYPES},
                overrides=tuple(_override(entry, i) for i, entry in enumerate(data.get("override", []))),
                relative={dtype: _limits(RelativeLimits, data, f"relative.{dtype}") for dtype in DTYPES},
                contract=_contract(data, any(rule.mode == CONTRACT_MODE for rule in modes)),
                modes=modes,
                min_tokens=_setting(data, "statistics", "min_tokens", _REQUIRED, _whole_number),
                close_margin=_setting(data, "report", "close_margin", 0.5, finite_number),
                growth_factor=_setting(data, "baseline", "growth_factor", 2.0, check_growth_factor),
                growth_min_ratio=_setting(data, "baseline", "min_ratio", 0.1, finite_number),
                source=str(path),
                require_platform=_setting(data, "platform", "require", None, check_required_platform),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}: {err}") from None

    def tolerance(self, check: str, dtype: str) -> Tolerance:
        """The gate's tolerance for `check` in the `dtype` run: the dtype's policy, or its override."""
        for override in self.overrides:
            if override.dtype == dtype and fnmatch.fnmatchcase(check, override.check):
                return dataclasses.replace(self.gate[dtype], **override.limits, reason=override.reason)
        return self.gate[dtype]

    def mode(self, check: str, dtype: str) -> str:
        """Which gate decides `check` in the `dtype` run: the first `[[mode]]` rule that matches it,
        else "absolute"."""
        for rule in self.modes:
            if rule.dtype == dtype and fnmatch.fnmatchcase(check, rule.check):
                return rule.mode
        return "absolute"

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "gate": {dtype: tol.as_dict() for dtype, tol in self.gate.items()},
            "rfc": {dtype: tol.as_dict() for dtype, tol in self.rfc.items()},
            "overrides": [dataclasses.asdict(override) for override in self.overrides],
            "relative": {dtype: limits.as_dict() for dtype, limits in self.relative.items()},
            "contract": {"bf16": self.contract.as_dict()} if self.contract else {},
            "modes": [dataclasses.asdict(rule) for rule in self.modes],
            "min_tokens": self.min_tokens,
            "close_margin": self.close_margin,
            "growth_factor": self.growth_factor,
            "growth_min_ratio": self.growth_min_ratio,
            "require_platform": self.require_platform,
        }


def _setting(
    data: dict[str, Any], table: str, key: str, default: Any, check: Callable[[Any, str], Any]
) -> Any:
    """`[table] key` through `check(value, name)`; `default` (unchecked) when absent, or a KeyError where
    it is `_REQUIRED`."""
    block = data.get(table, {})
    if not isinstance(block, dict):
        raise ValueError(f"[{table}] must be a table, got {block!r}")
    if key not in block and default is _REQUIRED:
        raise KeyError(f"missing [{table}] {key}")
    return check(block[key], f"[{table}] {key}") if key in block else default


def _whole_number(value: Any, name: str) -> int:
    """`value` where it is a whole number >= 1, else a ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    return value


def _limits(limits_class: type, data: dict[str, Any], path: str) -> Any:
    """`limits_class` made from the table at the dotted `path` ("relative.fp32"), whose keys are the
    class's numeric fields: those without a default required, the others optional; errors name `path`."""
    entry: Any = data
    for key in path.split("."):
        entry = entry.get(key) if isinstance(entry, dict) else None
    if not isinstance(entry, dict):
        raise KeyError(f"missing table [{path}]")
    fields = [field for field in dataclasses.fields(limits_class) if "float" in str(field.type)]
    required = [field.name for field in fields if field.default is dataclasses.MISSING]
    optional = {field.name for field in fields} - set(required)
    missing, unknown = sorted(set(required) - set(entry)), sorted(set(entry) - set(required) - optional)
    if missing or unknown:
        raise ValueError(f"[{path}]: needs {required}; missing {missing}, unknown {unknown}")
    try:
        return limits_class(**entry)
    except ValueError as err:
        raise ValueError(f"[{path}]: {err}") from None


def _contract(data: dict[str, Any], used: bool) -> ContractLimits | None:
    """`[contract.bf16]`; it may be left out (None) by a policy in which no rule uses the contract mode,
    such as one written before it."""
    block = data.get("contract", {})
    extra = sorted(set(block) - {"bf16"}) if isinstance(block, dict) else []
    if extra:
        raise ValueError(f"[contract]: only [contract.bf16] (fp32 has no rounding point); found {extra}")
    if not used and (not isinstance(block, dict) or "bf16" not in block):
        return None
    try:
        return _limits(ContractLimits, data, "contract.bf16")
    except KeyError:
        raise KeyError(f"missing table [contract.bf16] (a [[mode]] rule uses {CONTRACT_MODE!r})") from None


def _rule(entry: Any, kind: str, index: int, fields: tuple[str, ...]) -> str:
    """Check the fields a `[[kind]]` rule shares (`check`, `dtype`, `reason`) and that it has no other
    than `fields`; its label for the errors of the rest, `kind[index] ('check')`."""
    label = f"{kind}[{index}]"
    if not isinstance(entry, dict):
        raise ValueError(f"{label}: expected a table, got {entry!r}")
    allowed = ["check", "dtype", *fields, "reason"]
    unknown = sorted(set(entry) - set(allowed))
    if unknown:
        raise ValueError(f"{label}: unknown field(s) {unknown}; allowed {allowed}")
    if not isinstance(entry.get("check"), str) or not entry["check"]:
        raise ValueError(f"{label}: 'check' (a check name or pattern) is required")
    label = f"{label} ({entry['check']!r})"
    if not str(entry.get("reason", "")).strip():
        rule = "an override" if kind == "override" else "a mode rule"
        raise ValueError(f"{label}: {rule} needs a written 'reason'")
    if entry.get("dtype") not in DTYPES:
        raise ValueError(f"{label}: 'dtype' must be one of {DTYPES}, got {entry.get('dtype')!r}")
    return label


def _override(entry: Any, index: int) -> Override:
    label = _rule(entry, "override", index, TOLERANCE_FIELDS)
    limits = {key: entry[key] for key in TOLERANCE_FIELDS if key in entry}
    if not limits:
        raise ValueError(f"{label}: needs at least one of {list(TOLERANCE_FIELDS)}")
    try:
        Tolerance(**{"atol": 1.0, "rtol": 1.0, **limits})  # validates the values
    except ValueError as err:
        raise ValueError(f"{label}: {err}") from None
    return Override(check=entry["check"], dtype=entry["dtype"], limits=limits, reason=entry["reason"])


def _mode_rule(entry: Any, index: int) -> ModeRule:
    label = _rule(entry, "mode", index, ("mode",))
    modes = tuple(MODE_GATES)
    if entry.get("mode") not in modes:
        raise ValueError(f"{label}: 'mode' must be one of {modes}, got {entry.get('mode')!r}")
    if entry["mode"] == CONTRACT_MODE and entry["dtype"] != "bf16":
        raise ValueError(
            f"{label}: mode {CONTRACT_MODE!r} is for dtype 'bf16' only (the precision contract's rounding "
            f"points are bf16 roundings), got {entry['dtype']!r}"
        )
    return ModeRule(check=entry["check"], dtype=entry["dtype"], mode=entry["mode"], reason=entry["reason"])
