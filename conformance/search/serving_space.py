"""The serving search's space: schedules drawn as a list of scheduler actions (hypothesis), read into a
`Scenario` that any pool can run.

The actions are what a scheduler decides, one at a time: requests arrive with prompts of n tokens each
(each takes a free slot, or is turned away when the pool is full), a step runs (the next chunk, of at
most `chunk` tokens, of the oldest unfinished prefill or of every one, mixed with the running
requests' next token or not, with some padding rows; a step without a prefill to run decodes the
running requests), a running request finishes (its slot is freed, for the next arrival to reuse).
hypothesis shrinks such a list toward fewer actions, smaller prompts and chunks, no mixing, no
padding and the smallest pool, so a failing schedule shrinks to the fewest requests, steps and tokens
that still fail.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from conformance.checks.serving_events import Alloc, Forward, Free, ScheduleBook
from conformance.checks.serving_scenarios import Scenario

POOL_SIZES = (2, 4, 8)  # a few pool shapes: the layer compiles once per pool size and bucket
MAX_ACTIONS = 12
MAX_PADDING = 3
MAX_ARRIVALS = 4  # requests arriving together
SEARCHED = "searched"  # the name of every searched scenario


def schedule_strategy(max_tokens: int) -> st.SearchStrategy[Scenario]:
    """Scenarios of at most `MAX_ACTIONS` scheduler actions and prompts of at most `max_tokens` tokens."""
    prompts = st.lists(st.integers(1, max_tokens), min_size=1, max_size=MAX_ARRIVALS)
    arrive = st.tuples(st.just("arrive"), prompts)
    step = st.tuples(
        st.just("step"), st.integers(1, max_tokens), st.booleans(), st.integers(0, MAX_PADDING), st.booleans()
    )
    finish = st.tuples(st.just("finish"), st.integers(0, 7))
    actions = st.lists(st.one_of(arrive, step, finish), min_size=1, max_size=MAX_ACTIONS)
    return st.builds(schedule, st.sampled_from(POOL_SIZES), actions)


def schedule(num_slots: int, actions: list[tuple[Any, ...]]) -> Scenario:
    """The scenario a scheduler with a pool of `num_slots` slots runs for `actions` (module docstring),
    each event played on the scenario's `ScheduleBook` as it is decided (the ValueError of a file's
    event when one is impossible)."""
    book = ScheduleBook(SEARCHED, num_slots)
    prompts: dict[str, int] = {}  # each request's prompt tokens
    for action in actions:
        kind = action[0]
        if kind == "arrive":
            for prompt in action[1][: book.free_slots]:
                name = f"q{len(book.processed)}"
                prompts[name] = prompt
                book.play(Alloc(name))
        elif kind == "finish":
            running = [name for name, tokens in _left(book, prompts).items() if tokens <= 0]
            if running:
                book.play(Free(running[action[1] % len(running)]))
        elif kind == "step":
            forward = _step(
                book, prompts, chunk=action[1], mix=action[2], padding_rows=action[3], every=action[4]
            )
            if forward is not None:
                book.play(forward)
    return Scenario(SEARCHED, num_slots, tuple(book.events))


def _step(
    book: ScheduleBook, prompts: dict[str, int], chunk: int, mix: bool, padding_rows: int, every: bool
) -> Forward | None:
    """The next forward: a chunk of the oldest unfinished prefill, or of every one with `every` (beside
    the running requests' next token when `mix`), else a decode of the running requests; None with
    nothing to run."""
    left = _left(book, prompts)
    running = [name for name, tokens in left.items() if tokens <= 0]
    waiting = [name for name, tokens in left.items() if tokens > 0]
    if waiting:
        chunks = [(name, min(chunk, left[name])) for name in (waiting if every else waiting[:1])]
        requests = chunks + ([(other, 1) for other in running] if mix else [])
        return Forward("extend", tuple(requests), padding_rows)
    if running:
        return Forward("decode", tuple((name, 1) for name in running), padding_rows)
    return None


def _left(book: ScheduleBook, prompts: dict[str, int]) -> dict[str, int]:
    """The tokens of each slot-holding request's prompt still to prefill (<= 0: it is running)."""
    return {name: prompts[name] - book.processed[name] for name in book.holding}
