"""Serving scenarios: schedules of requests as a scheduler packs them, and the fixed ones every run checks.

A scenario is a pool size and a list of events (conformance/checks/serving_events.py), each one of
- `{"alloc": NAME}`: a new request NAME takes a free slot;
- `{"free": NAME}`: request NAME finished; its slot goes back to the pool;
- `{"forward": {"mode": "extend" | "decode", "requests": [[NAME, TOKENS], ...], "padding_rows": P}}`:
  one forward of the batch: each request's next TOKENS tokens, in this order, then P padding rows;
- `{"verify": {"requests": [[NAME, K], ...], "padding_rows": P}}`: a verify forward of K draft tokens
  each, and `{"accept": [NAME, N]}`: NAME keeps the states after the first N of them;
- `{"copy": [SRC, DST]}`: new request DST starts from SRC's states (a prefix cache hit);
- `{"handoff": [NAME, ...]}`: every request exported, a fresh pool opened, each imported there;
- `{"poison": [NAME, "nan" | "1e30"]}`: new request NAME's slot filled with the value.
The last five need the serving protocol's optional verbs (`Scenario.calls`).
`same_as` names another scenario of the same file whose every forward gives the same outputs to the bit
(the same schedule on other slots). A scenario file (`conformance run --scenarios FILE`, written by
`conformance search --space serving`) is JSON or TOML: `{"scenarios": [{"name": ..., "num_slots": ...,
"events": [...]}, ...]}`. docs/serving.md says what each fixed scenario would have caught.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from conformance.checks.kinds import SERVING_CALLS, SERVING_SUFFIXES
from conformance.checks.serving_events import (
    EVENT_CALLS,
    Accept,
    Copy,
    Event,
    Forward,
    Handoff,
    Poison,
    ScheduleBook,
    Verify,
    alloc,
    decode,
    event_from_dict,
    extend,
    free,
    verify,
)

# The fixed scenarios' pool: one pool shape for all of them, so that the layer compiles once per bucket.
FIXED_SLOTS = 8
FIXED_SET = "fixed"
# The fixed scenarios' snapshot interval (sgl-jax's `recurrent_track_interval`, a page) and draft tokens.
SNAPSHOT_INTERVAL = 64
DRAFT_TOKENS = 4


@dataclasses.dataclass(frozen=True)
class Scenario:
    """`events` played on a pool of `num_slots` slots; `same_as` another scenario that must give the same
    outputs. A scenario exists only as a schedule a pool can run: building one plays its events on a
    `ScheduleBook` (a ValueError naming the scenario, the event's index and the value at fault)."""

    name: str
    num_slots: int
    events: tuple[Event, ...]
    same_as: str | None = None

    def __post_init__(self) -> None:
        if not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"scenario name {self.name!r} must be non-empty without spaces")
        suffix = next((s for s in SERVING_SUFFIXES if self.name.endswith(s)), None)
        if suffix is not None:
            raise ValueError(
                f"scenario name {self.name!r} must not end in {suffix!r}: its checks' names would read as "
                "another scenario's"
            )
        self.book()

    def book(self) -> ScheduleBook:
        """The bookkeeping of every event played."""
        return ScheduleBook(self.name, self.num_slots).play_all(self.events)

    @property
    def request_tokens(self) -> dict[str, int]:
        """Each request's tokens over the whole scenario, in the order the requests are allocated."""
        return self.book().processed

    @property
    def origin(self) -> dict[str, tuple[str, int]]:
        """Each copied request's source and how many of the source's tokens it starts with."""
        return self.book().origin

    @property
    def checkpoints(self) -> tuple[str, ...]:
        """The requests that only hold a copy of another's states (a prefix cache's snapshot at a
        boundary): copied into, they process no token of their own. Their final states are the
        `-checkpoint` checks'; every other request's are `-state`'s and `-conv`'s."""
        book = self.book()
        return tuple(name for name, (_, count) in book.origin.items() if book.processed[name] == count)

    @property
    def forwards(self) -> list[Forward | Verify]:
        return [event for event in self.events if isinstance(event, (Forward, Verify))]

    @property
    def calls(self) -> tuple[str, ...]:
        """The adapter calls the scenario makes: the serving protocol's, and the optional verbs its
        events need (`EVENT_CALLS`)."""
        optional = (call for event in self.events for call in EVENT_CALLS.get(type(event), ()))
        return (*SERVING_CALLS, *dict.fromkeys(optional))

    @property
    def poisons(self) -> bool:
        """Whether it poisons a slot (its `-poisoned` check then applies)."""
        return any(isinstance(event, Poison) for event in self.events)

    def as_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "num_slots": self.num_slots}
        if self.same_as:
            data["same_as"] = self.same_as
        data["events"] = [event.as_dict() for event in self.events]
        return data


# ------------------------------------------------------------------------------------------- fixed


def _mixed_extend(alloc_order: Sequence[str]) -> list[Event]:
    """Three running requests (conv and recurrent states non-zero), then one EXTEND of fresh prefills of
    63, 1, 64, 65 and 100 tokens with the running requests' next token between them, then a decode."""
    return [
        *alloc(*alloc_order),
        extend(("a", 5), ("b", 9), ("c", 17)),
        extend(("p63", 63), ("a", 1), ("b", 1), ("p1", 1), ("p64", 64), ("c", 1), ("p65", 65), ("p100", 100)),
        decode("p63", "a", "b", "p1", "p64", "c", "p65", "p100"),
    ]


_MIXED_REQUESTS = ("a", "b", "c", "p63", "p1", "p64", "p65", "p100")


def fixed_scenarios() -> list[Scenario]:
    """The scenarios every `conformance run` checks (docs/serving.md)."""
    filled = [f"r{i}" for i in range(FIXED_SLOTS)]
    events = {
        "mixed-extend": _mixed_extend(_MIXED_REQUESTS),
        "one-token-extend": [
            *alloc("a", "b", "z"),
            extend(("a", 4), ("b", 7), ("z", 3)),
            *alloc("c", "d"),
            extend(("a", 1), ("c", 1), ("b", 1), ("d", 1)),
            decode("a", "b", "c", "d"),
        ],
        "recycled-slot": [
            *alloc(*filled),
            extend(*((name, 5 + i) for i, name in enumerate(filled))),
            *free("r3", "r5"),
            *alloc("n6", "n1"),
            extend(("n6", 6), ("r0", 1), ("n1", 1)),
            decode("n6", "n1", "r0", "r7"),
        ],
        "one-token-prompt": [
            *alloc("z", "a", "b"),
            extend(("z", 5)),
            extend(("a", 1), ("b", 9)),
            decode("a", "b"),
            decode("a", "b"),
        ],
        "chunked-interleaved": [
            *alloc("a", "b"),
            extend(("a", 6), ("b", 4)),
            *alloc("c"),
            extend(("c", 40), ("a", 1), ("b", 1)),
            decode("a", "b"),
            extend(("c", 30), ("a", 1)),
            decode("a", "b", "c"),
            extend(("b", 1), ("c", 20)),
            decode("c"),
        ],
        "permuted-slots": _mixed_extend(tuple(reversed(_MIXED_REQUESTS))),
        "padding-rows": [
            *alloc(*filled),
            extend(*((name, 3 + i) for i, name in enumerate(filled))),
            extend(("r0", 2), ("r1", 1), padding_rows=5),
            decode("r2", "r3", padding_rows=3),
        ],
    }
    events.update(_optional_verb_scenarios())
    same_as = {"permuted-slots": "mixed-extend"}
    return [Scenario(name, FIXED_SLOTS, tuple(evs), same_as.get(name)) for name, evs in events.items()]


def _optional_verb_scenarios() -> dict[str, list[Event]]:
    """The fixed scenarios of the serving protocol's optional verbs (docs/serving.md), with snapshots at
    every `SNAPSHOT_INTERVAL` tokens and the prefill split there. Three scenarios for the five features:
    each scenario opens its pool and compiles its own forwards, so each costs the cold run most."""
    poisons = [f"x{i}" for i in range(FIXED_SLOTS)]
    drafted = [f"v{i}" for i in range(5)]
    i = SNAPSHOT_INTERVAL
    return {
        "prefix-hit": [
            *alloc("p", f"s{i}", f"s{2 * i}"),
            extend(("p", i)),
            Copy("p", f"s{i}"),
            extend(("p", i)),
            Copy("p", f"s{2 * i}"),
            extend(("p", 2)),  # a prompt of 2i + 2 tokens: its last snapshot is at 2i, not 2i + 2
            decode("p"),
            *free("p"),
            *alloc("q"),
            Copy(f"s{2 * i}", "q"),  # an unaligned hit (the shared prefix ends after 2i): from 2i on
            extend(("q", 5)),
            *alloc("r"),
            Copy(f"s{i}", "r"),  # a page-aligned hit of i tokens, its prefill beside q's decode
            extend(("r", 40), ("q", 1)),
            decode("r", "q"),
        ],
        "verify-handoff": [
            *alloc(*drafted, "h"),
            extend(*((name, 3 + 7 * n) for n, name in enumerate(drafted)), ("h", 37)),
            verify(*((name, DRAFT_TOKENS) for name in drafted), padding_rows=2),
            *(Accept(name, n) for n, name in enumerate(drafted)),  # 0 .. k accepted
            decode(*drafted),
            extend(("h", 20)),  # a prefill's second chunk
            verify(("v0", 3), ("v3", 2), ("v2", 1)),
            Accept("v3", 0),
            Accept("v0", 3),
            Accept("v2", 1),
            Handoff(("h", *reversed(drafted))),  # to a fresh pool, in another slot order
            decode("h", *drafted),
            decode("h", "v1"),
        ],
        "poisoned-slots": [
            *alloc(*poisons),
            *(Poison(name, "1e30" if n % 2 else "nan") for n, name in enumerate(poisons)),  # the last: 1e30
            *free(*reversed(poisons)),  # a last-in-first-out pool hands the first slots out again
            *alloc("a", "b"),
            extend(("a", 9), ("b", 5), padding_rows=3),
            decode("a", "b", padding_rows=2),
            *alloc("c"),
            extend(("c", 4), ("a", 1), padding_rows=1),
            verify(("a", 2), ("c", 2), padding_rows=1),
            Accept("a", 1),
            Accept("c", 2),
            decode("a", "b", "c", padding_rows=1),
        ],
    }


# ----------------------------------------------------------------------------------------- files


def scenario_from_dict(data: dict[str, Any]) -> Scenario:
    """A scenario from its file form (`Scenario.as_dict`), checked; a ValueError naming the scenario (and
    the event's index) and what is wrong."""
    where = f"scenario {data.get('name', '?')!r}"
    try:
        name, num_slots, items = str(data["name"]), data["num_slots"], list(data["events"])
    except (KeyError, TypeError) as err:
        raise ValueError(f"{where}: {_malformed(err)}") from None
    events = []
    for index, item in enumerate(items):
        try:
            events.append(event_from_dict(item))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{where}, event {index}: {_malformed(err)}") from None
    return Scenario(name, num_slots, tuple(events), data.get("same_as"))


def _malformed(err: Exception) -> str:
    return f"malformed ({type(err).__name__}: {err})"


def load_scenarios(path: Path) -> list[Scenario]:
    """The scenarios of a JSON or TOML scenario file; a ValueError naming the file and what is wrong."""
    try:
        text = path.read_text()
    except OSError as err:
        raise ValueError(f"--scenarios {str(path)!r}: cannot read it ({err.strerror})") from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        scenarios = [scenario_from_dict(item) for item in data["scenarios"]]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"--scenarios {str(path)!r}: {err}") from None
    names = [scenario.name for scenario in scenarios]
    if not scenarios or len(set(names)) != len(names):
        raise ValueError(f"--scenarios {str(path)!r}: needs scenarios with distinct names, got {names}")
    for scenario in scenarios:
        if scenario.same_as is not None and scenario.same_as not in names:
            raise ValueError(
                f"--scenarios {str(path)!r}: {scenario.name!r} is same_as {scenario.same_as!r}, not in it"
            )
    return scenarios


def write_scenarios(scenarios: Sequence[Scenario], path: Path) -> None:
    """`scenarios` as a JSON scenario file that `load_scenarios` (and `conformance run --scenarios`) reads."""
    path.write_text(json.dumps({"scenarios": [s.as_dict() for s in scenarios]}, indent=1) + "\n")


def scenario_set_name(path: Path | None) -> str:
    """The first part of the serving checks' ids: `fixed`, or the scenario file's stem."""
    return FIXED_SET if path is None else path.stem.replace("-", "_") or "scenarios"
