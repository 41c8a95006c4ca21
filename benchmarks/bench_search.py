"""`make bench`: how many cases a minute `conformance search` judges on kda_impl, mini preset, fp32.

One judge (its adapters, so their compiled buckets, kept), first a warm-up search of `--warmup` seconds
that compiles the shape buckets, then the measured search of `--budget` seconds from another seed: the
cases judged a minute, with the load average beside it (a shared machine's rate is as good as its load).

    python -m benchmarks.bench_search [--budget 120] [--warmup 60] [--kernel auto]
"""

from __future__ import annotations

import argparse
import os

from conformance.adapter import KERNEL_CHOICES
from conformance.adapters.kda_impl_adapter import KDAImplAdapter
from conformance.policy import TolerancePolicy
from conformance.runtime.compile_cache import enable_compile_cache
from conformance.runtime.cpu_compile import prefer_fast_cpu_compile
from conformance.search.command import weight_sets
from conformance.search.explore import explore
from conformance.search.judge import Judge
from conformance.search.space import case_strategy

GOAL_PER_MINUTE = 60  # cases a minute: the search's speed goal at the mini preset in fp32 (docs/search.md)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=120.0)
    parser.add_argument("--warmup", type=float, default=60.0)
    parser.add_argument("--kernel", default="auto", choices=KERNEL_CHOICES)
    args = parser.parse_args()
    prefer_fast_cpu_compile()
    enable_compile_cache()
    config, weights, sources = weight_sets(None, "mini", 0)
    judge = Judge(KDAImplAdapter, args.kernel, {}, TolerancePolicy.load(), config, weights, sources)
    cases = case_strategy(("fp32",), list(weights))
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
