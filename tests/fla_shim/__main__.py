"""`python -m tests.fla_shim --fla PATH [--kernel naive|pallas] [--report FILE] [--select FILE]
[PYTEST_ARGS...]`: fla's tests/ops/test_kda.py of the fla checkout PATH on kda_impl's kernels (see
`tests.fla_shim.plugin`), on CPU, Pallas in interpret mode; `--select` runs only the tests a file names.
Exit status: pytest's (1 when a test failed or is unsupported)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fla_shim", description=__doc__)
    parser.add_argument("--fla", required=True, type=Path, help="an fla checkout (tests/ops/test_kda.py)")
    parser.add_argument("--kernel", default="naive", choices=("naive", "pallas"))
    parser.add_argument("--report", default=None, help="write the summary as JSON to this file")
    parser.add_argument(
        "--select", default=None, type=Path, help="a file of test names (one a line, as pytest names them)"
    )
    args, pytest_args = parser.parse_known_args(argv)
    test_file = args.fla / "tests" / "ops" / "test_kda.py"
    if not test_file.is_file():
        parser.error(f"--fla {args.fla}: no tests/ops/test_kda.py there")
    os.environ.pop("FLA_CI_ENV", None)  # fla's assert_close would only warn on some failures under it
    options = ["--shim-kernel", args.kernel] + (["--shim-report", args.report] if args.report else [])
    plugins = ["-p", "tests.fla_shim.plugin", "-p", "no:cacheprovider", "-p", "no:xdist"]
    # fla's tests/conftest.py is not loaded: its autouse fixture guards torch.empty for fla's own kernels
    # and synchronises fla's device, which fla.utils takes to be CUDA even on a host without one.
    config = ["-c", os.devnull, "--rootdir", str(args.fla), "--noconftest"]
    targets = [str(test_file)]
    if args.select is not None:
        names = [line.strip() for line in args.select.read_text().splitlines() if line.strip()]
        targets = [f"{test_file}::{name}" for name in names]
    return pytest.main([*targets, *plugins, *options, *config, "-q", *pytest_args])


if __name__ == "__main__":
    sys.exit(main())
