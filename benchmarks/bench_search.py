"""`make bench`: how many cases a minute `conformance search` judges on kda_impl, mini preset (both
families), fp32.

One judge (its adapters, so their compiled buckets, kept), first a warm-up search of `--warmup` seconds
that compiles the shape buckets, then the measured search of `--budget` seconds from another seed: the
cases judged a minute, with the load average beside it (a shared machine's rate is as good as its load).

    python -m benchmarks.bench_search [--budget 120] [--warmup 60] [--kernel auto]
"""

from __future__ import annotations

import argparse
import os

from hypothesis import strategies as st

from conformance.adapter import KERNEL_CHOICES
from conformance.adapters.kda_impl_adapter import KDAImplAdapter
from conformance.policy import TolerancePolicy
from conformance.runtime.compile_cache import enable_compile_cache
from conformance.runtime.cpu_compile import prefer_fast_cpu_compile
from conformance.search.explore import explore
from conformance.search.judge import Judge
from conformance.search.space import SearchCase, case_strategy
from conformance.search.weight_sets import weight_sets

GOAL_PER_MINUTE = 60  # cases a minute: the search's speed goal at the mini preset in fp32 (docs/search.md)


def searched(kernel: str) -> tuple[Judge, st.SearchStrategy[SearchCase]]:
    """The judge and the case space of `conformance search --impl kda_impl --kernel KERNEL` (its defaults:
    mini, seed-0 weights of both families, fp32)."""
    sets = weight_sets(None, "mini", 0, KDAImplAdapter.FAMILIES)
    judge = Judge(KDAImplAdapter, kernel, {}, TolerancePolicy.load(), sets)
    return judge, case_strategy(("fp32",), list(sets))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=120.0)
    parser.add_argument("--warmup", type=float, default=60.0)
    parser.add_argument("--kernel", default="auto", choices=KERNEL_CHOICES)
    args = parser.parse_args(argv)
    prefer_fast_cpu_compile()
    enable_compile_cache()
    judge, cases = searched(args.kernel)
    warm = explore(judge.judge, cases, budget_s=args.warmup, seed=1)
    measured = explore(judge.judge, cases, budget_s=args.budget, seed=2)
    load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    rate = 60 * measured.cases / measured.drawing_s
    print(
        f"search, kda_impl ({args.kernel}), mini, fp32: {rate:.0f} cases/min ({measured.cases} in "
        f"{measured.drawing_s:.0f} s, after a {warm.cases}-case warm-up); goal >= {GOAL_PER_MINUTE}; "
        f"load average {load} on {os.cpu_count()} CPUs"
        + ("" if measured.finding is None else f"; FLAGGED {measured.finding.check}")
    )


if __name__ == "__main__":
    main()
