"""One serving scenario run on the implementation's own pool, every call through the guard.

Each request's hidden states are drawn once for its whole life (`scenario_inputs`), from the dump's
statistics with a seed of the request's name, so that the same request gets the same tokens in every
scenario that schedules it, on any slots. Around each forward every slot holding a request outside the
batch is read before and after: `ServingRun.untouched_before` / `_after` (they must be equal to the bit).
`ScenarioDriver` plays the events: one action per event type (conformance/checks/serving_events.py), on
the same `ScheduleBook` that checked the scenario when it was built.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Callable, Iterable, Mapping

import ml_dtypes
import numpy as np

from conformance.adapters.guard import GuardedAdapter, ImplementationFault, Validator, checked_array
from conformance.checks.serving_events import (
    POISONS,
    VERIFY,
    Accept,
    Alloc,
    Copy,
    Event,
    Forward,
    Free,
    Handoff,
    Poison,
    ScheduleBook,
    Verify,
)
from conformance.checks.serving_scenarios import Scenario
from kda_spec.config import KDAConfig

SEED = 31


@dataclasses.dataclass(frozen=True)
class HiddenStatistics:
    """The mean and standard deviation of a dump's hidden states, the scenarios' inputs' source."""

    mean: float
    std: float

    @classmethod
    def of(cls, hidden_states: np.ndarray) -> HiddenStatistics:  # [T, hidden]
        return cls(float(np.mean(hidden_states)), float(np.std(hidden_states)) or 1.0)

    def draw(self, label: str, rows: int, hidden: int, dtype: str) -> np.ndarray:
        """[rows, hidden] float32 drawn with the seed of `label`, rounded to bf16 for the bf16 run."""
        rng = np.random.default_rng([SEED, zlib.crc32(label.encode())])
        x = (self.mean + self.std * rng.standard_normal((rows, hidden))).astype(np.float32)
        return x.astype(ml_dtypes.bfloat16).astype(np.float32) if dtype == "bf16" else x


def scenario_inputs(
    scenario: Scenario, stats: HiddenStatistics, hidden: int, dtype: str
) -> dict[str, np.ndarray]:
    """Each request's hidden states over its life, [tokens, hidden], by name: a copied request's first
    tokens are its source's (`Scenario.origin`), the rest its own."""
    inputs: dict[str, np.ndarray] = {}
    origin = scenario.origin
    for name, tokens in scenario.request_tokens.items():  # a source is allocated before its copies
        own = stats.draw(f"request {name}", tokens, hidden, dtype)
        if name in origin:
            src, count = origin[name]
            own[:count] = inputs[src][:count]
        inputs[name] = own
    return inputs


@dataclasses.dataclass
class ServingRun:
    """What one scenario gave: each request's outputs over its life [tokens, hidden] and its final states
    (recurrent [H, D, D], conv [W-1, 3P], read before its slot was freed or at the end), every forward's
    outputs in batch order, the states of the slots outside each batch (and of a verify's own) before
    and after it, and the bits of the poisoned slots' states before and after each call that runs on
    the pool."""

    outputs: dict[str, np.ndarray]
    recurrent: dict[str, np.ndarray]
    conv: dict[str, np.ndarray]
    forward_outputs: list[np.ndarray]
    untouched_before: list[np.ndarray]
    untouched_after: list[np.ndarray]
    poisoned_before: list[np.ndarray] = dataclasses.field(default_factory=list)  # uint32 bits
    poisoned_after: list[np.ndarray] = dataclasses.field(default_factory=list)


class ScenarioDriver:
    """One scenario played on the adapter's pool: `act` runs each event's adapter calls on the schedule's
    bookkeeping as it stands before the event (`book`, the one `ScheduleBook` the file reader and the
    search play), then the event is played on it. `act` has one action per event type, looked up by the
    event's type."""

    def __init__(
        self,
        guarded: GuardedAdapter,
        scenario: Scenario,
        inputs: Mapping[str, np.ndarray],
        stats: HiddenStatistics,
        config: KDAConfig,
        dtype: str,
    ):
        self.guarded, self.scenario, self.inputs = guarded, scenario, inputs
        self.stats, self.dtype = stats, dtype
        self.hidden = config.hidden_size
        self.state_shapes = (
            (config.num_heads, config.head_dim, config.head_dim),
            (config.conv_size - 1, 3 * config.proj_dim),
        )
        self.book = ScheduleBook(scenario.name, scenario.num_slots)
        self.slots: dict[str, int] = {}  # the slot of each request holding one
        self.pieces: dict[str, list[np.ndarray]] = {}  # each request's outputs, forward by forward
        self.drafted: dict[str, np.ndarray] = {}  # each request's outputs of its verify, until accepted
        self.poisoned: set[int] = set()  # the slots holding poison (a poisoned request's, or freed)
        self.result = ServingRun({}, {}, {}, [], [], [])

    def run(self) -> ServingRun:
        """Drive the adapter's serving calls through `guarded` as the scenario says; NotImplementedError
        passes through (the checks skip), a broken contract is an `ImplementationFault`."""
        self.guarded.call("serving_open", {"num_slots": self.scenario.num_slots}, _nothing)
        for index, event in enumerate(self.scenario.events):
            self.act(event, index)
            self.book.play(event)
        for name in self.book.holding:
            self.keep_final(name)
        self.result.outputs = {
            name: np.concatenate(parts) if parts else np.zeros((0, self.hidden), np.float32)
            for name, parts in self.pieces.items()
        }
        return self.result

    @functools.singledispatchmethod
    def act(self, event: Event, index: int) -> None:
        """The adapter calls of `event`, the scenario's event `index`."""
        raise TypeError(f"the serving runner has no action for a {type(event).__name__} event")

    @act.register
    def _alloc(self, event: Alloc, index: int) -> None:
        self.slots[event.name] = self.alloc_slot()
        self.poisoned.discard(self.slots[event.name])  # a new request's slot holds zero states now
        self.pieces[event.name] = []

    @act.register
    def _free(self, event: Free, index: int) -> None:
        self.keep_final(event.name)
        self.guarded.call("serving_free", {"slot": self.slots.pop(event.name)}, _nothing)

    @act.register
    def _forward(self, event: Forward, index: int) -> None:
        done = self.book.processed
        rows = [self.inputs[name][done[name] : done[name] + n] for name, n in event.requests]
        out = self.batch(event.mode, event, rows, index, watched=self.unpoisoned(exclude=event.names))
        for name, piece in zip(event.names, out):
            self.pieces[name].append(piece)

    @act.register
    def _verify(self, event: Verify, index: int) -> None:
        """The draft tokens a later `Accept` accepts are the request's own next tokens; the rest are
        drawn apart (a rejected draft is not the token that follows). Every slot, the batch's too, must
        be the same after it."""
        done, rows = self.book.processed, []
        for name, k in event.requests:
            accepted = self.accepted_later(name, index)
            label = f"{self.scenario.name} draft {index} {name}"
            rejected = self.stats.draw(label, k - accepted, self.hidden, self.dtype)
            rows.append(np.concatenate([self.inputs[name][done[name] : done[name] + accepted], rejected]))
        out = self.batch(VERIFY, event, rows, index, watched=self.unpoisoned())
        self.drafted.update(zip(event.names, out))

    @act.register
    def _accept(self, event: Accept, index: int) -> None:
        arguments = {"slot": self.slots[event.name], "accepted": event.accepted}
        self.watched_call("serving_accept", arguments, self.unpoisoned(exclude=[event.name]))
        self.pieces[event.name].append(self.drafted.pop(event.name)[: event.accepted])

    @act.register
    def _copy(self, event: Copy, index: int) -> None:
        arguments = {"src": self.slots[event.src], "dst": self.slots[event.dst]}
        self.watched_call("serving_copy", arguments, self.unpoisoned(exclude=[event.dst]))
        self.pieces[event.dst] = list(self.pieces[event.src])  # its first tokens' outputs are the source's

    @act.register
    def _handoff(self, event: Handoff, index: int) -> None:
        exported = {name: self.read(name) for name in event.names}
        self.guarded.call("serving_open", {"num_slots": self.scenario.num_slots}, _nothing)
        self.slots.clear()
        self.poisoned.clear()
        for name in event.names:
            self.slots[name] = self.alloc_slot()
            self.load(name, *exported[name])

    @act.register
    def _poison(self, event: Poison, index: int) -> None:
        value = POISONS[event.poison]
        self.load(event.name, *(np.full(shape, value, np.float32) for shape in self.state_shapes))
        self.poisoned.add(self.slots[event.name])

    def batch(
        self, mode: str, event: Forward | Verify, rows: list[np.ndarray], index: int, watched: list[str]
    ) -> list[np.ndarray]:
        """One `serving_forward` of `event`'s requests (`rows`: each one's tokens, [n, hidden]) and
        padding rows, with `watched`'s states and the poisoned slots read around it; each request's
        outputs [n, hidden]."""
        names = event.names
        lens = np.array([len(r) for r in rows], np.int64)
        label = f"{self.scenario.name} padding {index}"
        padding = self.stats.draw(label, event.padding_rows, self.hidden, self.dtype)
        arguments = {
            "mode": mode,
            "hidden_states": np.concatenate([*rows, padding]),
            "seq_lens": lens,
            "slots": np.array([self.slots[name] for name in names], np.int64),
            "prefix_lens": np.array([self.book.processed[name] for name in names], np.int64),
            "padding_rows": event.padding_rows,
        }
        real = int(lens.sum())
        checked = functools.partial(_checked_out, shape=(real + event.padding_rows, self.hidden))
        out = self.watched_call("serving_forward", arguments, watched, checked)
        self.result.forward_outputs.append(out[:real])
        return np.split(out[:real], np.cumsum(lens)[:-1])

    def watched_call(
        self, method: str, arguments: dict[str, object], watched: list[str], validate: Validator | None = None
    ) -> object:
        """`method` called (its result through `validate`, or none) with the states of the requests
        `watched` and the bits of the poisoned slots read before and after it (`ServingRun`)."""
        self.result.untouched_before.append(_states(self.read, watched))
        self.result.poisoned_before.append(self.poison_bits())
        result = self.guarded.call(method, arguments, validate or _nothing)
        self.result.untouched_after.append(_states(self.read, watched))
        self.result.poisoned_after.append(self.poison_bits())
        return result

    def unpoisoned(self, exclude: Iterable[str] = ()) -> list[str]:
        """The requests holding a slot whose states are not poison, but those of `exclude`."""
        skipped = {*exclude, *self.book.poisoned}
        return [name for name in self.book.holding if name not in skipped]

    def poison_bits(self) -> np.ndarray:
        """The bits of the poisoned slots' states (held or free), uint32, in slot order."""
        parts = [
            array.view(np.uint32).ravel() for slot in sorted(self.poisoned) for array in self.read_slot(slot)
        ]
        return np.concatenate(parts) if parts else np.zeros(0, np.uint32)

    def accepted_later(self, name: str, index: int) -> int:
        """How many draft tokens of request `name`'s verify (event `index`) its accept keeps."""
        later = self.scenario.events[index + 1 :]
        return next((e.accepted for e in later if isinstance(e, Accept) and e.name == name), 0)

    def alloc_slot(self) -> int:
        return self.guarded.call("serving_alloc", {}, _slot_checker(set(self.slots.values())))

    def load(self, name: str, recurrent: np.ndarray, conv: np.ndarray) -> None:
        """`serving_load` of `name`'s slot: recurrent [H, D, D], conv [W-1, 3P]."""
        arguments = {"slot": self.slots[name], "recurrent": recurrent, "conv": conv}
        self.guarded.call("serving_load", arguments, _nothing)

    def read(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """The states `name`'s slot holds now (`serving_state`)."""
        return self.read_slot(self.slots[name])

    def read_slot(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """The states `slot` holds now (`serving_state`; a free slot's too)."""

        def check(result: object, call: str) -> tuple[np.ndarray, np.ndarray]:
            if not isinstance(result, (tuple, list)) or len(result) != 2:
                raise ImplementationFault("contract", call, "must return a pair (recurrent, conv)")
            return (
                checked_array(result[0], call, "recurrent", self.state_shapes[0]),
                checked_array(result[1], call, "conv", self.state_shapes[1]),
            )

        return self.guarded.call("serving_state", {"slot": slot}, check)

    def keep_final(self, name: str) -> None:
        self.result.recurrent[name], self.result.conv[name] = self.read(name)


def _states(read: Callable[[str], tuple[np.ndarray, np.ndarray]], names: list[str]) -> np.ndarray:
    """The recurrent and conv states of `names`' slots, flattened into one float32 vector."""
    parts = [array.ravel() for name in names for array in read(name)]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def _checked_out(result: object, call: str, shape: tuple[int, int]) -> np.ndarray:
    return checked_array(result, call, "out", shape)


def _nothing(result: object, call: str) -> None:
    return None


def _slot_checker(in_use: set[int]) -> Callable[[object, str], int]:
    """A validator of `serving_alloc`'s result: an int naming a slot no live request holds."""

    def check(result: object, call: str) -> int:
        if isinstance(result, bool) or not isinstance(result, (int, np.integer)):
            raise ImplementationFault(
                "contract", call, f"must return an int slot, got {type(result).__name__}"
            )
        if int(result) in in_use:
            raise ImplementationFault(
                "contract", call, f"returned slot {int(result)}, which a live request holds"
            )
        return int(result)

    return check
