"""What TF32 does to an fp32 dump: two sets of the same cases, one made with `TRITON_F32_DEFAULT=ieee`
(dump_gen's default) and one with `tf32`, each fp32 result against the float64 truth stored beside it,
and the two sets against each other.

For every case and fp32 result that both sets hold, a row: nRMSE (`‖x - y‖₂ / ‖y‖₂`, the suite's
`normalised_rmse`) of the ieee set against the truth, of the tf32 set against the truth (where the
case stores that truth: the output and the intermediates), and of tf32 against ieee (every result,
the kernel keys too). On a CPU the two are equal (the Triton interpreter computes `tl.dot` in numpy's
fp32 whatever the setting); on an sm80+ GPU the tf32 column shows TF32's error (~1e-3 where fla's
Triton dots decide). Both sets are read and checked by the suite's reader (checksums, keys, shapes).

    python -m benchmarks.tf32_compare IEEE_SET TF32_SET [--out tf32.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from conformance.dumps.reader import DumpSet
from conformance.judging.measurement import normalised_rmse
from kda_spec import dump_format as fmt

_FP32_RESULTS = (fmt.OUTPUT_KEY, *fmt.KERNEL_KEYS, *fmt.INTERMEDIATE_KEYS)


def _nrmse(actual: np.ndarray, expected: np.ndarray) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return normalised_rmse(actual - expected, expected)


def compare_sets(ieee_url: str, tf32_url: str) -> list[dict]:
    """One row per (case, fp32 result) that both sets hold: the three nRMSEs (None: no truth stored)."""
    ieee, tf32 = DumpSet(ieee_url), DumpSet(tf32_url)
    rows = []
    for case_id in ieee.case_ids():
        if case_id not in tf32.cases:
            continue
        a, b = ieee.case(case_id), tf32.case(case_id)
        for name in _FP32_RESULTS:
            x, y = a.result(name, "fp32"), b.result(name, "fp32")
            if x is None or y is None:
                continue
            truth = a.arrays.get(fmt.truth_key(name, "fp32")) if name in fmt.TRUTH_NAMES else None
            rows.append(
                {
                    "case": case_id,
                    "result": name,
                    "ieee_vs_truth": None if truth is None else _nrmse(x, truth),
                    "tf32_vs_truth": None if truth is None else _nrmse(y, truth),
                    "tf32_vs_ieee": _nrmse(y, x),
                }
            )
    return rows


def _text(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.tf32_compare", description=__doc__.split("\n")[0]
    )
    parser.add_argument("ieee", help="the set made with TRITON_F32_DEFAULT=ieee")
    parser.add_argument("tf32", help="the same cases made with TRITON_F32_DEFAULT=tf32")
    parser.add_argument("--out", type=Path, help="write the rows here as JSON")
    args = parser.parse_args(argv)
    rows = compare_sets(args.ieee, args.tf32)
    if not rows:
        print(f"tf32_compare: the two sets share no case with fp32 results ({args.ieee}, {args.tf32})")
        return 1
    print(f"{'case':<28}{'result':<34}{'ieee vs truth':>14}{'tf32 vs truth':>14}{'tf32 vs ieee':>14}")
    for row in rows:
        print(
            f"{row['case']:<28}{row['result']:<34}{_text(row['ieee_vs_truth']):>14}"
            f"{_text(row['tf32_vs_truth']):>14}{_text(row['tf32_vs_ieee']):>14}"
        )
    worst = max(rows, key=lambda row: row["tf32_vs_ieee"])
    print(f"largest tf32 vs ieee nRMSE: {worst['tf32_vs_ieee']:.3g} ({worst['case']}, {worst['result']})")
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
