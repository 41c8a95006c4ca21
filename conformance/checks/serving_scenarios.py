"""Serving scenarios: schedules of requests as a scheduler packs them, and the fixed ones every run checks.

A scenario is a pool size and a list of events, each one of
- `{"alloc": NAME}`: a new request NAME takes a free slot;
- `{"free": NAME}`: request NAME finished; its slot goes back to the pool;
- `{"forward": {"mode": "extend" | "decode", "requests": [[NAME, TOKENS], ...], "padding_rows": P}}`:
  one forward of the batch: each request's next TOKENS tokens, in this order, then P padding rows.
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

MODES = ("extend", "decode")
# The fixed scenarios' pool: one pool shape for all of them, so that the layer compiles once per bucket.
FIXED_SLOTS = 8
FIXED_SET = "fixed"


@dataclasses.dataclass(frozen=True)
class Forward:
    """One scheduled batch: (request, tokens) in batch order, then `padding_rows` rows of no request."""

    mode: str
    requests: tuple[tuple[str, int], ...]
    padding_rows: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "requests": [list(r) for r in self.requests],
            "padding_rows": self.padding_rows,
        }


@dataclasses.dataclass(frozen=True)
class Event:
    """One of: a request allocated (`alloc`), freed (`free`), or a forward."""

    alloc: str | None = None
    free: str | None = None
    forward: Forward | None = None

    def as_dict(self) -> dict[str, Any]:
        if self.forward is not None:
            return {"forward": self.forward.as_dict()}
        return {"alloc": self.alloc} if self.alloc is not None else {"free": self.free}


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    num_slots: int
    events: tuple[Event, ...]
    same_as: str | None = None

    @property
    def request_tokens(self) -> dict[str, int]:
        """Each request's tokens over the whole scenario, in the order the requests are allocated."""
        tokens = {event.alloc: 0 for event in self.events if event.alloc is not None}
        for event in self.events:
            for name, n in event.forward.requests if event.forward else ():
                tokens[name] += n
        return tokens

    @property
    def forwards(self) -> list[Forward]:
        return [event.forward for event in self.events if event.forward is not None]

    def as_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "num_slots": self.num_slots}
        if self.same_as:
            data["same_as"] = self.same_as
        data["events"] = [event.as_dict() for event in self.events]
        return data


def alloc(*names: str) -> list[Event]:
    return [Event(alloc=name) for name in names]


def free(*names: str) -> list[Event]:
    return [Event(free=name) for name in names]


def extend(*requests: tuple[str, int], padding_rows: int = 0) -> Event:
    return Event(forward=Forward("extend", tuple(requests), padding_rows))


def decode(*names: str, padding_rows: int = 0) -> Event:
    return Event(forward=Forward("decode", tuple((name, 1) for name in names), padding_rows))


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
    same_as = {"permuted-slots": "mixed-extend"}
    return [
        checked_scenario(Scenario(name, FIXED_SLOTS, tuple(evs), same_as.get(name)))
        for name, evs in events.items()
    ]


# ---------------------------------------------------------------------------------------- checking


def checked_scenario(scenario: Scenario) -> Scenario:
    """`scenario` if it is a schedule a pool can run; a ValueError naming the scenario, the event and
    the value at fault otherwise."""
    where = f"scenario {scenario.name!r}"
    if not scenario.name or any(c.isspace() for c in scenario.name):
        raise ValueError(f"scenario name {scenario.name!r} must be non-empty without spaces")
    if not isinstance(scenario.num_slots, int) or scenario.num_slots < 1:
        raise ValueError(f"{where}: num_slots must be a positive integer, got {scenario.num_slots!r}")
    live: set[str] = set()
    seen: set[str] = set()
    for index, event in enumerate(scenario.events):
        at = f"{where}, event {index}"
        if event.alloc is not None:
            if event.alloc in seen:
                raise ValueError(f"{at}: request {event.alloc!r} is allocated twice")
            if len(live) == scenario.num_slots:
                raise ValueError(f"{at}: alloc {event.alloc!r} with all {scenario.num_slots} slots in use")
            live.add(event.alloc)
            seen.add(event.alloc)
        elif event.free is not None:
            if event.free not in live:
                raise ValueError(f"{at}: free {event.free!r}, which holds no slot")
            live.remove(event.free)
        else:
            _check_forward(event.forward, live, at)
    return scenario


def _check_forward(forward: Forward | None, live: set[str], at: str) -> None:
    if forward is None:
        raise ValueError(f"{at}: an event is one of alloc, free, forward")
    if forward.mode not in MODES:
        raise ValueError(f"{at}: mode must be one of {list(MODES)}, got {forward.mode!r}")
    names = [name for name, _ in forward.requests]
    if not names:
        raise ValueError(f"{at}: a forward needs at least one request")
    if len(set(names)) != len(names):
        raise ValueError(f"{at}: a request appears twice in one batch: {names}")
    for name, tokens in forward.requests:
        if name not in live:
            raise ValueError(f"{at}: request {name!r} holds no slot (alloc it first)")
        if not isinstance(tokens, int) or tokens < 1 or (forward.mode == "decode" and tokens != 1):
            raise ValueError(f"{at}: request {name!r} has {tokens!r} tokens; extend needs >= 1, decode 1")
    if not isinstance(forward.padding_rows, int) or forward.padding_rows < 0:
        raise ValueError(f"{at}: padding_rows must be an integer >= 0, got {forward.padding_rows!r}")


# ----------------------------------------------------------------------------------------- files


def scenario_from_dict(data: dict[str, Any]) -> Scenario:
    """A scenario from its file form (`Scenario.as_dict`), checked."""
    try:
        events = []
        for event in data["events"]:
            if "forward" in event:
                f = event["forward"]
                requests = tuple((str(name), tokens) for name, tokens in f["requests"])
                events.append(Event(forward=Forward(f["mode"], requests, f.get("padding_rows", 0))))
            elif "alloc" in event:
                events.append(Event(alloc=str(event["alloc"])))
            else:
                events.append(Event(free=str(event["free"])))
        scenario = Scenario(str(data["name"]), data["num_slots"], tuple(events), data.get("same_as"))
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(
            f"scenario {data.get('name', '?')!r}: malformed ({type(err).__name__}: {err})"
        ) from None
    return checked_scenario(scenario)


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
