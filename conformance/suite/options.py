"""The suite's options, defined once: `python -m conformance run` adds them to its argparse parser and
the pytest plugin to pytest's (whose `addoption` takes argparse's arguments), there with the prefix
`kda-` (`--kda-impl`, `--kda-dumps`) so that they never meet another repository's own options; `diff`,
`power` and `search` reuse the implementation's."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conformance.adapter import KERNEL_CHOICES, parse_option_pairs
from conformance.adapters.guard import DEFAULT_CALL_TIMEOUT_S, checked_call_timeout
from conformance.dumps.bundled import dumps_or_bundled
from conformance.policy import DEFAULT_POLICY_FILE
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
    call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S  # 0: none
    scenarios: Path | None = None  # `--scenarios FILE`: the serving scenarios in place of the fixed ones


AddOption = Callable[..., Any]  # argparse's `add_argument`, or pytest's `addoption`


def add_implementation_options(
    add: AddOption, prefix: str = "", default_impl: str | None = "kda_impl"
) -> None:
    """--impl, --kernel, --impl-option, --tolerances, --call-timeout; each named `--<prefix><name>`, its
    dest `<prefix>_<name>` (`prefix` "kda-": `--kda-impl`, dest `kda_impl`)."""
    flag, dest = f"--{prefix}", prefix.replace("-", "_")
    add(
        f"{flag}impl",
        dest=f"{dest}impl",
        default=default_impl,
        metavar="NAME_OR_MODULE:ATTR",
        help="built-in adapter name or package.module:Attr",
    )
    add(
        f"{flag}kernel",
        dest=f"{dest}kernel",
        default="auto",
        choices=KERNEL_CHOICES,
        help="kernel of the implementation",
    )
    add(
        f"{flag}impl-option",
        dest=f"{dest}impl_options",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the adapter, passed to its constructor (repeatable; see docs/adapters.md)",
    )
    add(
        f"{flag}tolerances",
        dest=f"{dest}tolerances",
        default=str(DEFAULT_POLICY_FILE),
        help="the tolerance policy file",
    )
    add(
        f"{flag}call-timeout",
        dest=f"{dest}call_timeout",
        type=float,
        default=DEFAULT_CALL_TIMEOUT_S,
        metavar="SECONDS",
        help=f"stop the run when one adapter call takes longer (default {DEFAULT_CALL_TIMEOUT_S:g}; 0: none)",
    )


def add_selection_options(add: AddOption, prefix: str = "") -> None:
    """--dtypes, --cases, --scenarios: which of the dump set's runs and cases, and which serving
    scenarios, the suite checks (named as above)."""
    flag, dest = f"--{prefix}", prefix.replace("-", "_")
    add(
        f"{flag}dtypes", dest=f"{dest}dtypes", default="fp32,bf16", help="comma-separated subset of fp32,bf16"
    )
    add(
        f"{flag}cases",
        dest=f"{dest}cases",
        nargs="+",
        metavar="ID",
        help="case ids (default: every case of the set)",
    )
    add(
        f"{flag}scenarios",
        dest=f"{dest}scenarios",
        metavar="FILE",
        help="serving scenarios (JSON or TOML, docs/serving.md) to check in place of the fixed ones",
    )


def suite_options(
    get: Callable[[str], Any], report_dir: Path | None, impl_options: dict[str, str] | None = None
) -> SuiteOptions:
    """The `SuiteOptions` of parsed options, each read by its dest (without a prefix) with `get`; a
    `dumps` of None is the bundled golden set; `impl_options` in place of the parsed `--impl-option`s
    (the command line adds `--tp`/`--dp` to them). A ValueError names an unusable value."""
    return SuiteOptions(
        dumps=dumps_or_bundled(get("dumps")),
        impl=get("impl"),
        kernel=get("kernel"),
        dtypes=parse_dtypes(get("dtypes")),
        cases=get("cases"),
        report_dir=report_dir,
        tolerances=Path(get("tolerances")),
        impl_options=parse_option_pairs(get("impl_options")) if impl_options is None else impl_options,
        call_timeout_s=checked_call_timeout(get("call_timeout")),
        scenarios=Path(get("scenarios")) if get("scenarios") else None,
    )
