"""Serving events: what a schedule does, one event at a time, and the bookkeeping they are played on.

Each event type holds its file key (`key`), its file form (`as_dict`, and `from_value` to read it
back) and one `apply`: its precondition on the schedule so far and what it changes in the schedule's
`ScheduleBook`. The file reader, the search space and the runner all play events through
`ScheduleBook.play`, so a schedule is checked by one definition whatever made it. `EVENT_TYPES` maps
each file key to its type; a new event is one class here, its entry there, and the runner's action for
it (`ScenarioDriver.act` in conformance/checks/serving_run.py).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable
from typing import Any, ClassVar, Self

MODES = ("extend", "decode")
VERIFY = "verify"  # a `Verify` event's forward mode
POISONS = {"nan": float("nan"), "1e30": 1e30}  # what a `Poison` event fills a slot's states with


@dataclasses.dataclass
class ScheduleBook:
    """A schedule's bookkeeping as its events are played on a pool of `num_slots` slots: the requests
    holding a slot, every request allocated so far with the tokens it has processed (both in the order
    they were allocated), where a copied request's first tokens come from (`origin`: the source and how
    many of its tokens), the draft tokens each request has in a verify not yet accepted (`drafts`), the
    requests whose slot was poisoned (`poisoned`), and the events played."""

    scenario: str
    num_slots: int
    holding: list[str] = dataclasses.field(default_factory=list)
    processed: dict[str, int] = dataclasses.field(default_factory=dict)
    origin: dict[str, tuple[str, int]] = dataclasses.field(default_factory=dict)
    drafts: dict[str, int] = dataclasses.field(default_factory=dict)
    poisoned: dict[str, str] = dataclasses.field(default_factory=dict)
    events: list[Event] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.num_slots, int) or self.num_slots < 1:
            raise ValueError(
                f"scenario {self.scenario!r}: num_slots must be a positive integer, got {self.num_slots!r}"
            )

    @property
    def free_slots(self) -> int:
        return self.num_slots - len(self.holding)

    def check_running(self, name: str, what: str) -> None:
        """ValueError unless request `name` holds a slot with states a forward may run on: not poisoned
        and with no verify waiting for its accept."""
        if name not in self.holding:
            raise ValueError(f"{what} {name!r}, which holds no slot (alloc it first)")
        if name in self.poisoned:
            raise ValueError(f"{what} {name!r}, whose slot is poisoned (free it)")
        if name in self.drafts:
            raise ValueError(f"{what} {name!r}, whose verify waits for its accept")

    def check_fresh(self, name: str, what: str) -> None:
        """ValueError unless request `name` holds a slot and has processed nothing yet."""
        if name not in self.holding:
            raise ValueError(f"{what} {name!r}, which holds no slot (alloc it first)")
        if self.processed[name] or name in self.poisoned or name in self.origin:
            raise ValueError(f"{what} {name!r}, which has states already (a new request's slot only)")

    def play(self, event: Event) -> None:
        """`event` applied and recorded; a ValueError naming the scenario, the event's index and the
        value at fault when its precondition fails (nothing changed then)."""
        try:
            event.apply(self)
        except ValueError as err:
            raise ValueError(f"scenario {self.scenario!r}, event {len(self.events)}: {err}") from None
        self.events.append(event)

    def play_all(self, events: Iterable[Event]) -> Self:
        for event in events:
            self.play(event)
        return self


@dataclasses.dataclass(frozen=True)
class Event(abc.ABC):
    """One thing a schedule does; its file form is `{key: value}`."""

    key: ClassVar[str]

    def as_dict(self) -> dict[str, Any]:
        return {self.key: self.value()}

    @abc.abstractmethod
    def value(self) -> Any:
        """The value of the event's file form."""

    @classmethod
    @abc.abstractmethod
    def from_value(cls, value: Any) -> Self:
        """The event of its file form's value (a KeyError, TypeError or ValueError when `value` is not
        one); whether the schedule can run it is `apply`'s to say."""

    @abc.abstractmethod
    def apply(self, book: ScheduleBook) -> None:
        """Check the event's precondition on `book` (a ValueError naming the value at fault, `book`
        unchanged), then update `book`."""


@dataclasses.dataclass(frozen=True)
class _OfRequest(Event, abc.ABC):
    """An event of one request, `name`; its file form is the name."""

    name: str

    def value(self) -> str:
        return self.name

    @classmethod
    def from_value(cls, value: Any) -> Self:
        return cls(str(value))


@dataclasses.dataclass(frozen=True)
class Alloc(_OfRequest):
    """A new request `name` takes a free slot."""

    key: ClassVar[str] = "alloc"

    def apply(self, book: ScheduleBook) -> None:
        if self.name in book.processed:
            raise ValueError(f"request {self.name!r} is allocated twice")
        if not book.free_slots:
            raise ValueError(f"alloc {self.name!r} with all {book.num_slots} slots in use")
        book.holding.append(self.name)
        book.processed[self.name] = 0


@dataclasses.dataclass(frozen=True)
class Free(_OfRequest):
    """Request `name` finished; its slot goes back to the pool."""

    key: ClassVar[str] = "free"

    def apply(self, book: ScheduleBook) -> None:
        if self.name not in book.holding:
            raise ValueError(f"free {self.name!r}, which holds no slot")
        if self.name in book.drafts:
            raise ValueError(f"free {self.name!r}, whose verify waits for its accept")
        book.holding.remove(self.name)


@dataclasses.dataclass(frozen=True)
class Forward(Event):
    """One forward of the batch: each request's next `tokens` (request, tokens) in batch order, then
    `padding_rows` rows of no request; `mode` one of `MODES`."""

    key: ClassVar[str] = "forward"
    mode: str
    requests: tuple[tuple[str, int], ...]
    padding_rows: int = 0

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.requests]

    def value(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "requests": [list(r) for r in self.requests],
            "padding_rows": self.padding_rows,
        }

    @classmethod
    def from_value(cls, value: Any) -> Self:
        requests = tuple((str(name), tokens) for name, tokens in value["requests"])
        return cls(value["mode"], requests, value.get("padding_rows", 0))

    def apply(self, book: ScheduleBook) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {self.mode!r}")
        names = self.names
        if not names:
            raise ValueError("a forward needs at least one request")
        if len(set(names)) != len(names):
            raise ValueError(f"a request appears twice in one batch: {names}")
        for name, tokens in self.requests:
            if name not in book.holding:
                raise ValueError(f"request {name!r} holds no slot (alloc it first)")
            book.check_running(name, "a forward of request")
            if not isinstance(tokens, int) or tokens < 1 or (self.mode == "decode" and tokens != 1):
                raise ValueError(f"request {name!r} has {tokens!r} tokens; extend needs >= 1, decode 1")
        if not isinstance(self.padding_rows, int) or self.padding_rows < 0:
            raise ValueError(f"padding_rows must be an integer >= 0, got {self.padding_rows!r}")
        for name, tokens in self.requests:
            book.processed[name] += tokens


@dataclasses.dataclass(frozen=True)
class Verify(Event):
    """A verify forward (mode "verify"): each request's next `k` draft tokens, `(request, k)` in batch
    order, from its slot's states, then `padding_rows` rows; the slots stay as they were until each
    request's `Accept`. Its file form is a forward's without the mode."""

    key: ClassVar[str] = "verify"
    mode: ClassVar[str] = VERIFY
    requests: tuple[tuple[str, int], ...]
    padding_rows: int = 0

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.requests]

    def value(self) -> dict[str, Any]:
        return {"requests": [list(r) for r in self.requests], "padding_rows": self.padding_rows}

    @classmethod
    def from_value(cls, value: Any) -> Self:
        requests = tuple((str(name), tokens) for name, tokens in value["requests"])
        return cls(requests, value.get("padding_rows", 0))

    def apply(self, book: ScheduleBook) -> None:
        names = self.names
        if not names or len(set(names)) != len(names):
            raise ValueError(f"a verify needs requests, each once: got {names}")
        for name, tokens in self.requests:
            book.check_running(name, "a verify of request")
            if not book.processed[name]:
                raise ValueError(f"a verify of request {name!r}, which has no prefill yet")
            if not isinstance(tokens, int) or tokens < 1:
                raise ValueError(f"request {name!r} has {tokens!r} draft tokens; a verify needs >= 1")
        if not isinstance(self.padding_rows, int) or self.padding_rows < 0:
            raise ValueError(f"padding_rows must be an integer >= 0, got {self.padding_rows!r}")
        book.drafts.update(self.requests)


@dataclasses.dataclass(frozen=True)
class Accept(Event):
    """Request `name` keeps the states after the first `accepted` draft tokens of its verify (0: those
    from before it); its file form is `[name, accepted]`."""

    key: ClassVar[str] = "accept"
    name: str
    accepted: int

    def value(self) -> list[Any]:
        return [self.name, self.accepted]

    @classmethod
    def from_value(cls, value: Any) -> Self:
        name, accepted = value
        return cls(str(name), accepted)

    def apply(self, book: ScheduleBook) -> None:
        if self.name not in book.drafts or self.name not in book.holding:
            raise ValueError(f"accept {self.name!r}, which has no verify waiting")
        drafted = book.drafts[self.name]
        if not isinstance(self.accepted, int) or not 0 <= self.accepted <= drafted:
            raise ValueError(f"accept {self.name!r} of {self.accepted!r} draft tokens: 0..{drafted}")
        del book.drafts[self.name]
        book.processed[self.name] += self.accepted


@dataclasses.dataclass(frozen=True)
class Copy(Event):
    """Request `dst`, new, gets `src`'s states (a prefix cache hit: the copy of a snapshot); its first
    tokens are then `src`'s so far. Its file form is `[src, dst]`."""

    key: ClassVar[str] = "copy"
    src: str
    dst: str

    def value(self) -> list[str]:
        return [self.src, self.dst]

    @classmethod
    def from_value(cls, value: Any) -> Self:
        src, dst = value
        return cls(str(src), str(dst))

    def apply(self, book: ScheduleBook) -> None:
        book.check_running(self.src, "copy from")
        book.check_fresh(self.dst, "copy into")
        if not book.processed[self.src]:
            raise ValueError(f"copy from {self.src!r}, which has processed no token")
        book.origin[self.dst] = (self.src, book.processed[self.src])
        book.processed[self.dst] = book.processed[self.src]


@dataclasses.dataclass(frozen=True)
class Handoff(Event):
    """Disaggregated serving: every request holding a slot (`names`, all of them) is exported
    (`serving_state`), a fresh pool of the same size opened, and each imported into a slot of it
    (`serving_alloc`, `serving_load`), in this order; the next forward continues each where it was.
    Its file form is the list of names."""

    key: ClassVar[str] = "handoff"
    names: tuple[str, ...]

    def value(self) -> list[str]:
        return list(self.names)

    @classmethod
    def from_value(cls, value: Any) -> Self:
        return cls(tuple(str(name) for name in value))

    def apply(self, book: ScheduleBook) -> None:
        if sorted(self.names) != sorted(book.holding) or len(set(self.names)) != len(self.names):
            raise ValueError(f"a handoff names every request holding a slot once: {sorted(book.holding)}, "
                             f"got {list(self.names)}")  # fmt: skip
        for name in self.names:
            book.check_running(name, "a handoff of request")
        book.holding[:] = self.names


@dataclasses.dataclass(frozen=True)
class Poison(Event):
    """Request `name`'s slot, new, is filled with `value` (`POISONS`: "nan" or "1e30"), recurrent and
    conv states (`serving_load`): a slot no request may read and no forward may change, held or freed.
    Its file form is `[name, value]`."""

    key: ClassVar[str] = "poison"
    name: str
    poison: str

    def value(self) -> list[str]:
        return [self.name, self.poison]

    @classmethod
    def from_value(cls, value: Any) -> Self:
        name, poison = value
        return cls(str(name), str(poison))

    def apply(self, book: ScheduleBook) -> None:
        book.check_fresh(self.name, "poison")
        if self.poison not in POISONS:
            raise ValueError(f"poison {self.name!r} with {self.poison!r}: one of {list(POISONS)}")
        book.poisoned[self.name] = self.poison


EVENT_TYPES: dict[str, type[Event]] = {
    event.key: event for event in (Alloc, Free, Forward, Verify, Accept, Copy, Handoff, Poison)
}
#: The optional serving verbs (conformance.adapter.OPTIONAL_SERVING_CALLS) each event type needs.
EVENT_CALLS: dict[type[Event], tuple[str, ...]] = {
    Verify: ("serving_accept",),
    Accept: ("serving_accept",),
    Copy: ("serving_copy",),
    Handoff: ("serving_load",),
    Poison: ("serving_load",),
}


def event_from_dict(data: Any) -> Event:
    """The event of its file form `{key: value}` (`Event.as_dict`); a ValueError (or the KeyError or
    TypeError of a malformed value) otherwise."""
    if not isinstance(data, dict) or len(data) != 1 or next(iter(data)) not in EVENT_TYPES:
        raise ValueError(f"an event is one key of {list(EVENT_TYPES)}, got {data!r}")
    ((key, value),) = data.items()
    return EVENT_TYPES[key].from_value(value)


def alloc(*names: str) -> list[Event]:
    return [Alloc(name) for name in names]


def free(*names: str) -> list[Event]:
    return [Free(name) for name in names]


def extend(*requests: tuple[str, int], padding_rows: int = 0) -> Forward:
    return Forward("extend", tuple(requests), padding_rows)


def decode(*names: str, padding_rows: int = 0) -> Forward:
    return Forward("decode", tuple((name, 1) for name in names), padding_rows)


def verify(*requests: tuple[str, int], padding_rows: int = 0) -> Verify:
    return Verify(tuple(requests), padding_rows)
