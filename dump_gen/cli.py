"""`python -m dump_gen`: make a dump set from a torch reference of the KDA layer.

    python -m dump_gen --out DIR_OR_URL [--overwrite] [--preset NAME] [--reference transformers|fla|hf-hub]
        [--hub-snapshot DIR] [--checkpoint DIR --layer N] [--cases ID|long ...] [--seed N] [--device cpu|cuda]
        [--weights synthetic|stress] [--hidden-size N] [--num-heads N] [--head-dim N] [--conv-size N]
        [--rms-norm-eps X] [--gate-lower-bound L] [--threads N] [--truth-intermediates-max-tokens N]
        [--gradient-cases ID ...|none]

Exit status: 0 the set was written; 2 a problem the user can fix, reported on one line (a bad flag,
checkpoint or destination, a reference that produced NaN/Inf, the torch references' extra not
installed), with the destination as it was;
130 interrupted (Ctrl-C): a local destination as it was, a remote one as kda_spec.storage says.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import time

from dump_gen.errors import DumpError
from dump_gen.references import REFERENCES
from kda_spec.config import PRESETS, KDAConfig, get_preset
from kda_spec.dump_format import CASE_GROUPS, CASES_BY_ID, LONG_GROUP, CaseSpec, select_cases
from kda_spec.extras import missing_extra
from kda_spec.families import KIMI_LINEAR
from kda_spec.gradients import GRADIENTS_MAX_TOKENS, default_gradient_cases
from kda_spec.storage import StorageError
from kda_spec.synthetic_weights import WEIGHTS_KINDS
from kda_spec.truth import INTERMEDIATES_MAX_TOKENS

# Config override flags: (flag, KDAConfig field, type).
_OVERRIDES = (
    ("--hidden-size", "hidden_size", int),
    ("--num-heads", "num_heads", int),
    ("--head-dim", "head_dim", int),
    ("--conv-size", "conv_size", int),
    ("--rms-norm-eps", "rms_norm_eps", float),
    ("--gate-lower-bound", "gate_lower_bound", float),  # a lower-bound family's L (< 0)
)


@dataclasses.dataclass(frozen=True)
class Options:
    out: str
    overwrite: bool
    config: KDAConfig
    reference: str
    hub_snapshot: str | None
    checkpoint: str | None
    layer: int | None
    case_ids: list[str] | None
    seed: int
    device: str
    threads: int
    progress: bool
    weights: str = (
        "synthetic"  # the synthetic kind (kda_spec.synthetic_weights.WEIGHTS_KINDS) unless --checkpoint
    )
    truth_intermediates_max_tokens: int = INTERMEDIATES_MAX_TOKENS
    gradient_cases: tuple[str, ...] | None = (
        None  # the cases whose reference gradients are stored (None: default)
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dump_gen",
        description="Freeze what a torch reference of the KDA layer computes into a dump set (format v1).",
    )
    parser.add_argument(
        "--out", required=True, help="destination folder or fsspec URL (gs://bucket/prefix, memory://x)"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the dump set already at --out (never anything else)"
    )
    parser.add_argument(
        "--preset", default="kimi-linear-48b-a3b", help=f"layer shape, one of {sorted(PRESETS)}"
    )
    parser.add_argument("--reference", default="transformers", help=f"one of {list(REFERENCES)}")
    parser.add_argument(
        "--hub-snapshot", metavar="DIR", help="local download of the model's hub repository (hf-hub)"
    )
    parser.add_argument(
        "--checkpoint", metavar="DIR", help="read the weights of one layer from these safetensors"
    )
    parser.add_argument("--layer", type=int, metavar="N", help="0-based layer of --checkpoint")
    parser.add_argument(
        "--cases",
        nargs="+",
        metavar="ID",
        help=f"a subset of {list(CASES_BY_ID)}, or a group of them: {list(CASE_GROUPS)} (never by default)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seeds the synthetic weights and every case's inputs"
    )
    parser.add_argument(
        "--weights",
        default="synthetic",
        help="synthetic weights: 'synthetic' (an initialised layer's scales) or 'stress' (decays up to "
        "exp(A_log) = 16 and per-token g near -60; a lower-bound family's gate at its floor L in every 4th "
        "channel: docs/dump-format.md)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: the references are many small ops, which more threads slow down "
        "on a busy machine, and the results stay independent of the core count)",
    )
    parser.add_argument(
        "--truth-intermediates-max-tokens",
        type=int,
        default=INTERMEDIATES_MAX_TOKENS,
        metavar="N",
        help="store the float64 truth of the intermediates for cases of at most N tokens (default "
        f"{INTERMEDIATES_MAX_TOKENS}; the output's and the states' truth is stored for every case)",
    )
    parser.add_argument(
        "--gradient-cases",
        nargs="+",
        metavar="ID",
        help="store the reference's gradients (the chunk kernel's and the layer's, under torch autograd) and "
        f"their cotangents for these of the cases (default: those of at most {GRADIENTS_MAX_TOKENS} tokens; "
        "none: for no case; a long case never)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    for flag, field, kind in _OVERRIDES:
        parser.add_argument(flag, type=kind, dest=field, help=f"override the preset's {field}")
    return parser


def parse_options(argv: list[str] | None) -> Options:
    args = build_parser().parse_args(argv)
    try:
        config = get_preset(args.preset)
        overrides = {
            field: getattr(args, field) for _, field, _ in _OVERRIDES if getattr(args, field) is not None
        }
        if overrides:
            config = config.replace(**overrides, preset="custom")
        select_cases(args.cases)
    except ValueError as err:
        raise DumpError(str(err)) from None
    if args.reference not in REFERENCES:
        raise DumpError(f"unknown reference {args.reference!r}; known references: {list(REFERENCES)}")
    if args.reference == "hf-hub" and config.family != KIMI_LINEAR.name:
        raise DumpError(
            f"--reference hf-hub runs the hub's Kimi-Linear modeling file; preset {args.preset!r} is of the "
            f"{config.family} family (use --reference transformers or fla)"
        )
    if (args.reference == "hf-hub") != (args.hub_snapshot is not None):
        raise DumpError(
            "--reference hf-hub and --hub-snapshot DIR (a download of the model's hub repository) go together"
        )
    if args.device not in ("cpu", "cuda"):
        raise DumpError(f"--device must be cpu or cuda, got {args.device!r}")
    if (args.checkpoint is None) != (args.layer is None):
        raise DumpError("--checkpoint DIR and --layer N go together")
    if args.layer is not None and args.layer < 0:
        raise DumpError(f"--layer must be >= 0, got {args.layer}")
    if args.seed < 0:
        raise DumpError(f"--seed must be >= 0, got {args.seed}")
    if args.weights not in WEIGHTS_KINDS:
        raise DumpError(f"--weights must be one of {list(WEIGHTS_KINDS)}, got {args.weights!r}")
    if args.weights != "synthetic" and args.checkpoint is not None:
        raise DumpError(f"--weights {args.weights} draws synthetic weights; --checkpoint reads real ones")
    if args.threads < 1:
        raise DumpError(f"--threads must be >= 1, got {args.threads}")
    if args.truth_intermediates_max_tokens < 0:
        raise DumpError(
            f"--truth-intermediates-max-tokens must be >= 0, got {args.truth_intermediates_max_tokens}"
        )
    return Options(
        out=args.out,
        overwrite=args.overwrite,
        config=config,
        reference=args.reference,
        hub_snapshot=args.hub_snapshot,
        checkpoint=args.checkpoint,
        layer=args.layer,
        case_ids=args.cases,
        seed=args.seed,
        device=args.device,
        threads=args.threads,
        progress=not args.no_progress,
        weights=args.weights,
        truth_intermediates_max_tokens=args.truth_intermediates_max_tokens,
        gradient_cases=gradient_cases(args.gradient_cases, select_cases(args.cases)),
    )


def gradient_cases(named: list[str] | None, cases: tuple[CaseSpec, ...]) -> tuple[str, ...]:
    """The ids of `cases` whose reference gradients the set stores: `named` (`--gradient-cases`; `none`:
    no case), else `kda_spec.gradients.default_gradient_cases`. A DumpError names an id that is not among
    the cases, or a long case's."""
    if named is None:
        return default_gradient_cases(cases)
    if named == ["none"]:
        return ()
    by_id = {case.case_id: case for case in cases}
    unknown = [name for name in named if name not in by_id]
    if unknown:
        raise DumpError(f"--gradient-cases {unknown}: not among the set's cases {list(by_id)}")
    long = [name for name in named if by_id[name].group == LONG_GROUP]
    if long:
        raise DumpError(
            f"--gradient-cases {long}: a long case stores no gradients (its [T, H, D] results neither)"
        )
    return tuple(dict.fromkeys(named))


def run(options: Options) -> dict:
    """Make the dump set `options` describe; returns its manifest. Any exception on the way (KeyboardInterrupt
    included) leaves the destination as it was (`DumpWriter.abort`)."""
    # torch, transformers and fla load only once the flags and the destination are known to be good.
    from kda_spec.storage import open_writer

    # The destination is checked first: a refused --out costs no torch import and no reference run.
    with open_writer(options.out, overwrite=options.overwrite) as writer:
        from dump_gen.precision import use_ieee_fp32

        use_ieee_fp32()  # first: it sets TRITON_F32_DEFAULT before torch, triton or fla is imported
        import torch

        from dump_gen.checkpoint import checkpoint_source, read_layer
        from dump_gen.generate import generate
        from dump_gen.references import make_reference

        if options.device == "cuda" and not torch.cuda.is_available():
            raise DumpError(f"--device cuda: torch {torch.__version__} sees no CUDA device")
        torch.set_num_threads(options.threads)
        if options.checkpoint is not None:
            weights = read_layer(options.checkpoint, options.layer, options.config)
            source = checkpoint_source(options.checkpoint, options.layer)
        else:
            weights = WEIGHTS_KINDS[options.weights](options.config, options.seed)
            source = "synthetic" if options.weights == "synthetic" else f"synthetic-{options.weights}"
        reference = make_reference(options.reference, options.config, options.device, options.hub_snapshot)
        return generate(
            writer=writer,
            reference=reference,
            config=options.config,
            weights=weights,
            weights_source=source,
            cases=select_cases(options.case_ids),
            seed=options.seed,
            device=options.device,
            progress=options.progress,
            truth_intermediates_max_tokens=options.truth_intermediates_max_tokens,
            gradient_cases=options.gradient_cases,
        )


def main(argv: list[str] | None = None) -> int:
    start = time.perf_counter()
    try:
        options = parse_options(argv)
        manifest = run(options)
    except (DumpError, StorageError) as err:
        print(f"dump_gen: error: {err}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:  # the torch references' extra, imported once the flags are good
        missing = missing_extra(err, "making a dump set")
        if missing is None:
            raise
        print(f"dump_gen: error: {missing}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "dump_gen: interrupted; no new set was written (a local --out is as it was, "
            "a remote one keeps its old manifest)",
            file=sys.stderr,
        )
        return 128 + signal.SIGINT
    print(
        f"dump_gen: wrote {len(manifest['cases'])} cases ({options.reference}, {options.device}) "
        f"to {options.out} in {time.perf_counter() - start:.1f} s"
    )
    return 0
