"""The README's serving example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_serving_example_runs():
    text = README.read_text()
    section = text[text.index("## Using kda_impl in a serving stack") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    assert namespace["out"].shape[1] == namespace["config"].hidden_size
