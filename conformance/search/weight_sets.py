"""The weight sets the case search draws from, each with the layer config (and so the KDA family) it is
for: `WeightSet`, `weight_sets`.

A dump set gives its own weights and config; a preset gives its synthetic weights, and those of the
same shape in every other family the implementation serves (`family_variants`), a lower-bound family
at each bound of `LOWER_BOUNDS`. Each has a stress twin: its decay gate's parameters (`A_log`,
`dt_bias`) replaced by `kda_spec.synthetic_weights.stress_weights`', strong decays no initialised
layer has (for a lower-bound family, the gate held at its floor L).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import numpy as np

from conformance.dumps.reader import DumpSet
from kda_spec.config import KDAConfig, get_preset
from kda_spec.families import get_family
from kda_spec.synthetic_weights import stress_weights, synthetic_weights

STRESS = "stress"
# The bounds of a lower-bound family's variants of a preset: -5 is transformers', fla's and Kimi-K3's
# default; -3 is any other, so that an implementation holding -5 fixed shows.
LOWER_BOUNDS = (-5.0, -3.0)


@dataclasses.dataclass(frozen=True)
class WeightSet:
    """One layer's float32 weights by HF name, the config they are for, and where they come from."""

    config: KDAConfig
    weights: Mapping[str, np.ndarray]
    source: str


def family_variants(config: KDAConfig, family: str) -> dict[str, KDAConfig]:
    """`config`'s shape in `family`, by weight-set prefix: `config` itself (prefix "") in its own family,
    `<family>/` for another softplus family, `<family>/` and `<family>@L<bound>/` for a lower-bound one
    at each of `LOWER_BOUNDS` (the first without a suffix); each named `<preset>@<family>[@L<bound>]`."""
    if family == config.family:
        return {"": config}
    if not get_family(family).lower_bound_gate:
        return {
            f"{family}/": config.replace(
                family=family, gate_lower_bound=None, preset=f"{config.preset}@{family}"
            )
        }
    variants = {}
    for index, bound in enumerate(LOWER_BOUNDS):
        suffix = "" if index == 0 else f"@L{bound:g}"
        preset = f"{config.preset}@{family}{suffix}"
        variants[f"{family}{suffix}/"] = config.replace(family=family, gate_lower_bound=bound, preset=preset)
    return variants


def weight_sets(
    dumps: str | None, preset: str, seed: int, families: Iterable[str] | None = None
) -> dict[str, WeightSet]:
    """The weight sets by name (module docstring): `dump` and `stress` for a dump set; for a preset,
    `synthetic` and `stress` in its own family, then `<prefix>synthetic` and `<prefix>stress` for each
    variant (`family_variants`) of each other family of `families` (the implementation's; None: the
    preset's alone), weights drawn from `seed`."""
    if dumps is not None:
        dump_set = DumpSet(dumps)
        return _with_stress("dump", WeightSet(dump_set.config, dump_set.weights(), f"dump:{dumps}"), seed, "")
    config = get_preset(preset)
    sets: dict[str, WeightSet] = {}
    others = sorted(set(families or ()) - {config.family})
    for family in [config.family, *others]:
        for prefix, variant in family_variants(config, family).items():
            base = WeightSet(variant, synthetic_weights(variant, seed), f"synthetic:{variant.preset}@{seed}")
            sets |= _with_stress("synthetic", base, seed, prefix)
    return sets


def _with_stress(name: str, base: WeightSet, seed: int, prefix: str) -> dict[str, WeightSet]:
    """`base` under `prefix + name` and its stress twin under `prefix + STRESS`."""
    config = base.config
    stress = stress_weights(config, seed)
    decay = config.kda_family.decay_parameters
    stressed = {**base.weights, **{key: stress[key] for key in decay}}
    return {
        prefix + name: base,
        prefix + STRESS: WeightSet(config, stressed, f"{base.source}+stress-gate@{seed}"),
    }
