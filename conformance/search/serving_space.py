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

from conformance.checks.serving_scenarios import Event, Forward, Scenario, alloc, checked_scenario, free

POOL_SIZES = (2, 4, 8)  # a few pool shapes: the layer compiles once per pool size and bucket
MAX_ACTIONS = 12
MAX_PADDING = 3
MAX_ARRIVALS = 4  # requests arriving together


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
    """The scenario a scheduler with a pool of `num_slots` slots runs for `actions` (module docstring)."""
    events: list[Event] = []
    prompts: dict[str, int] = {}  # requests holding a slot: tokens of their prompt still to prefill
    for action in actions:
        kind = action[0]
        if kind == "arrive":
            for prompt in action[1][: num_slots - len(prompts)]:
                name = f"q{len([e for e in events if e.alloc is not None])}"
                events += alloc(name)
                prompts[name] = prompt
        elif kind == "finish":
            running = [name for name, left in prompts.items() if left == 0]
            if running:
                name = running[action[1] % len(running)]
                events += free(name)
                del prompts[name]
        elif kind == "step":
            forward = _step(prompts, chunk=action[1], mix=action[2], padding_rows=action[3], every=action[4])
            if forward is not None:
                events.append(Event(forward=forward))
    return checked_scenario(Scenario("searched", num_slots, tuple(events)))


def _step(prompts: dict[str, int], chunk: int, mix: bool, padding_rows: int, every: bool) -> Forward | None:
    """The next forward: a chunk of the oldest unfinished prefill, or of every one with `every` (beside
    the running requests' next token when `mix`), else a decode of the running requests; None with
    nothing to run. Updates `prompts`."""
    running = [name for name, left in prompts.items() if left == 0]
    waiting = [name for name, left in prompts.items() if left > 0]
    if waiting:
        chunks = [(name, min(chunk, prompts[name])) for name in (waiting if every else waiting[:1])]
        for name, tokens in chunks:
            prompts[name] -= tokens
        requests = chunks + ([(other, 1) for other in running] if mix else [])
        return Forward("extend", tuple(requests), padding_rows)
    if running:
        return Forward("decode", tuple((name, 1) for name in running), padding_rows)
    return None
