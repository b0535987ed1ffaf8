"""`time_budget=20m`: a run planned in wall-clock time, validation and the final test evaluation included.

How a budget is spent (`Budget` keeps the accounts, the trainer asks it what fits):

1. setup (reading the data, training the tokenizer, building the model) is measured as it happens;
2. the first `PROBE_STEPS` optimizer steps measure the step time; then the run is planned: the steps
   that fit, the warmup and schedule fitted to them (`resolve_recipe`), and validations that spend
   about `VALID_SHARE` of the budget, spread evenly from `FIRST_VALID` of the planned steps on (a model
   that has barely started generates up to the length limit: slow, and it says nothing);
3. the run keeps measuring: before every step it stops when that step, a last validation and the test
   evaluation (the newest validation's seconds per example, times the beam's cost over greedy decoding
   measured on a sample) would not fit in what is left, and a scheduled validation that would not fit
   is skipped; each validation plans the rest again. A machine slower or faster than the probe
   measured thus moves the end, never past the deadline by more than the estimates are wrong;
4. a beam test that would not fit what is left at the end, give or take `BEAM_OVERRUN` of the budget
   (or that would take over `BEAM_TEST_SHARE` of the budget, planned so) is decoded greedily.

The clock starts when the trainer starts its setup (the CLI's Python and torch imports, a second or two,
come before it). A resumed run gets what its first process left of the budget.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
PROBE_STEPS = 5  # optimizer steps timed before the run is planned (the first one, warming up, is not counted)
# Optimizer steps timed before a fitted recipe is fitted to the compute (`pacing.refit`): each new batch shape is slow
# the first time it runs, so the probe's steps are too few to know the pace by.
REFIT_STEPS = 50
VALID_SHARE = 0.10  # of the budget, spent on validation during training
MAX_VALIDATIONS = 10
FIRST_VALID = 0.4  # of the planned steps: where the first validation comes
# Before anything is decoded, a validation is guessed at ten steps' time and the test at the beam's
# multiple of that, but at most these shares of the budget (the first validation measures them).
GUESS_VALID_SHARE = 0.05
GUESS_TEST_SHARE = 0.15
BEAM_TEST_SHARE = 0.25  # a beam test estimated above this share of the budget is planned greedy instead
# The end's validation and test are estimated from the newest validation; the model keeps changing until
# the last step (its outputs grow or shrink), so their reserve is kept this much larger: the beam test
# missed its reserve by a second or two of 20 without it.
END_MARGIN = 1.15
# A beam test estimated to end up to this share of the budget past the deadline still runs (beam 4 is worth
# about 2 BLEU over greedy decoding; the estimate, from a sample, is often a few seconds off either way).
BEAM_OVERRUN = 0.02
FINISH_S = 1.0  # saving the final model, the metrics CSV and the plot (matplotlib imported at the start)
BEAM_SAMPLE = 64  # valid examples decoded greedily and with the test's beam at each validation: their ratio


def parse_duration(text: str) -> float:
    """Seconds in a duration such as "90s", "20m", "1h", "1h30m" or "1.5h"; a bare number is refused."""
    spec = str(text).strip().lower().replace(" ", "")
    parts = re.findall(r"(\d+(?:\.\d*)?|\.\d+)([smh])", spec)
    if not spec or "".join(number + unit for number, unit in parts) != spec:
        raise ValueError(f"time_budget must be a duration such as 90s, 20m, 1h or 1h30m, got {text!r}")
    seconds = sum(float(number) * UNITS[unit] for number, unit in parts)
    if seconds <= 0:
        raise ValueError(f"time_budget must be above 0, got {text!r}")
    return seconds


def format_duration(seconds: float) -> str:
    """"12.3 s", "4.5 min" or "1.20 h"."""
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


@dataclass
class Budget:
    """The accounts of a run under `time_budget`: what was spent on what, and what still fits.

    Args:
        seconds: the whole budget.
        started: `time.perf_counter()` when the run began.
        used: seconds an earlier process of the same run already spent (a resume).
    """

    seconds: float
    started: float
    used: float = 0.0
    # "train" is the optimizer steps less "data", the making of their batches (the data pipeline)
    spent: dict[str, float] = field(default_factory=lambda: {"setup": 0.0, "train": 0.0, "data": 0.0, "valid": 0.0,
                                                             "checkpoint": 0.0, "test": 0.0, "finish": 0.0})
    step_s: float | None = None  # the recent optimizer step time (exponential average)
    valid_s: float | None = None  # the newest validation's seconds
    beam_probe_s: float = 0.0  # the newest beam-ratio sample's seconds (in-loop validations pay it too)
    end_reserve_s: float = 0.0  # what the end was estimated to need when training stopped
    example_s: float | None = None  # seconds per example at the newest validation
    example_decoded: bool = False  # whether that validation decoded (greedily)
    beam_ratio: float | None = None  # beam decoding's seconds over greedy decoding's, on the newest sample
    timed_steps: int = 0
    validations: int = 0  # validations so far
    planned_steps: int = 0
    next_valid: int = 0  # the step of the next validation (0: none before the end)
    skipped_validations: int = 0
    refitted: bool = False  # whether the recipe was fitted to the compute (once, early; a resumed run keeps it)

    @property
    def deadline(self) -> float:
        """The `perf_counter` time the run must end by."""
        return self.started + self.seconds - self.used

    def left(self) -> float:
        """Seconds left of the budget now."""
        return self.deadline - time.perf_counter()

    def elapsed(self) -> float:
        """Seconds of the budget used so far (earlier processes of the run included)."""
        return self.used + time.perf_counter() - self.started

    def record(self, phase: str, seconds: float) -> None:
        """Add `seconds` to `phase` ("setup", "train", "valid", "checkpoint", "test" or "finish")."""
        self.spent[phase] = self.spent.get(phase, 0.0) + seconds

    def record_step(self, seconds: float, data_s: float = 0.0) -> None:
        """One optimizer step took `seconds`, `data_s` of them making its batches; the first is a warm-up
        (allocations, threads) and not averaged."""
        self.record("train", seconds - data_s)
        self.record("data", data_s)
        self.timed_steps += 1
        if self.timed_steps == 1 and self.step_s is None:
            return
        self.step_s = seconds if self.step_s is None else 0.8 * self.step_s + 0.2 * seconds

    def record_validation(self, seconds: float, examples: int, decoded: bool) -> None:
        """A validation of `examples` took `seconds` (greedy decoding when `decoded`)."""
        self.record("valid", seconds)
        self.validations += 1
        self.beam_probe_s = 0.0
        self.valid_s = seconds
        if examples:
            self.example_s, self.example_decoded = seconds / examples, decoded

    def record_beam(self, greedy_s: float, beam_s: float) -> None:
        """The same sample decoded greedily in `greedy_s` and with the test's beam in `beam_s` (validation time)."""
        self.record("valid", greedy_s + beam_s)
        self.beam_probe_s = greedy_s + beam_s  # a validation in the loop costs both
        self.beam_ratio = beam_s / max(greedy_s, 1e-9)

    def valid_estimate(self) -> float:
        """Seconds of one validation: the newest one's, else a guess (ten steps, at most GUESS_VALID_SHARE)."""
        if self.valid_s is not None:
            return self.valid_s
        return min(10 * (self.step_s or 0.0), GUESS_VALID_SHARE * self.seconds)

    def test_estimate(self, examples: int, num_beams: int, decoded: bool) -> float:
        """Seconds of the final test evaluation: `examples` at the newest validation's speed (x beam over greedy)."""
        if not examples:
            return 0.0
        per_example = self.example_s if self.example_decoded or not decoded else None
        if per_example is None:  # nothing measured (or decoded) yet: a guess
            return min(self.valid_estimate() * max(num_beams, 1), GUESS_TEST_SHARE * self.seconds)
        ratio = 1.0 if num_beams <= 1 else self.beam_ratio or float(num_beams)
        return per_example * examples * ratio

    def end_test_estimate(self, examples: int, num_beams: int, decoded: bool) -> float:
        """The test's seconds as the end will spend them: with the beam, or greedy when the beam's estimate
        is above `BEAM_TEST_SHARE` of the budget (the run then keeps training instead)."""
        beam = self.test_estimate(examples, num_beams, decoded)
        return beam if beam <= BEAM_TEST_SHARE * self.seconds else self.test_estimate(examples, 1, decoded)

    def fits(self, seconds: float, reserve: float) -> bool:
        """Whether `seconds` of work still leave `reserve` seconds before the deadline."""
        return seconds + reserve <= self.left()

    def plan(self, steps_done: int, reserve: float, valid_examples: int, max_steps: int = 0) -> tuple[int, int]:
        """(planned optimizer steps, step of the next validation or 0) for what is left after `steps_done`.

        About `VALID_SHARE` of the budget goes to validations (at most `MAX_VALIDATIONS`) at evenly spread
        fractions of the planned steps from `FIRST_VALID` on; the rest, less `reserve` for the end, to steps.
        """
        step_s = max(self.step_s or 1e-3, 1e-6)
        valid_s = self.valid_estimate() + self.beam_probe_s if valid_examples else 0.0
        left = max(self.left() - reserve, 0.0)
        count = int(min(MAX_VALIDATIONS, VALID_SHARE * self.seconds / valid_s)) if valid_s else 0
        fractions = [FIRST_VALID + (1 - FIRST_VALID) * k / count for k in range(count)]
        total = steps_done + max(int((left - count * valid_s) / step_s), 1)
        for _ in range(2):  # the validations still to come depend on the steps, the steps on them
            pending = [f for f in fractions if round(f * total) > steps_done][:max(count - self.validations, 0)]
            total = steps_done + max(int((left - len(pending) * valid_s) / step_s), 1)
        if max_steps:
            total = min(total, max_steps)
        pending = [round(f * total) for f in fractions if round(f * total) > steps_done]
        pending = pending[:max(count - self.validations, 0)]  # the validations done count against the share
        if pending:  # a plan that moved keeps the validations left apart: at most one per share of the rest
            pending[0] = max(pending[0], steps_done + (total - steps_done) // (len(pending) + 1))
        self.planned_steps, self.next_valid = total, (pending[0] if pending else 0)
        return total, self.next_valid

    def summary(self) -> dict[str, float | int]:
        """The accounts as one flat dict (a metrics row, the run's report)."""
        used = self.elapsed()
        return {"budget_s": round(self.seconds, 3), "used_s": round(used, 3),
                "used_fraction": round(used / self.seconds, 4),
                **{f"{phase}_s": round(value, 3) for phase, value in self.spent.items()},
                "step_s": round(self.step_s or 0.0, 4), "planned_steps": self.planned_steps,
                "end_reserve_s": round(self.end_reserve_s, 3),
                "skipped_validations": self.skipped_validations}

    def describe(self) -> str:
        """One line: how the budget was spent."""
        s = self.summary()
        parts = ", ".join(f"{phase} {format_duration(s[f'{phase}_s'])} ({s[f'{phase}_s'] / self.seconds:.1%})"
                          for phase in self.spent if s[f"{phase}_s"])
        return (f"time budget {format_duration(self.seconds)}: used {format_duration(s['used_s'])} "
                f"({s['used_fraction']:.1%}): {parts}")
