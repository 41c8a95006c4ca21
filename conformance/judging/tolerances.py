"""The tolerance policy: which limits each check is held to, read from `tolerances.toml`."""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conformance.judging.verdict import MODE_GATES
from conformance.runtime.run_platform import check_required_platform
from kda_spec.dump_format import DTYPES

if TYPE_CHECKING:
    from conformance.judging.reduction import ReductionFloors

DEFAULT_POLICY_FILE = Path(__file__).with_name("tolerances.toml")
_LIMIT_FIELDS = ("atol", "rtol", "max_nrmse")
RELATIVE_FIELDS = ("factor", "margin_floor", "nrmse_floor")
# The rounding budget of the widest fp32 reduction behind a stage (docs/tolerance-policy.md): optional, 0
# (none) when left out, as in bf16, whose floors are set by its own roundings.
REDUCTION_FIELDS = ("nrmse_lambda", "margin_lambda")
CONTRACT_FIELDS = ("max_nrmse", "max_nrmse_fp32_stage", "max_gain", "closer_factor", "spread_factor")
# Which gate decides a check: the absolute limits, the relative one (against the float64 truth), both,
# or the relative one and the bf16 precision contract (against the float64 model of its roundings).
GATE_MODES = tuple(MODE_GATES)
CONTRACT_MODE = "relative+contract"


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Element-wise `|a - b| <= atol + rtol * |b|`, and `‖a - b‖₂ / ‖b‖₂ <= max_nrmse` where set (over
    what the policy's `min_tokens` rule lets it decide: `measurement.min_tokens_rule`)."""

    atol: float
    rtol: float
    max_nrmse: float | None = None
    reason: str | None = None  # why a per-check override departs from the dtype's policy

    def __post_init__(self) -> None:
        for name in _LIMIT_FIELDS:
            value = getattr(self, name)
            if value is not None and not (_is_finite_number(value) and value >= 0):
                raise ValueError(f"tolerance {name} must be a finite number >= 0, got {value!r}")
        if self.max_nrmse == 0:
            raise ValueError("tolerance max_nrmse must be > 0 (leave it out to gate no nRMSE)")
        if self.atol == 0 and self.rtol == 0:
            raise ValueError("tolerance atol and rtol cannot both be 0")

    def as_dict(self) -> dict[str, Any]:
        return {key: value for key, value in dataclasses.asdict(self).items() if value is not None}


@dataclasses.dataclass(frozen=True)
class RelativeLimits:
    """The relative gate: the implementation's error against the float64 truth may be at most
    `factor` × the reference's own error against it, plus a floor: in margin (the check's
    `atol + rtol·|truth|` shape) `impl ≤ factor·ref + margin_floor`, in nRMSE
    `impl ≤ factor·ref + nrmse_floor`. The lambdas raise the floors to the rounding budget of the
    stage's widest fp32 reduction (`conformance.judging.reduction`); 0 leaves them as they are."""

    factor: float
    margin_floor: float
    nrmse_floor: float
    nrmse_lambda: float = 0.0  # the nRMSE floor is at least nrmse_lambda · sqrt(K) · 2^-24
    margin_lambda: float = 0.0  # the margin floor at least margin_lambda · sqrt(K) · 2^-24 in scale units
    # The floors' reduction where they were raised to it (`reduction.reduction_limits`), else None.
    reduction: ReductionFloors | None = None

    def __post_init__(self) -> None:
        for name in RELATIVE_FIELDS + REDUCTION_FIELDS:
            if not (_is_finite_number(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)!r}")
        if self.factor < 1:
            raise ValueError(f"factor must be >= 1 (no worse than the reference), got {self.factor!r}")
        if self.margin_floor == 0 or self.nrmse_floor == 0:
            raise ValueError("margin_floor and nrmse_floor must be > 0 (a reference may equal the truth)")

    def as_dict(self) -> dict[str, Any]:
        record = dataclasses.asdict(self)
        if self.reduction is None:
            del record["reduction"]
        return record


@dataclasses.dataclass(frozen=True)
class ContractLimits:
    """The bf16 precision contract: the implementation against the float64 layer that rounds to bf16
    exactly at the contract's points (docs/bf16-rounding.md). Its nRMSE against that model may be at
    most `max_nrmse` for a stage the contract stores in bf16, `max_nrmse_fp32_stage` for one it keeps in
    fp32 (g, beta, the recurrent states), and its gain (the error's component along the model,
    `<x - m, m> / <m, m>`) at most `max_gain` in size; both are whole-output statistics, under the
    policy's `min_tokens` rule (`measurement.min_tokens_rule`). A result
    `closer_factor` times closer to the float64 truth (nRMSE) than the model itself is exempt: it rounds
    less than the contract, not worse. Each limit is at least `spread_factor` × the model's own spread: how
    far the model moves when every value it rounds within an fp32 ulp of a bf16 tie rounds the other way
    (`checks.truth.flipped_contract_rounding`), which is how far a faithful implementation's one-ulp flips
    carry where the layer amplifies them."""

    max_nrmse: float
    max_nrmse_fp32_stage: float
    max_gain: float
    closer_factor: float
    spread_factor: float

    def __post_init__(self) -> None:
        for name in CONTRACT_FIELDS:
            value = getattr(self, name)
            if not (_is_finite_number(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.closer_factor < 1:
            raise ValueError(f"closer_factor must be >= 1, got {self.closer_factor!r}")

    def max_nrmse_of(self, fp32_stage: bool) -> float:
        return self.max_nrmse_fp32_stage if fp32_stage else self.max_nrmse

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ModeRule:
    check: str  # a check name or fnmatch pattern
    dtype: str
    mode: str  # one of GATE_MODES
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
                gate={dtype: _tolerance(data, "gate", dtype) for dtype in DTYPES},
                rfc={dtype: _tolerance(data, "rfc", dtype) for dtype in DTYPES},
                overrides=tuple(_override(entry, i) for i, entry in enumerate(data.get("override", []))),
                relative={dtype: _relative(data, dtype) for dtype in DTYPES},
                contract=_contract(data, any(rule.mode == CONTRACT_MODE for rule in modes)),
                modes=modes,
                min_tokens=_min_tokens(data),
                close_margin=_non_negative(
                    _setting(data, "report", "close_margin", 0.5), "[report] close_margin"
                ),
                growth_factor=check_growth_factor(
                    _setting(data, "baseline", "growth_factor", 2.0), "[baseline] growth_factor"
                ),
                growth_min_ratio=_non_negative(
                    _setting(data, "baseline", "min_ratio", 0.1), "[baseline] min_ratio"
                ),
                source=str(path),
                require_platform=_required_platform(data),
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


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_growth_factor(value: float, name: str) -> float:
    """`value` if it is a finite number > 1 (an allowed growth over a baseline), else a ValueError."""
    if not (_is_finite_number(value) and value > 1):
        raise ValueError(f"{name} must be a finite number > 1, got {value!r}")
    return float(value)


def _setting(data: dict[str, Any], table: str, key: str, default: float) -> Any:
    """The value of `[table] key`, or `default` when absent."""
    block = data.get(table, {})
    if not isinstance(block, dict):
        raise ValueError(f"[{table}] must be a table, got {block!r}")
    return block.get(key, default)


def _required_platform(data: dict[str, Any]) -> str | None:
    """`[platform] require`: a platform the gate requires of a report, or None when unset."""
    value = _setting(data, "platform", "require", None)
    return None if value is None else check_required_platform(value, "[platform] require")


def _min_tokens(data: dict[str, Any]) -> int:
    """`[statistics] min_tokens`: a whole number >= 1."""
    value = _setting(data, "statistics", "min_tokens", None)
    if value is None:
        raise KeyError("missing [statistics] min_tokens")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"[statistics] min_tokens must be a whole number >= 1, got {value!r}")
    return value


def _non_negative(value: Any, name: str) -> float:
    if not (_is_finite_number(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _tolerance(data: dict[str, Any], table: str, dtype: str) -> Tolerance:
    block = data.get(table, {})
    entry = block.get(dtype) if isinstance(block, dict) else None
    if not isinstance(entry, dict):
        raise KeyError(f"missing table [{table}.{dtype}]")
    unknown = sorted(set(entry) - set(_LIMIT_FIELDS))
    if unknown:
        raise ValueError(f"[{table}.{dtype}]: unknown field(s) {unknown}; allowed {list(_LIMIT_FIELDS)}")
    try:
        return Tolerance(**entry)
    except ValueError as err:
        raise ValueError(f"[{table}.{dtype}]: {err}") from None


def _override(entry: dict[str, Any], index: int) -> Override:
    label = f"override[{index}]"
    if not str(entry.get("reason", "")).strip():
        raise ValueError(f"{label} ({entry.get('check')!r}): an override needs a written 'reason'")
    if entry.get("dtype") not in DTYPES:
        raise ValueError(f"{label}: 'dtype' must be one of {DTYPES}, got {entry.get('dtype')!r}")
    if not entry.get("check"):
        raise ValueError(f"{label}: 'check' (a check name or pattern) is required")
    limits = {key: entry[key] for key in _LIMIT_FIELDS if key in entry}
    unknown = sorted(set(entry) - {"check", "dtype", "reason", *_LIMIT_FIELDS})
    if unknown or not limits:
        raise ValueError(f"{label}: needs at least one of {list(_LIMIT_FIELDS)}; unknown field(s) {unknown}")
    try:
        Tolerance(**{"atol": 1.0, "rtol": 1.0, **limits})  # validates the values
    except ValueError as err:
        raise ValueError(f"{label} ({entry['check']!r}): {err}") from None
    return Override(check=entry["check"], dtype=entry["dtype"], limits=limits, reason=entry["reason"])


def _relative(data: dict[str, Any], dtype: str) -> RelativeLimits:
    block = data.get("relative", {})
    entry = block.get(dtype) if isinstance(block, dict) else None
    if not isinstance(entry, dict):
        raise KeyError(f"missing table [relative.{dtype}]")
    return _limits_table(entry, f"[relative.{dtype}]", RELATIVE_FIELDS, RelativeLimits, REDUCTION_FIELDS)


def _contract(data: dict[str, Any], used: bool) -> ContractLimits | None:
    """`[contract.bf16]`; it may be left out (None) by a policy in which no rule uses the contract mode,
    such as one written before it."""
    block = data.get("contract", {})
    extra = sorted(set(block) - {"bf16"}) if isinstance(block, dict) else []
    if extra:
        raise ValueError(f"[contract]: only [contract.bf16] (fp32 has no rounding point); found {extra}")
    entry = block.get("bf16") if isinstance(block, dict) else None
    if entry is None and not used:
        return None
    if not isinstance(entry, dict):
        raise KeyError(f"missing table [contract.bf16] (a [[mode]] rule uses {CONTRACT_MODE!r})")
    return _limits_table(entry, "[contract.bf16]", CONTRACT_FIELDS, ContractLimits)


def _limits_table(
    entry: dict[str, Any],
    label: str,
    fields: tuple[str, ...],
    limits_class: type,
    optional: tuple[str, ...] = (),
) -> Any:
    """`limits_class(**entry)` for a table that must have exactly `fields` (and may have `optional`); a
    ValueError names `label`."""
    missing, unknown = sorted(set(fields) - set(entry)), sorted(set(entry) - set(fields) - set(optional))
    if missing or unknown:
        raise ValueError(f"{label}: needs {list(fields)}; missing {missing}, unknown {unknown}")
    try:
        return limits_class(**entry)
    except ValueError as err:
        raise ValueError(f"{label}: {err}") from None


def _mode_rule(entry: Any, index: int) -> ModeRule:
    label = f"mode[{index}]"
    if not isinstance(entry, dict):
        raise ValueError(f"{label}: expected a table, got {entry!r}")
    unknown = sorted(set(entry) - {"check", "dtype", "mode", "reason"})
    if unknown:
        raise ValueError(f"{label}: unknown field(s) {unknown}; allowed ['check', 'dtype', 'mode', 'reason']")
    if not isinstance(entry.get("check"), str) or not entry["check"]:
        raise ValueError(f"{label}: 'check' (a check name or pattern) is required")
    if entry.get("dtype") not in DTYPES:
        raise ValueError(
            f"{label} ({entry['check']!r}): 'dtype' must be one of {DTYPES}, got {entry.get('dtype')!r}"
        )
    if entry.get("mode") not in GATE_MODES:
        raise ValueError(
            f"{label} ({entry['check']!r}): 'mode' must be one of {GATE_MODES}, got {entry.get('mode')!r}"
        )
    if entry["mode"] == CONTRACT_MODE and entry["dtype"] != "bf16":
        raise ValueError(
            f"{label} ({entry['check']!r}): mode {CONTRACT_MODE!r} is for dtype 'bf16' only (the precision "
            f"contract's rounding points are bf16 roundings), got {entry['dtype']!r}"
        )
    if not str(entry.get("reason", "")).strip():
        raise ValueError(f"{label} ({entry['check']!r}): a mode rule needs a written 'reason'")
    return ModeRule(check=entry["check"], dtype=entry["dtype"], mode=entry["mode"], reason=entry["reason"])
