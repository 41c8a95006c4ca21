"""The tolerance policy: which limits each check is held to, read from `tolerances.toml`."""

from __future__ import annotations

import dataclasses
import fnmatch
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from kda_spec.dump_format import DTYPES

DEFAULT_POLICY_FILE = Path(__file__).with_name("tolerances.toml")
_LIMIT_FIELDS = ("atol", "rtol", "max_nrmse", "nrmse_min_tokens")


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Element-wise `|a - b| <= atol + rtol * |b|`, and `‖a - b‖₂ / ‖b‖₂ <= max_nrmse` where set.

    The nRMSE limit applies to results of at least `nrmse_min_tokens` tokens (and to states, which
    sum up every token); over fewer tokens it is reported but not gated.
    """

    atol: float
    rtol: float
    max_nrmse: float | None = None
    nrmse_min_tokens: int = 0
    reason: str | None = None  # why a per-check override departs from the dtype's policy

    def gates_nrmse(self, tokens: int | None) -> bool:
        """Whether the nRMSE limit holds for a result of `tokens` tokens (None: not per token)."""
        return self.max_nrmse is not None and (tokens is None or tokens >= self.nrmse_min_tokens)

    def __post_init__(self) -> None:
        for name in _LIMIT_FIELDS:
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"tolerance {name} must be a number >= 0, got {value!r}")
        if self.atol == 0 and self.rtol == 0:
            raise ValueError("tolerance atol and rtol cannot both be 0")

    def as_dict(self) -> dict[str, Any]:
        return {key: value for key, value in dataclasses.asdict(self).items() if value is not None}


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
    close_margin: float
    growth_factor: float
    growth_min_ratio: float
    source: str

    @classmethod
    def load(cls, path: str | Path = DEFAULT_POLICY_FILE) -> TolerancePolicy:
        """Read and validate a policy file; a ValueError names the offending entry."""
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise ValueError(f"{path}: cannot read the tolerance policy ({err})") from None
        try:
            return cls(
                gate={dtype: _tolerance(data, "gate", dtype) for dtype in DTYPES},
                rfc={dtype: _tolerance(data, "rfc", dtype) for dtype in DTYPES},
                overrides=tuple(_override(entry, i) for i, entry in enumerate(data.get("override", []))),
                close_margin=float(data.get("report", {}).get("close_margin", 0.5)),
                growth_factor=float(data.get("baseline", {}).get("growth_factor", 2.0)),
                growth_min_ratio=float(data.get("baseline", {}).get("min_ratio", 0.1)),
                source=str(path),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}: {err}") from None

    def tolerance(self, check: str, dtype: str) -> Tolerance:
        """The gate's tolerance for `check` in the `dtype` run: the dtype's policy, or its override."""
        for override in self.overrides:
            if override.dtype == dtype and fnmatch.fnmatchcase(check, override.check):
                return dataclasses.replace(self.gate[dtype], **override.limits, reason=override.reason)
        return self.gate[dtype]

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "gate": {dtype: tol.as_dict() for dtype, tol in self.gate.items()},
            "rfc": {dtype: tol.as_dict() for dtype, tol in self.rfc.items()},
            "overrides": [dataclasses.asdict(override) for override in self.overrides],
            "close_margin": self.close_margin,
            "growth_factor": self.growth_factor,
            "growth_min_ratio": self.growth_min_ratio,
        }


def _tolerance(data: dict[str, Any], table: str, dtype: str) -> Tolerance:
    entry = data.get(table, {}).get(dtype)
    if not isinstance(entry, dict):
        raise KeyError(f"missing table [{table}.{dtype}]")
    unknown = sorted(set(entry) - set(_LIMIT_FIELDS))
    if unknown:
        raise ValueError(f"[{table}.{dtype}]: unknown field(s) {unknown}; allowed {list(_LIMIT_FIELDS)}")
    return Tolerance(**entry)


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
    Tolerance(**{"atol": 1.0, "rtol": 1.0, **limits})  # validates the values
    return Override(check=entry["check"], dtype=entry["dtype"], limits=limits, reason=entry["reason"])
