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
from collections.abc import Callable, Mapping

import ml_dtypes
import numpy as np

from conformance.adapters.guard import GuardedAdapter, ImplementationFault, checked_array
from conformance.checks.serving_events import Alloc, Event, Forward, Free, ScheduleBook
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
    """Each request's hidden states over its life, [tokens, hidden], by name."""
    return {
        name: stats.draw(f"request {name}", tokens, hidden, dtype)
        for name, tokens in scenario.request_tokens.items()
    }


@dataclasses.dataclass
class ServingRun:
    """What one scenario gave: each request's outputs over its life [tokens, hidden] and its final states
    (recurrent [H, D, D], conv [W-1, 3P], read before its slot was freed or at the end), every forward's
    outputs in batch order, and the states of the slots outside each batch, before and after it."""

    outputs: dict[str, np.ndarray]
    recurrent: dict[str, np.ndarray]
    conv: dict[str, np.ndarray]
    forward_outputs: list[np.ndarray]
    untouched_before: list[np.ndarray]
    untouched_after: list[np.ndarray]


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
        in_use = {self.slots[name] for name in self.book.holding}
        self.slots[event.name] = self.guarded.call("serving_alloc", {}, _slot_checker(in_use))
        self.pieces[event.name] = []

    @act.register
    def _free(self, event: Free, index: int) -> None:
        self.keep_final(event.name)
        self.guarded.call("serving_free", {"slot": self.slots.pop(event.name)}, _nothing)

    @act.register
    def _forward(self, event: Forward, index: int) -> None:
        names, done = event.names, self.book.processed
        lens = np.array([n for _, n in event.requests], np.int64)
        rows = [self.inputs[name][done[name] : done[name] + n] for name, n in event.requests]
        padding = self.stats.draw(
            f"{self.scenario.name} padding {index}", event.padding_rows, self.hidden, self.dtype
        )
        outside = [name for name in self.book.holding if name not in names]
        self.result.untouched_before.append(_states(self.read, outside))
        arguments = {
            "mode": event.mode,
            "hidden_states": np.concatenate([*rows, padding]),
            "seq_lens": lens,
            "slots": np.array([self.slots[name] for name in names], np.int64),
            "prefix_lens": np.array([done[name] for name in names], np.int64),
            "padding_rows": event.padding_rows,
        }
        shape = (int(lens.sum()) + event.padding_rows, self.hidden)
        out = self.guarded.call("serving_forward", arguments, functools.partial(_checked_out, shape=shape))
        self.result.untouched_after.append(_states(self.read, outside))
        self.result.forward_outputs.append(out[: int(lens.sum())])
        start = 0
        for name, n in event.requests:
            self.pieces[name].append(out[start : start + n])
            start += n

    def read(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """The states `name`'s slot holds now (`serving_state`)."""

        def check(result: object, call: str) -> tuple[np.ndarray, np.ndarray]:
            if not isinstance(result, (tuple, list)) or len(result) != 2:
                raise ImplementationFault("contract", call, "must return a pair (recurrent, conv)")
            return (
                checked_array(result[0], call, "recurrent", self.state_shapes[0]),
                checked_array(result[1], call, "conv", self.state_shapes[1]),
            )

        return self.guarded.call("serving_state", {"slot": self.slots[name]}, check)

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
