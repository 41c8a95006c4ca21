"""An implementation's own traceback: the frames of the checker and of Python's import machinery left
out, so that what a user reads starts and ends in their code."""

from __future__ import annotations

import traceback
from collections.abc import Callable


def own_traceback(err: BaseException, hidden: Callable[[str], bool]) -> str:
    """`err`'s traceback as Python prints it, without the frames whose file name `hidden` accepts."""
    frames = [frame for frame in traceback.extract_tb(err.__traceback__) if not hidden(frame.filename)]
    lines = ["Traceback (most recent call last):\n", *traceback.format_list(frames)]
    return "".join([*lines, *traceback.format_exception_only(type(err), err)])
