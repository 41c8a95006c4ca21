"""The conformance suite: a parametrized pytest suite, one test per case × dtype × check.

Run it through `kda-conform run` (`python -m conformance run`), or inside any pytest run with the
plugin: `pytest --kda-impl NAME_OR_MODULE:ATTR [--kda-dumps DIR_OR_URL] [-k T65]`. Either way its
tests are `conformance/suite/test_conformance.py::test_check[<case>-<dtype>-<check>]`.
"""

from pathlib import Path

SUITE_FILE = Path(__file__).resolve().with_name("test_conformance.py")
SUITE_ROOT = SUITE_FILE.parents[2]  # the folder the package lies in: the test ids are relative to it
SUITE_NODE_PATH = SUITE_FILE.relative_to(SUITE_ROOT).as_posix()
