"""The split curve (issue 43): the KDA layer's error as a function of how a long prefill is split.

One sequence of `--tokens` tokens at the `--preset`'s size is prefilled whole and in pieces of each
`--pieces` size, each piece continuing from the recurrent and conv states the previous one left
(`ImplementationCalls.prefill_in_pieces`, the suite's chunked-prefill path, with `sequences.pieces_of`).
For each implementation and split it reports the output's and the final state's distance (normalised
RMSE) to the float64 truth of the run (`kda_spec.truth`, on the run's rounded weights and inputs) and to
the same implementation's unsplit prefill, and whether the split run is bit-identical to the unsplit one.
The case is the search's in-memory form (`conformance.search.dumpcase.write_case_set`: unit normal
hidden states, the preset's synthetic or stress weights), read back through the suite's reader.

Writes `split_curve.md` (the table) and `split_curve.png` (the curves, with matplotlib) to `--out`.

    python -m benchmarks.split_curve [--tokens 1024] [--pieces 64 128 256 512] [--dtype bf16] \\
        [--impl kda_impl --impl examples.sglang_jax.adapter:SglangJaxAdapter] \\
        [--impl-option sglang_jax=PATH] [--preset kimi-linear-48b-a3b] [--out reports/split-curve]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import fsspec
import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from conformance.adapter import load_adapter_class, parse_option_pairs
from conformance.checks.calls import ImplementationCalls, pieces_output
from conformance.checks.sequences import pieces_of
from conformance.dumps.reader import DumpSet
from conformance.judging.measurement import normalised_rmse
from conformance.runtime.compile_cache import enable_compile_cache
from conformance.runtime.cpu_compile import prefer_fast_cpu_compile
from conformance.search.dumpcase import CASE_ID, write_case_set
from conformance.search.space import SearchCase
from kda_spec import dump_format as fmt
from kda_spec.config import PRESETS, get_preset
from kda_spec.synthetic_weights import WEIGHTS_KINDS

TABLE_FILE, PLOT_FILE = "split_curve.md", "split_curve.png"
UNSPLIT = "unsplit"


@dataclasses.dataclass(frozen=True)
class SplitRow:
    """One implementation's prefill at one split: nRMSE of `out` [T, hidden] and of the final state
    [1, H, D, D] against the truth and against its own unsplit prefill; max abs of the latter."""

    impl: str
    split: str  # the piece size, or UNSPLIT
    calls: int
    out_vs_truth: float
    state_vs_truth: float
    out_vs_unsplit: float
    state_vs_unsplit: float
    max_abs_vs_unsplit: float
    identical: bool  # out and state equal to the unsplit prefill's, bit for bit
    seconds: float


def case_set(preset: str, weights_kind: str, tokens: int, dtype: str, seed: int) -> DumpSet:
    """One sequence of `tokens` tokens at `preset`'s size on its `weights_kind` weights, as an in-memory
    dump set of the `dtype` run (the float64 truth of `out` and the final state in it)."""
    config = get_preset(preset)
    weights = WEIGHTS_KINDS[weights_kind](config, seed)
    url = f"memory://split-curve/{uuid.uuid4().hex}"
    case = SearchCase(dtype=dtype, weights=weights_kind, seq_lens=(tokens,), seed=seed)
    write_case_set(
        url, case, weights, config, f"{weights_kind}:{preset}@{seed}", {"benchmark": "split_curve"}
    )
    return DumpSet(url)


def split_rows(
    dumps: DumpSet,
    impl: str,
    options: Mapping[str, str],
    dtype: str,
    piece_sizes: Sequence[int],
    progress: Progress,
    task: int,
) -> list[SplitRow]:
    """`impl`'s rows: the unsplit prefill, then one per piece size (largest first)."""
    calls = ImplementationCalls(dumps, load_adapter_class(impl), "auto", options)
    case = calls.case(CASE_ID)
    truth = {name: case.arrays[fmt.truth_key(name, dtype)] for name in ("out", "recurrent_state")}
    shape = calls.inputs(case, dtype).shape
    name = calls.adapter(dtype).name
    runs: dict[str, tuple[np.ndarray, np.ndarray, int, float]] = {}
    for size in [max(case.info.seq_lens), *sorted(set(piece_sizes), reverse=True)]:
        split = UNSPLIT if size >= max(case.info.seq_lens) else str(size)
        progress.update(task, description=f"{name}: {split}")
        start = time.perf_counter()
        pieces = pieces_of(case.info.seq_lens, size)
        out, state = pieces_output(calls.prefill_in_pieces(case, dtype, pieces), shape)
        runs[split] = (
            out.astype(np.float64),
            np.asarray(state, np.float64),
            len(pieces),
            time.perf_counter() - start,
        )
        progress.advance(task)
    whole_out, whole_state = runs[UNSPLIT][:2]
    return [
        SplitRow(
            impl=name,
            split=split,
            calls=n,
            out_vs_truth=normalised_rmse(out - truth["out"], truth["out"]),
            state_vs_truth=normalised_rmse(state - truth["recurrent_state"], truth["recurrent_state"]),
            out_vs_unsplit=normalised_rmse(out - whole_out, whole_out),
            state_vs_unsplit=normalised_rmse(state - whole_state, whole_state),
            max_abs_vs_unsplit=float(np.max(np.abs(out - whole_out))),
            identical=bool(np.array_equal(out, whole_out) and np.array_equal(state, whole_state)),
            seconds=seconds,
        )
        for split, (out, state, n, seconds) in runs.items()
    ]


def markdown_table(rows: Sequence[SplitRow], title: str) -> str:
    """The rows as a Markdown table under `title`."""
    lines = [
        title,
        "",
        "| impl | split | calls | out vs truth | state vs truth | out vs unsplit | state vs unsplit "
        "| out max abs vs unsplit | bit-identical | s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.impl} | {r.split} | {r.calls} | {r.out_vs_truth:.3g} | {r.state_vs_truth:.3g} "
            f"| {r.out_vs_unsplit:.3g} | {r.state_vs_unsplit:.3g} | {r.max_abs_vs_unsplit:.3g} "
            f"| {'yes' if r.identical else 'no'} | {r.seconds:.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[SplitRow], title: str, path: Path) -> None:
    """Two panels, the output and the final state: the nRMSE against the truth (solid) and against the
    unsplit prefill (dashed) per piece size, one colour per implementation; a zero (bit-identical) is
    drawn as a hollow marker on the dotted floor line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = list(dict.fromkeys(r.split for r in rows))
    impls = list(dict.fromkeys(r.impl for r in rows))
    x = np.arange(len(splits))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, result in zip(axes, ("out", "state")):
        values = [
            v for r in rows for v in (getattr(r, f"{result}_vs_truth"), getattr(r, f"{result}_vs_unsplit"))
        ]
        floor = min((v for v in values if v > 0), default=1e-8) / 10
        ax.axhline(floor, color="grey", linestyle=":", linewidth=1, label="0 (bit-identical to unsplit)")
        for impl, colour in zip(impls, colours):
            mine = {r.split: r for r in rows if r.impl == impl}
            truth = [getattr(mine[s], f"{result}_vs_truth") for s in splits]
            unsplit = [getattr(mine[s], f"{result}_vs_unsplit") for s in splits]
            ax.plot(x, [max(v, floor) for v in truth], "o-", color=colour, label=f"{impl}: vs truth")
            ax.plot(x, [max(v, floor) for v in unsplit], "--", color=colour, label=f"{impl}: vs unsplit")
            for xi, v in zip(x, unsplit):
                ax.plot(xi, max(v, floor), "s", color=colour, fillstyle="none" if v == 0 else "full")
        ax.set_yscale("log")
        ax.set_xticks(x, splits)
        ax.set_xlabel("prefill piece size (tokens)")
        ax.set_ylabel(f"nRMSE of {'out' if result == 'out' else 'the final recurrent state'}")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.split_curve", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--preset", default="kimi-linear-48b-a3b", choices=sorted(PRESETS))
    parser.add_argument("--weights", default="synthetic", choices=sorted(WEIGHTS_KINDS))
    parser.add_argument("--tokens", type=int, default=1024, help="the sequence's length (default 1024)")
    parser.add_argument("--pieces", type=int, nargs="+", default=[64, 128, 256, 512], help="piece sizes")
    parser.add_argument("--dtype", default="bf16", choices=list(fmt.DTYPES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--impl", action="append", help="an adapter (as `conformance run --impl`; default: kda_impl); repeat"
    )
    parser.add_argument(
        "--impl-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the --impl that has it",
    )
    parser.add_argument("--out", default="reports/split-curve", help="folder for the table and the plot")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.tokens < 2:
        raise ValueError(f"--tokens must be >= 2 (a split needs two pieces), got {args.tokens}")
    too_large = [p for p in args.pieces if not 1 <= p < args.tokens]
    if too_large:
        raise ValueError(f"--pieces {too_large}: each must be >= 1 and below --tokens {args.tokens}")
    options = parse_option_pairs(args.impl_option)
    prefer_fast_cpu_compile()  # before JAX starts, as `python -m conformance` does
    enable_compile_cache()
    impls = args.impl or ["kda_impl"]
    accepted = {impl: set(load_adapter_class(impl).OPTIONS) for impl in impls}
    unused = sorted(set(options) - set().union(*accepted.values()))
    if unused:
        raise ValueError(f"--impl-option {unused}: no --impl {impls} has such an option")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    title = (
        f"{args.preset} ({args.weights} weights, seed {args.seed}), {args.dtype}, one sequence of "
        f"{args.tokens} tokens"
    )
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, disable=args.no_progress) as progress:
        task = progress.add_task(
            "the case and its float64 truth", total=1 + len(impls) * (1 + len(set(args.pieces)))
        )
        dumps = case_set(args.preset, args.weights, args.tokens, args.dtype, args.seed)
        progress.advance(task)
        rows = []
        for impl in impls:
            rows += split_rows(
                dumps,
                impl,
                {k: v for k, v in options.items() if k in accepted[impl]},
                args.dtype,
                args.pieces,
                progress,
                task,
            )
    fsspec.filesystem("memory").rm(dumps.url.removeprefix("memory://"), recursive=True)
    table = markdown_table(rows, f"Split curve: {title}")
    (out / TABLE_FILE).write_text(table)
    print(table)
    try:
        plot(rows, title, out / PLOT_FILE)
        print(f"wrote {out / TABLE_FILE} and {out / PLOT_FILE}")
    except ImportError:
        print(f"wrote {out / TABLE_FILE} (no plot: matplotlib is not installed; the png extra installs it)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
