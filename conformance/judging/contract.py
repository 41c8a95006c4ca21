"""The implementation against the bf16 precision contract's float64 model of its roundings: nRMSE and
gain, and the contract's criteria (docs/tolerance-policy.md, "The precision contract")."""

from __future__ import annotations

import dataclasses

import numpy as np

from conformance.judging.limits import ContractLimits
from conformance.judging.measurement import MinTokensRule, normalised_rmse
from conformance.judging.verdict import Criterion


@dataclasses.dataclass(frozen=True)
class ContractError:
    """One side against the bf16 precision contract's float64 model `m`: `nrmse` `‖x - m‖₂ / ‖m‖₂`, and
    `gain` `<x - m, m> / <m, m>`, the part of the error along the model: what a scale defect (a weight
    times 1 + ε) adds to it, and what independent roundings average out of it."""

    nrmse: float
    gain: float


def error_vs_contract(x: np.ndarray, model: np.ndarray) -> ContractError:
    """The error of `x` against the contract's model (same shape); a NaN/Inf in `x` is an infinite one."""
    x, m = np.asarray(x, np.float64), np.asarray(model, np.float64)
    if x.shape != m.shape:
        raise ValueError(f"result of shape {x.shape} against a contract model of shape {m.shape}")
    if not np.all(np.isfinite(x)):
        return ContractError(nrmse=float("inf"), gain=float("inf"))
    error = x - m
    norm2 = float(np.sum(m * m))
    gain = float(np.sum(error * m)) / norm2 if norm2 > 0 else (0.0 if not error.any() else float("inf"))
    return ContractError(nrmse=normalised_rmse(np.abs(error), m), gain=gain)


@dataclasses.dataclass(frozen=True)
class ContractCheck:
    """The implementation against the bf16 precision contract (docs/tolerance-policy.md): its nRMSE and
    gain against the float64 model of the contract's roundings, under `limits`, over the rows the
    minimum-tokens rule selects; the reference's own numbers beside it, reported only (a reference may
    round elsewhere: transformers' port does)."""

    source: str
    impl: ContractError
    reference: ContractError
    limits: ContractLimits
    fp32_stage: bool  # the contract keeps this result in fp32 (g, beta, states): the tighter nRMSE limit
    gating: MinTokensRule  # the minimum-tokens rule on the result
    impl_truth_nrmse: float  # the implementation's nRMSE against the float64 truth
    model_truth_nrmse: float  # the model's own: what the contract's roundings cost
    # The model with every near-tie rounded the other way, against the model: how far one-ulp flips carry
    # in this case (`ContractLimits`); None where it was not needed (the fixed limits hold).
    spread: ContractError | None = None

    @property
    def criteria(self) -> tuple[Criterion, ...]:
        """The contract on the implementation: its nRMSE (the limit of a bf16 or an fp32 stage) and
        |gain| against the model, under the minimum-tokens rule, unless it is `closer_factor` times
        closer to the truth than the model itself (it rounds less, not worse)."""
        limits = self.limits
        closer = Criterion(
            "contract",
            f"{limits.closer_factor:g}× closer to the float64 truth than the contract's model",
            self.impl_truth_nrmse * limits.closer_factor,
            0.0,
            1.0,
            self.model_truth_nrmse,
        )
        gating = {**self.gating.criterion_fields(), "unless": closer}
        nrmse_limit, gain_limit, source = self.max_nrmse, limits.max_gain, ""
        if self.spread is not None:
            nrmse_limit = max(nrmse_limit, limits.spread_factor * self.spread.nrmse)
            gain_limit = max(gain_limit, limits.spread_factor * abs(self.spread.gain))
            source = (
                f"the larger of the contract's limit and {limits.spread_factor:g}× its model's spread "
                f"(nRMSE {self.spread.nrmse:.3g}, gain {self.spread.gain:+.3g})"
            )
        gain = abs(self.impl.gain)
        return (
            Criterion(
                "contract", "nRMSE vs the contract's model", self.impl.nrmse, nrmse_limit, **gating,
                floor_source=source if nrmse_limit > self.max_nrmse else "",
            ),
            Criterion(
                "contract", "|gain| vs the contract's model", gain, gain_limit, **gating,
                detail=f"gain vs the contract's model {self.impl.gain:+.3g}, |gain| > {gain_limit:.3g}",
                floor_source=source if gain_limit > limits.max_gain else "",
            ),
        )  # fmt: skip

    def with_spread(self, spread_model: np.ndarray, model: np.ndarray) -> ContractCheck:
        """This check with its model's spread: `spread_model` (every near-tie of the model rounded the
        other way) against `model`, over the rows the check's statistics use."""
        rows = _selected(self.gating)
        spread = error_vs_contract(np.asarray(spread_model)[rows], np.asarray(model)[rows])
        return dataclasses.replace(self, spread=spread)

    @property
    def fixed_limits_hold(self) -> bool:
        """The implementation holds the contract's fixed limits (its model's spread is not needed)."""
        return all(criterion.holds for criterion in dataclasses.replace(self, spread=None).criteria)

    @property
    def closer(self) -> bool:
        """The implementation is `closer_factor` times closer to the truth than the model: exempt."""
        return self.criteria[0].unless.holds

    @property
    def max_nrmse(self) -> float:
        return self.limits.max_nrmse_fp32_stage if self.fp32_stage else self.limits.max_nrmse


def contract_check(
    actual: np.ndarray,
    expected: np.ndarray,
    model: np.ndarray,
    truth: np.ndarray,
    impl_truth_nrmse: float,
    source: str,
    limits: ContractLimits,
    fp32_stage: bool,
    gating: MinTokensRule,
) -> ContractCheck:
    """Both sides of a check against the contract's float64 `model` (where it comes from: `source`), over
    the rows `gating` selects (all of them where it selects none: reported, not gated); the model against
    the float64 `truth`, beside the implementation's nRMSE against it (`TruthError.nrmse` of the check's
    attribution)."""
    rows = _selected(gating)
    return ContractCheck(
        source=source,
        impl=error_vs_contract(np.asarray(actual)[rows], np.asarray(model)[rows]),
        reference=error_vs_contract(np.asarray(expected)[rows], np.asarray(model)[rows]),
        limits=limits,
        fp32_stage=fp32_stage,
        gating=gating,
        impl_truth_nrmse=impl_truth_nrmse,
        model_truth_nrmse=error_vs_contract(model, truth).nrmse,
    )


def _selected(gating: MinTokensRule) -> np.ndarray | slice:
    """The rows the minimum-tokens rule selects, or all of them where it selects none."""
    return gating.rows if gating.rows.any() else slice(None)
