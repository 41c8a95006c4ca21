"""Training conformance at the kernel: the chunk kernel's gradients against the float64 recurrence's
(`kernel-chunk-grad-*`), and causality (`kernel-chunk-causal`, `kernel-chunk-grad-causal`,
`layer-causal`), for kda_impl, a third JAX implementation (tests/conformance/gradient_adapters.py) and
its seeded defects."""

from __future__ import annotations

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conformance import cli
from conformance.adapters.kda_impl_adapter import KDAImplAdapter
from conformance.checks import kinds
from conformance.checks.catalogue import CheckSkipped, CheckSpec
from conformance.checks.causality import split_positions
from conformance.checks.kinds import Check
from conformance.checks.runner import CheckRunner
from conformance.dumps.reader import DumpSet
from conformance.judging.verdict import worst_ratio
from conformance.policy import TolerancePolicy
from conformance.search import judge as search_judge
from conformance.search.dumpcase import CASE_ID, write_case_set
from conformance.search.space import SearchCase
from conformance.search.weight_sets import weight_sets
from kda_spec.truth import GRADIENT_NAMES, packed_delta_rule_vjp
from tests.conformance import gradient_adapters
from tests.conformance.numpy_adapter import NumpyAdapter
from tests.conformance.test_serving import GOLDEN

POLICY = TolerancePolicy.load()
GRADIENT_CHECKS = (
    *(Check(kinds.KERNEL_CHUNK_GRAD, name) for name in kinds.GRADIENT_INPUTS),
    Check(kinds.KERNEL_CHUNK_GRAD_H0),
)
CAUSAL_CHECKS = (Check(kinds.KERNEL_CHUNK_CAUSAL), Check(kinds.KERNEL_CHUNK_GRAD_CAUSAL))
CASES = ("T65", "varlen_initstate")  # one sequence over a chunk boundary; a packed batch from initial states


def _results(adapter: type, dumps: DumpSet, cases, checks, dtype: str = "fp32") -> dict[str, object]:
    runner = CheckRunner(dumps, adapter, "auto", POLICY)
    return {
        f"{case}:{check.name}": runner.run(CheckSpec(case, dtype, check)).comparison
        for case in cases
        for check in checks
    }


def test_the_hand_written_vjp_is_jax_autodiff_of_the_token_recurrence() -> None:
    """kda_spec.truth.packed_delta_rule_vjp (reverse mode by hand, states recomputed in 64-token blocks)
    against `jax.vjp` of the same recurrence as a `lax.scan`, both float64: the truth of every gradient
    check is the recurrence's exact derivative."""
    rng = np.random.default_rng(0)
    tokens, heads, dim = 150, 2, 8
    cu = np.array([0, 37, 150], np.int32)

    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q, k = unit(rng.standard_normal((2, tokens, heads, dim)))
    v, g = rng.standard_normal((tokens, heads, dim)), -np.exp(rng.standard_normal((tokens, heads, dim)))
    beta, h0 = (
        1 / (1 + np.exp(-rng.standard_normal((tokens, heads)))),
        rng.standard_normal((2, heads, dim, dim)),
    )
    do, dht = rng.standard_normal((tokens, heads, dim)), rng.standard_normal((2, heads, dim, dim))

    def recurrence(q, k, v, g, beta, h0):
        def step(state, x):
            q_t, k_t, v_t, g_t, beta_t = x
            state = state * jnp.exp(g_t)[..., None]
            delta = beta_t[:, None] * (v_t - jnp.einsum("hk,hkv->hv", k_t, state))
            state = state + k_t[..., None] * delta[:, None, :]
            return state, jnp.einsum("hk,hkv->hv", q_t * dim**-0.5, state)

        outs, finals = [], []
        for n, (start, end) in enumerate(itertools.pairwise(cu)):
            final, o = jax.lax.scan(step, h0[n], tuple(x[start:end] for x in (q, k, v, g, beta)))
            outs.append(o)
            finals.append(final)
        return jnp.concatenate(outs), jnp.stack(finals)

    with jax.enable_x64(True):
        _, pullback = jax.vjp(recurrence, *(jnp.asarray(x) for x in (q, k, v, g, beta, h0)))
        expected = dict(
            zip(GRADIENT_NAMES, (np.asarray(x) for x in pullback((jnp.asarray(do), jnp.asarray(dht)))))
        )
    found = packed_delta_rule_vjp(q, k, v, g, beta, cu, h0, do, dht)
    for name in GRADIENT_NAMES:
        assert found[name].dtype == np.float64
        np.testing.assert_allclose(found[name], expected[name], rtol=1e-12, atol=1e-13, err_msg=name)


@pytest.mark.parametrize("adapter", [KDAImplAdapter, gradient_adapters.NaiveChunkKernels])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_faithful_implementations_pass_every_gradient_and_causality_check(adapter: type, dtype: str) -> None:
    found = _results(adapter, DumpSet(str(GOLDEN)), CASES, GRADIENT_CHECKS + CAUSAL_CHECKS, dtype)
    failed = {name: c.failures for name, c in found.items() if not c.passed}
    assert not failed
    ratios = [worst_ratio(c.attribution.criteria) for c in found.values() if c.attribution is not None]
    assert len(ratios) == len(CASES) * len(GRADIENT_CHECKS) and max(ratios) < 0.5


@pytest.mark.parametrize("dumps", [GOLDEN, GOLDEN.parent / "golden-glm5-next"], ids=lambda path: path.name)
def test_kda_impls_layer_is_causal_to_the_bit_on_both_families(dumps) -> None:
    found = _results(KDAImplAdapter, DumpSet(str(dumps)), ("varlen_initstate",), (Check(kinds.LAYER_CAUSAL),))
    assert all(c.passed for c in found.values()), {n: c.failures for n, c in found.items()}


def test_a_gradient_one_percent_off_fails_its_check_alone() -> None:
    found = _results(gradient_adapters.BetaGradientScaled, DumpSet(str(GOLDEN)), ("T65",), GRADIENT_CHECKS)
    assert [name for name, c in found.items() if not c.passed] == ["T65:kernel-chunk-grad-beta"]
    failed = found["T65:kernel-chunk-grad-beta"]
    assert failed.attribution.blame == "impl" and worst_ratio(failed.attribution.criteria) > 100


def test_decays_anchored_at_the_chunk_end_break_causality() -> None:
    """fla #1240: every row of a chunk rounds with the chunk's later gates. The forward's values are as
    close to the truth as the faithful kernel's; only the causality checks see it."""
    found = _results(
        gradient_adapters.AnchoredAtChunkEnd, DumpSet(str(GOLDEN)), ("varlen_initstate",),
        GRADIENT_CHECKS + CAUSAL_CHECKS,
    )  # fmt: skip
    assert {name for name, c in found.items() if not c.passed} == {
        f"varlen_initstate:{check.name}" for check in CAUSAL_CHECKS
    }


@pytest.fixture(scope="module")
def strong_decay(tmp_path_factory: pytest.TempPathFactory) -> DumpSet:
    """One sequence of 40 tokens on the stress weights with the gate's pre-activation at 8: per-token log
    decays of -10 to -300, so that a chunk's exp(G_i - G_j) above its diagonal overflows fp32."""
    case = SearchCase("fp32", "stress", (40,), gate="strong", seed=3)
    weight_set = weight_sets(None, "mini", 0, KDAImplAdapter.FAMILIES)[case.weights]
    root = tmp_path_factory.mktemp("strong-decay") / "set"
    write_case_set(str(root), case, weight_set.weights, weight_set.config, weight_set.source, {})
    return DumpSet(str(root))


def test_an_exp_masked_after_it_overflows_gives_nan_gradients(strong_decay: DumpSet) -> None:
    """transformers' eager path before PR #48455: the forward holds, the gradients are NaN."""
    g = strong_decay.case(CASE_ID).result("g", "fp32")
    assert np.sum(g[:16], axis=0).min() < -89  # exp(-sum) overflows fp32 within the first chunk
    found = _results(
        gradient_adapters.ExpThenMask,
        strong_decay,
        (CASE_ID,),
        (Check(kinds.KERNEL_CHUNK), *GRADIENT_CHECKS),
    )
    assert found[f"{CASE_ID}:kernel-chunk"].passed
    nan = [name for name, c in found.items() if any("NaN/Inf" in failure for failure in c.failures)]
    assert f"{CASE_ID}:kernel-chunk-grad-g" in nan
    faithful = _results(gradient_adapters.NaiveChunkKernels, strong_decay, (CASE_ID,), GRADIENT_CHECKS)
    assert all(c.passed for c in faithful.values()), {
        n: c.failures for n, c in faithful.items() if not c.passed
    }


def test_an_adapter_without_the_gradient_protocol_is_skipped_with_the_reason(synthetic_dumps) -> None:
    runner = CheckRunner(DumpSet(str(synthetic_dumps)), NumpyAdapter, "auto", POLICY)
    for check in (*GRADIENT_CHECKS, Check(kinds.KERNEL_CHUNK_GRAD_CAUSAL)):
        with pytest.raises(CheckSkipped, match="implements no gradient protocol"):
            runner.run(CheckSpec("T8", "fp32", check))


@pytest.mark.parametrize(
    ("tokens", "positions"),
    [(1, []), (2, [1]), (40, [17]), (65, [32, 64]), (128, [64, 81]), (1024, [512, 529])],
)
def test_a_case_is_split_on_a_chunk_boundary_and_inside_a_chunk(tokens: int, positions: list[int]) -> None:
    assert split_positions(tokens) == positions


@pytest.mark.parametrize(
    ("defect", "checks"),
    [
        ("BetaGradientScaled", {"kernel-chunk-grad-beta"}),
        ("AnchoredAtChunkEnd", {"kernel-chunk-causal", "kernel-chunk-grad-causal"}),
    ],
)
def test_the_grad_space_finds_and_shrinks_each_seeded_defect(tmp_path, defect: str, checks: set[str]) -> None:
    code = cli.main(
        [
            "search", "--space", "grad", "--impl", f"tests.conformance.gradient_adapters:{defect}",
            "--preset", "mini", "--budget", "120", "--shrink-budget", "60", "--max-tokens", "32",
            "--max-seqs", "2", "--out", str(tmp_path), "--no-progress",
        ]
    )  # fmt: skip
    assert code == 1
    report = json.loads((tmp_path / "search.json").read_text())
    finding = report["finding"]
    assert finding["check"] in checks and finding["case"]["seq_lens"] in ([1], [2])
    assert [r["passed"] for r in finding["replay"]] == [False]
    assert finding["kda_impl_fails"] == []
    assert report["checks"] == list(search_judge.GRADIENT_CHECKS)


def test_kda_impl_holds_a_short_grad_search(tmp_path) -> None:
    code = cli.main(
        [
            "search", "--space", "grad", "--preset", "mini", "--budget", "20", "--max-tokens", "64",
            "--out", str(tmp_path), "--no-progress",
        ]
    )  # fmt: skip
    report = json.loads((tmp_path / "search.json").read_text())
    assert code == 0 and report["finding"] is None and report["tally"]["cases"] >= 1
    assert set(report["tally"]["per_check"]) == set(search_judge.GRADIENT_CHECKS)
