"""The one JSON rule of every file the checker writes: standard JSON, with NaN and Inf as text."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def json_safe(value: Any) -> Any:
    """NaN and Inf as the strings 'nan', 'inf', '-inf', so that every JSON file written stays standard
    JSON (`number_from_json` reads them back)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def number_from_json(value: Any) -> float | None:
    """A number as `write_json` wrote it (NaN and Inf as strings) as a float; None for anything else."""
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def write_json(report: dict[str, Any], path: Path) -> None:
    """`report` as standard JSON (`json_safe`), one level of indent."""
    path.write_text(json.dumps(json_safe(report), indent=1, allow_nan=False) + "\n")
