"""A copy of the default tolerance policy with one edit, for the tests of the policy's validation."""

from __future__ import annotations

from pathlib import Path

from conformance.policy import DEFAULT_POLICY_FILE


def edited_policy(folder: Path, old: str, new: str) -> Path:
    """`policy.toml` in `folder`: the default policy with the first `old` replaced by `new`."""
    text = DEFAULT_POLICY_FILE.read_text()
    assert old in text, f"{old!r} is not in the default policy"
    path = folder / "policy.toml"
    path.write_text(text.replace(old, new, 1))
    return path
