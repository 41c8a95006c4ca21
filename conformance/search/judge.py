"""Judging one generated case, without torch: each check against the float64 truth, relative to the
plain fp32 pipeline's own error on the same inputs.

The case is written as a dump set in memory (`dumpcase.py`: the plain fp32 pipeline is its reference,
the float64 layer its truth) and its checks are computed by the suite's own `CheckRunner` (`sides` for
the implementation's result and the reference, `truth` for the check's truth): the same calls of the
adapter, the same replays of decode and chunked prefill, the same guard, as `conformance run` makes on
the reproducer. The adapter is built once per weight set and dtype and reused for every case.

The criterion is the relative gate of docs/tolerance-policy.md with the plain fp32 pipeline as the
reference, and its limits (`[relative.<dtype>]` of the policy file, its fp32 floors raised to the
rounding budget of the check's widest reduction as the suite raises them, and the check's atol/rtol):

    ratio = max(impl_margin / (factor · base_margin + margin_floor),
                impl_nrmse / (factor · base_nrmse + nrmse_floor))

with base_margin and base_nrmse the larger of two plain fp32 pipelines' (fp32 runs; in bf16 the
reference's alone): the reference, and the same pipeline on hidden states one fp32 ulp off (each element
moved to a neighbour, up or down at random): how far a rounding of the input moves the result, which is
how far any faithful fp32 pipeline may be off where the problem amplifies rounding (a strong decay's
state depends on g through exp(sum g) with |sum g| in the thousands: kda_impl's state is 2.3x the
reference's error there while the float64 recurrence on kda_impl's own stages is as far off).

margins `max |x - t| / (atol + rtol·|t|)` and nRMSEs `‖x - t‖₂ / ‖t‖₂` against the truth t: the
number `conformance run` reports as the check's relative ratio on the reproducer. A case is flagged when
a check's ratio exceeds `HEADROOM` (NaN/Inf in a result, and a fault of the implementation, are an
infinite ratio). Where the problem itself amplifies rounding (strong decay, the RMS norm of a tiny
head, huge activations) the plain fp32 pipeline is off the truth as much, and the limit grows with it:
the criterion judges the implementation's arithmetic, not the input's conditioning. `conformance run`
applies the same relative gate (and, in fp32, also the RFC's absolute 1e-5; in bf16 the precision
contract), so every flagged check fails there too.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterator, Mapping

import fsspec
import numpy as np

from conformance.adapter import KDAAdapter
from conformance.adapters.guard import CallWatchdog, ImplementationFault
from conformance.checks import kinds
from conformance.checks.catalogue import CheckSkipped, CheckSpec
from conformance.checks.kinds import Check
from conformance.checks.runner import CheckRunner
from conformance.checks.truth import NoTruth
from conformance.dumps.reader import CaseData, DumpSet
from conformance.judging.attribution import TruthError, error_vs_truth, relative_criteria
from conformance.judging.comparison import Comparison
from conformance.judging.limits import RelativeLimits
from conformance.judging.verdict import decide
from conformance.policy import TolerancePolicy
from conformance.search.dumpcase import CASE_ID, plain_pipeline, write_case_set
from conformance.search.space import SearchCase
from conformance.search.weight_sets import WeightSet
from kda_spec import dump_format as fmt
from kda_spec.config import KDAConfig

# The checks judged per case: every check `conformance run` makes of a case but decode-all (one decode
# call per token; decode-k1 and decode-k8 decode the same way) and the decode checks against the
# adapter's own prefill (their result is decode-k*'s, judged against the same truth).
CHECKS = tuple(
    check.name
    for check in (
        Check(kinds.LAYER),
        Check(kinds.LAYER_STATE),
        Check(kinds.LAYER_KERNEL_STATE),
        *(Check(kind) for kind in (*kinds.KERNEL_KINDS, *kinds.RAW_GATE_KERNEL_KINDS)),
        Check(kinds.KERNEL_CHUNK_CHECKPOINTS),
        *(Check(kinds.INTERMEDIATE, name) for name in fmt.INTERMEDIATE_KEYS),
        Check(kinds.DECODE, "k1"),
        Check(kinds.DECODE, "k8"),
        Check(kinds.CHUNKED_PREFILL),
        Check(kinds.CHUNKED_PREFILL_STATE),
    )
)
# `--space grad`: the checks of training (docs/gradients.md) on the same generated cases: the chunk kernel's
# gradients against the float64 truth's (judged as `CHECKS` are), and causality, bit-exact (no truth: a
# check that fails is an infinite ratio).
GRADIENT_CHECKS = tuple(
    check.name
    for check in (
        *(Check(kinds.KERNEL_CHUNK_GRAD, name) for name in kinds.GRADIENT_INPUTS),
        Check(kinds.KERNEL_CHUNK_GRAD_H0),
        Check(kinds.KERNEL_CHUNK_CAUSAL),
        Check(kinds.KERNEL_CHUNK_GRAD_CAUSAL),
        Check(kinds.LAYER_CAUSAL),
    )
)
MEMORY_ROOT = "memory://conformance-search"
PERTURBATION_STREAM = 1  # the random directions of the one-ulp perturbation, apart from the case's draws
# A check is flagged beyond this ratio, not beyond 1: the relative gate's factor 2 was measured on fixed
# cases, and over thousands of random ones the ratio of a faithful implementation scatters further: on
# a strong-decay case the state's error is the gate's and the projections' fp32 rounding amplified by
# |g| (hundreds), so which of two faithful pipelines is closer to the truth is chance, and by how much
# varies. Measured on kda_impl (docs/search.md, "A correct implementation").
HEADROOM = 2.0


@dataclasses.dataclass(frozen=True)
class CheckJudgement:
    """One check of one case: `ratio` (> 1: flagged) and the numbers behind it; `fault` the
    implementation's fault message (ratio inf) or empty."""

    check: str
    ratio: float
    impl_margin: float
    impl_nrmse: float
    base_margin: float
    base_nrmse: float
    fault: str = ""

    @property
    def flagged(self) -> bool:
        return not self.ratio <= HEADROOM

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class CaseVerdict:
    """Every judged check of one case, the checks skipped (name → why), the seconds it took, and the
    layer config (family included) it ran on."""

    case: SearchCase
    checks: dict[str, CheckJudgement]
    skipped: dict[str, str]
    seconds: float
    config: KDAConfig

    @property
    def flagged(self) -> list[CheckJudgement]:
        """The flagged checks, worst first."""
        return sorted((j for j in self.checks.values() if j.flagged), key=lambda j: -j.ratio)


def judgement(
    check: str,
    actual: np.ndarray,
    bases: list[np.ndarray],
    truth: np.ndarray,
    policy: TolerancePolicy,
    dtype: str,
    limits: RelativeLimits,
) -> CheckJudgement:
    """`actual` (the implementation's) and `bases` (plain fp32 pipelines') results of `check` against
    `truth`, all of one shape, under the check's relative `limits` (module docstring)."""
    tolerance = policy.tolerance(check, dtype)
    impl = error_vs_truth(actual, truth, tolerance)
    errors = [error_vs_truth(base, truth, tolerance) for base in bases]
    base = TruthError(*map(max, zip(*(dataclasses.astuple(e) for e in errors))))  # each field's largest
    ratio = decide("relative", relative_criteria(impl, base, limits)).ratio()  # the suite's relative gate
    return CheckJudgement(check, ratio, impl.margin, impl.nrmse, base.margin, base.nrmse)


def bit_exact_judgement(check: str, comparison: Comparison) -> CheckJudgement:
    """A check without a truth (bit-exact: causality) as a judgement: ratio 0 when it holds, infinite when
    it fails (its margin and nRMSE against the zeros it compares with recorded beside)."""
    measured = comparison.measurement
    ratio = 0.0 if comparison.passed else float("inf")
    return CheckJudgement(check, ratio, measured.margin, measured.nrmse, 0.0, 0.0)


@dataclasses.dataclass
class Judge:
    """Judges cases on one implementation: `adapter_class` with `kernel` and `options`, one adapter per
    (weight set, dtype), each built from its weight set (`weight_sets`: name → `WeightSet`, the weights
    and the config, so the family, they are for) the first time a case needs it."""

    adapter_class: type[KDAAdapter]
    kernel: str
    options: Mapping[str, str]
    policy: TolerancePolicy
    weight_sets: Mapping[str, WeightSet]
    watchdog: CallWatchdog | None = None
    checks: tuple[str, ...] = CHECKS  # what each case is judged by: `CHECKS`, or `GRADIENT_CHECKS`
    _adapters: dict[tuple[str, str], KDAAdapter] = dataclasses.field(default_factory=dict, init=False)
    _ids: Iterator[int] = dataclasses.field(default_factory=itertools.count, init=False)

    def write(
        self, case: SearchCase, url: str, search: Mapping[str, object], overwrite: bool = False
    ) -> None:
        """The case as a one-case dump set at `url` (`dumpcase.write_case_set`)."""
        weight_set = self.weight_sets[case.weights]
        write_case_set(url, case, weight_set.weights, weight_set.config, weight_set.source, search, overwrite)

    def runner(self, url: str, case: SearchCase) -> CheckRunner:
        """A `CheckRunner` on the set at `url`, with the implementation's adapter for the case's weight set
        and dtype (built on first use: an `ImplementationFault` when its constructor fails)."""
        runner = CheckRunner(
            DumpSet(url), self.adapter_class, self.kernel, self.policy, self.options, self.watchdog
        )
        key = (case.weights, case.dtype)
        if key in self._adapters:
            runner.calls.use_adapter(case.dtype, self._adapters[key])
        else:
            self._adapters[key] = runner.calls.adapter(case.dtype)
        return runner

    def perturbed_pipeline(self, case: SearchCase, data: CaseData) -> dict[str, np.ndarray]:
        """The plain fp32 pipeline's layer results on the case's hidden states (`data`, as written) one
        ulp off (module docstring), by dump name."""
        x = data.hidden_states
        up = np.random.default_rng([case.seed, PERTURBATION_STREAM]).random(x.shape) < 0.5
        moved = np.nextafter(x, np.where(up, np.float32(np.inf), np.float32(-np.inf)))
        weight_set = self.weight_sets[case.weights]
        return plain_pipeline(
            moved, data.cu_seqlens, data.initial_state, weight_set.weights, weight_set.config, case.dtype
        )

    def judge(self, case: SearchCase) -> CaseVerdict:
        """Every check of `self.checks` on `case` (module docstring)."""
        started = time.perf_counter()
        url = f"{MEMORY_ROOT}/{next(self._ids)}"
        self.write(case, url, {})
        try:
            runner = self.runner(url, case)
            data = runner.case(CASE_ID)
            checks, skipped = {}, {}
            perturbed: list[dict[str, np.ndarray]] = []  # the one-ulp pipeline, computed on first use
            for check in self.checks:
                spec = CheckSpec(CASE_ID, case.dtype, check)
                try:
                    sides = runner.sides(data, spec)
                    if spec.kind.truth is None:
                        checks[check] = bit_exact_judgement(check, runner.judge(data, spec, sides).comparison)
                        continue
                    truth, _ = runner.truth(data, spec, sides)
                except (CheckSkipped, NoTruth) as why:
                    skipped[check] = str(why)
                    continue
                except ImplementationFault as fault:
                    inf = float("inf")
                    checks[check] = CheckJudgement(check, inf, inf, inf, 0.0, 0.0, fault=fault.message)
                    continue
                bases = [sides.expected]
                if case.dtype == "fp32" and spec.kind.truth == kinds.LAYER_TRUTH:
                    if not perturbed:
                        perturbed.append(self.perturbed_pipeline(case, data))
                    bases.append(sides.rows_of(perturbed[0][spec.of.result]))
                tolerance = self.policy.tolerance(check, case.dtype)
                limits = runner.relative_limits(data, spec, tolerance, truth, sides)
                checks[check] = judgement(check, sides.actual, bases, truth, self.policy, case.dtype, limits)
        finally:
            fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)
        config = self.weight_sets[case.weights].config
        return CaseVerdict(case, checks, skipped, time.perf_counter() - started, config)
