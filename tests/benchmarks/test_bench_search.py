"""`python -m benchmarks.bench_search` (`make bench`) builds the search's judge and case space as the
command does: both families' weight sets, fp32 cases on them."""

from __future__ import annotations

import hypothesis
from hypothesis import strategies as st

from benchmarks import bench_search
from conformance.adapters.kda_impl_adapter import KDAImplAdapter


@hypothesis.settings(max_examples=20, database=None, deadline=None)
@hypothesis.given(data=st.data())
def test_the_bench_searches_what_the_command_searches(data: st.DataObject) -> None:
    judge, cases = bench_search.searched("naive")
    families = {weights.config.family for weights in judge.weight_sets.values()}
    assert families == set(KDAImplAdapter.FAMILIES)
    case = data.draw(cases)
    assert case.dtype == "fp32" and case.weights in judge.weight_sets
