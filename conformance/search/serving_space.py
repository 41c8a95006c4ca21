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

With the serving protocol's optional verbs (those the adapter provides, `VERB_ACTIONS`), five more:
a snapshot (a request's states copied into a new snapshot slot, at the boundary its prefill's chunks
end at), a hit (a new request copies a snapshot and continues with a prompt of its own), a verify (the
started requests verify k draft tokens each and accept a drawn number of them, 0..k), a handoff
(every request exported into a fresh pool) and a poison (a free slot filled with NaN or 1e30 and freed
again: memory no request may read and no forward may write). Snapshots hold their slot and are never
scheduled.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from hypothesis import strategies as st

from conformance.checks.serving_events import (
    POISONS,
    Accept,
    Alloc,
    Copy,
    Forward,
    Free,
    Handoff,
    Poison,
    ScheduleBook,
    Verify,
)
from conformance.checks.serving_scenarios import Scenario

POOL_SIZES = (2, 4, 8)  # a few pool shapes: the layer compiles once per pool size and bucket
MAX_ACTIONS = 12
MAX_PADDING = 3
MAX_ARRIVALS = 4  # requests arriving together
MAX_DRAFTS = 4
SEARCHED = "searched"  # the name of every searched scenario
#: The optional serving verb each action of the verbs needs.
VERB_ACTIONS = {"snapshot": "serving_copy", "hit": "serving_copy", "verify": "serving_accept",
                "handoff": "serving_load", "poison": "serving_load"}  # fmt: skip


def schedule_strategy(max_tokens: int, verbs: Collection[str] = ()) -> st.SearchStrategy[Scenario]:
    """Scenarios of at most `MAX_ACTIONS` scheduler actions and prompts of at most `max_tokens` tokens,
    with the actions of the optional verbs among `verbs` (`VERB_ACTIONS`)."""
    prompts = st.lists(st.integers(1, max_tokens), min_size=1, max_size=MAX_ARRIVALS)
    arrive = st.tuples(st.just("arrive"), prompts)
    step = st.tuples(
        st.just("step"), st.integers(1, max_tokens), st.booleans(), st.integers(0, MAX_PADDING), st.booleans()
    )
    finish = st.tuples(st.just("finish"), st.integers(0, 7))
    choices = {
        "snapshot": st.tuples(st.just("snapshot"), st.integers(0, 7)),
        "hit": st.tuples(st.just("hit"), st.integers(0, 7), st.integers(1, max_tokens)),
        "verify": st.tuples(
            st.just("verify"),
            st.integers(1, MAX_DRAFTS),
            st.integers(0, MAX_DRAFTS),
            st.integers(0, MAX_PADDING),
        ),
        "handoff": st.tuples(st.just("handoff")),
        "poison": st.tuples(st.just("poison"), st.sampled_from(sorted(POISONS))),
    }
    drawn = [strategy for action, strategy in choices.items() if VERB_ACTIONS[action] in verbs]
    # A verb's action needs a request that has started: steps are drawn as often as all of them.
    steps = [step] * max(1, len(drawn))
    actions = st.lists(st.one_of(arrive, *steps, finish, *drawn), min_size=1, max_size=MAX_ACTIONS)
    return st.builds(schedule, st.sampled_from(POOL_SIZES), actions)


def schedule(num_slots: int, actions: list[tuple[Any, ...]]) -> Scenario:
    """The scenario a scheduler with a pool of `num_slots` slots runs for `actions` (module docstring),
    each event played on the scenario's `ScheduleBook` as it is decided (the ValueError of a file's
    event when one is impossible)."""
    book = ScheduleBook(SEARCHED, num_slots)
    prompts: dict[str, int] = {}  # each request's prompt tokens (a hit's: its snapshot's and its own)
    snapshots: list[str] = []  # the snapshot requests, never scheduled
    for action in actions:
        kind = action[0]
        running = [name for name, tokens in _left(book, prompts).items() if tokens <= 0]
        started = [name for name in _left(book, prompts) if book.processed[name]]
        if kind == "arrive":
            for prompt in action[1][: book.free_slots]:
                name = f"q{len(book.processed)}"
                prompts[name] = prompt
                book.play(Alloc(name))
        elif kind == "finish" and running:
            book.play(Free(running[action[1] % len(running)]))
        elif kind == "step":
            forward = _step(
                book, prompts, chunk=action[1], mix=action[2], padding_rows=action[3], every=action[4]
            )
            if forward is not None:
                book.play(forward)
        elif kind == "snapshot" and book.free_slots:
            if started:
                snapshot = f"s{len(book.processed)}"
                book.play_all([Alloc(snapshot), Copy(started[action[1] % len(started)], snapshot)])
                snapshots.append(snapshot)
        elif kind == "hit" and book.free_slots:
            held = [name for name in snapshots if name in book.holding]
            if held:
                source, name = held[action[1] % len(held)], f"q{len(book.processed)}"
                book.play_all([Alloc(name), Copy(source, name)])
                prompts[name] = book.processed[source] + action[2]
        elif kind == "verify" and started:
            drafts, accepted, padding_rows = action[1:]
            book.play(Verify(tuple((name, drafts) for name in started), padding_rows))
            book.play_all(Accept(name, (accepted + i) % (drafts + 1)) for i, name in enumerate(started))
        elif kind == "handoff" and book.holding:
            book.play(Handoff(tuple(reversed(book.holding))))
        elif kind == "poison" and book.free_slots:
            name = f"p{len(book.processed)}"  # the next free slot, poisoned and free again
            book.play_all([Alloc(name), Poison(name, action[1]), Free(name)])
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
    """The tokens of each slot-holding request's prompt still to prefill (<= 0: it is running); a
    snapshot is none of them."""
    return {name: prompts[name] - book.processed[name] for name in book.holding if name in prompts}
