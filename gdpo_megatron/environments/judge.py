"""Judging a trajectory against a question's reference calls, as BFCL's multi-turn checker does.

:func:`judge` replays the trajectory's calls in a fresh environment and the reference calls
of each user turn in another, turn by turn (``start_turn`` on both before turns after the
first), and records per turn what BFCL's ``multi_turn_checker`` checks on a turn whose
reference is not empty:

* ``calls``: the model made a call in the turn (BFCL: an empty turn fails);
* ``state``: the model's environment ``matches`` the reference's after the turn;
* ``response``: every result of the turn's reference calls is among the results of all the
  model's calls so far, counted with multiplicity, in any order (BFCL's
  ``_is_subsequence_unordered``: a result the model got in an earlier turn counts).

A turn whose reference is empty (BFCL's miss_param category: the model should ask) is not
graded. BFCL's verdict is valid when every graded turn passes all three, and its error is the
first failing check in that order (:attr:`Judgement.first_failure`). The counts the format and
efficiency rewards need come with each turn's verdict: the model's calls run, calls refused
(unknown function, arguments that do not fit), call messages that did not parse, and the
reference's number of calls. A turn the trajectory never reached (its token budget or its
environment ended it first) has no calls: it fails as empty where graded.

:func:`check_reference` replays only the reference calls, as the judge will: gdpo-eval runs it
on every question before its engine starts, so that a malformed question is named at once.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from gdpo_megatron.environments.calls import CallRefused, parse_calls
from gdpo_megatron.environments.environment import ERROR_PREFIX, Environment
from gdpo_megatron.environments.registry import make_environment
from gdpo_megatron.environments.trajectory import Trajectory


class ReferenceRefused(ValueError):
    """A question's reference calls cannot be replayed (malformed ground truth); says which."""


@dataclass(frozen=True)
class TurnVerdict:
    graded: bool  # the reference makes calls in this turn
    state: bool
    response: bool
    calls_run: int  # the model's calls in this turn that the environment accepted (and ran)
    calls_refused: int  # its parsed calls that the environment refused
    unparsed: int  # its call messages that did not parse
    reference_calls: int  # calls the reference makes in this turn

    @property
    def calls(self) -> bool:
        """The model made a call in this turn (BFCL: an empty turn fails)."""
        return self.made > 0

    @property
    def made(self) -> int:
        return self.calls_run + self.calls_refused

    @property
    def failure(self) -> str | None:
        """BFCL's first failing check on this turn ("empty", "state", "response"), or None."""
        if not self.graded:
            return None
        return "empty" if not self.calls else "state" if not self.state else "response" if not self.response else None


@dataclass(frozen=True)
class Judgement:
    turns: tuple[TurnVerdict, ...]

    @property
    def graded(self) -> list[TurnVerdict]:
        return [t for t in self.turns if t.graded]

    @property
    def calls_run(self) -> int:
        return sum(t.calls_run for t in self.turns)

    @property
    def first_failure(self) -> tuple[int, str] | None:
        """(turn, check) of BFCL's error, or None when BFCL's verdict is valid."""
        return next(((i, t.failure) for i, t in enumerate(self.turns) if t.failure), None)

    @property
    def valid(self) -> bool:
        return self.first_failure is None


def judge(trajectory: Trajectory, config: dict, reference: Sequence[Sequence[str]]) -> Judgement:
    """The trajectory against the reference calls (per turn, BFCL call strings) of a question
    whose environment config is ``config``. ValueError if the turn counts differ, ReferenceRefused
    if a reference call does not parse or is refused (malformed ground truth)."""
    if len(trajectory.turns) > len(reference):
        raise ValueError(f"the trajectory has {len(trajectory.turns)} turns, the question {len(reference)}")
    model, truth = make_environment(trajectory.environment), make_environment(trajectory.environment)
    model.reset(config)
    truth.reset(config)
    model_results: list[str] = []
    verdicts = []
    for t, reference_turn in enumerate(reference):
        if t:
            model.start_turn(t)
            truth.start_turn(t)
        run = refused = unparsed = 0
        for message in trajectory.turns[t] if t < len(trajectory.turns) else ():
            calls = message.calls()
            if calls is None:
                continue
            if isinstance(calls, CallRefused):
                unparsed += 1
                continue
            for result in model.step(calls).results:
                model_results.append(result.output)
                refused += result.refused
                run += not result.refused
        truth_results = reference_results(truth, reference_turn, t)
        graded = bool(reference_turn)
        verdicts.append(TurnVerdict(
            graded=graded, state=model.matches(truth) if graded else True,
            response=not (Counter(truth_results) - Counter(model_results)) if graded else True,
            calls_run=run, calls_refused=refused, unparsed=unparsed, reference_calls=len(truth_results),
        ))
    return Judgement(tuple(verdicts))


def reference_results(environment: Environment, calls: Sequence[str], turn: int) -> list[str]:
    """The results of one user turn's reference calls (BFCL call strings), run in order in
    ``environment``; ReferenceRefused naming the first call that does not parse or is refused."""
    results = []
    for text in calls:
        try:
            parsed = parse_calls(text)
        except CallRefused as e:
            raise ReferenceRefused(f"reference call {text!r} of turn {turn} does not parse ({e})") from None
        for result in environment.step(parsed).results:
            if result.refused:
                raise ReferenceRefused(f"reference call {text!r} of turn {turn} is refused "
                                 f"({result.output.removeprefix(ERROR_PREFIX)})")
            results.append(result.output)
    return results


def check_reference(environment: str, config: dict, reference: Sequence[Sequence[str]]) -> None:
    """Replay a question's reference calls turn by turn in a fresh ``environment`` (a reference,
    :mod:`~gdpo_megatron.environments.registry`) reset from ``config``, as :func:`judge` does;
    ReferenceRefused naming the first call that does not parse or is refused, or what the environment
    raised."""
    env = make_environment(environment)
    turn = 0
    try:
        env.reset(config)
        for turn, calls in enumerate(reference):
            if turn:
                env.start_turn(turn)
            reference_results(env, calls, turn)
    except ReferenceRefused:
        raise
    except Exception as e:  # the environment's own code, on the question's config
        raise ReferenceRefused(f"the environment raised {type(e).__name__}: {e} replaying turn {turn} of the reference "
                         "calls") from None
