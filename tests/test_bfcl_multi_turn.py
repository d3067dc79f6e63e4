"""BFCL's multi-turn questions: gdpo-eval's verdicts agree with BFCL's own checker, the rewards
score trajectories through the reward stage, and the family reads through the data path.

BFCL's ``multi_turn_checker`` (tests/bfcl_reference.py) runs calls with ``eval``, which is
fine for the ground-truth and perturbed call lists this test writes itself.
"""
import json

import pytest
import torch

from bfcl_reference import multi_turn_verdict
from gdpo_megatron.advantages import compute_advantages, conditions_by_column
from gdpo_megatron.config import ConditionConfig
from gdpo_megatron.config.rewards import RewardSpec
from gdpo_megatron.data import load_samples
from gdpo_megatron.data.bfcl_multi_turn import (
    CATEGORIES, bfcl_multi_turn_rows, load_bfcl_multi_turn, split_of,
)
from gdpo_megatron.environments import Trajectory, parse_calls
from gdpo_megatron.environments.judge import ReferenceRefused, check_reference
from gdpo_megatron.evaluate_multi_turn import verdict
from gdpo_megatron.rewards import RewardStage, get_reward

pytest.importorskip("bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker")


def our_verdict(steps, row):
    """gdpo-eval's verdict (the one its --bfcl-multi-turn reports) on the same call lists."""
    v = verdict(Trajectory.from_calls("bfcl", steps), row["multi_turn"])
    return v.valid, v.failure, v.turn


def as_steps(turns):
    """Per turn, one step with the turn's calls (no step for a turn without calls)."""
    return [[list(calls)] if calls else [] for calls in turns]


def changed_argument(text):
    (call,) = parse_calls(text)
    values = {**dict(enumerate(call.args)), **call.kwargs}
    if not values:
        return None
    key = next(iter(values))
    value = values[key]
    new = (not value if isinstance(value, bool) else value + 1 if isinstance(value, (int, float))
           else value + "_x" if isinstance(value, str) else [] if value else None)
    if new is None:
        return None
    args = tuple(new if i == key else a for i, a in enumerate(call.args))
    kwargs = {k: new if k == key else v for k, v in call.kwargs.items()}
    return str(type(call)(call.name, args, kwargs))


def perturbations(reference, n):
    """Perturbed call lists of a question (``n`` picks the positions): a call dropped, an argument
    changed, a call added, two turns swapped."""
    filled = [t for t, calls in enumerate(reference) if calls]
    t = filled[n % len(filled)]
    out = {}
    dropped = [list(calls) for calls in reference]
    dropped[t].pop(n % len(dropped[t]))
    out["dropped"] = dropped
    changed = [list(calls) for calls in reference]
    new = changed_argument(changed[t][-1])
    if new is not None:
        changed[t][-1] = new
        out["changed"] = changed
    added = [list(calls) for calls in reference]
    added[t].insert(0, added[filled[(n + 1) % len(filled)]][0])
    out["added"] = added
    if len(reference) > 1:
        swapped = [list(calls) for calls in reference]
        i = n % (len(reference) - 1)
        swapped[i], swapped[i + 1] = swapped[i + 1], swapped[i]
        out["swapped"] = swapped
    return out


def unfit(row) -> bool:
    """The question's reference calls cannot be replayed (one is refused)."""
    try:
        check_reference("bfcl", row["multi_turn"]["environment_config"], row["multi_turn"]["reference_calls"])
    except ReferenceRefused:
        return True
    return False


@pytest.fixture(scope="module")
def rows():
    return {category: bfcl_multi_turn_rows([category]) for category in CATEGORIES}


def test_the_reference_calls_that_do_not_fit_their_question_are_known(rows):
    # close_ticket(ticket_id='ticket_001') where the schema says integer; tail before its miss_func turn
    assert {row["id"] for category in CATEGORIES for row in rows[category] if unfit(row)} == {f"multi_turn_{c}_173" for c in CATEGORIES} | {"multi_turn_miss_func_49"}


def test_verdicts_agree_with_bfcls_checker(rows):
    """Every ground-truth trajectory of the four categories, and four perturbations of each base
    question: same verdict, same failing check, same turn where BFCL names one."""
    checked, invalid = 0, {"empty": 0, "state": 0, "response": 0}
    for category in CATEGORIES:
        for n, row in enumerate(rows[category]):
            reference = row["multi_turn"]["reference_calls"]
            if unfit(row):
                continue
            variants = {"reference": reference}
            if category == "base":
                variants.update(perturbations(reference, n))
            for kind, turns in variants.items():
                steps = as_steps(turns)
                ours, theirs = our_verdict(steps, row), multi_turn_verdict(steps, row)
                assert ours[:2] == theirs[:2] and (theirs[2] is None or ours[2] == theirs[2]), (row["id"], kind)
                checked += 1
                if not ours[0]:
                    invalid[ours[1]] += 1
    assert checked > 795 + 3 * 199
    assert all(count > 20 for count in invalid.values()), invalid  # every kind of failure was exercised


REWARDS = ["multi_turn_format", "multi_turn_state", "multi_turn_response", "multi_turn_accuracy",
           "multi_turn_efficiency"]


def test_never_calling_or_stopping_early_is_paid_nothing_for_the_turns_left(rows):
    """Attacks on the turn structure, over the first 40 base questions: a policy that answers every
    turn in prose, or that makes exactly the reference calls of the first ``k`` turns and then
    stops (its token budget ended the trajectory), is paid on no reward for a turn it left
    empty. BFCL's checker fails the same turn as empty; each reward is the share of the graded
    turns before it (every base turn is graded), accuracy 0."""
    checked = 0
    for row in rows["base"][:40]:
        truth, reference = row["multi_turn"], row["multi_turn"]["reference_calls"]
        assert all(reference)  # every turn graded
        n = len(reference)
        prose = Trajectory.from_texts("bfcl", [["Done, nothing to do."]] * n)
        assert multi_turn_verdict(as_steps([[]] * n), row) == (False, "empty", 0)
        assert [get_reward(name)(prose, 0, truth) for name in REWARDS] == [0.0] * 5, row["id"]
        for k in range(1, n):
            stopped = Trajectory.from_calls("bfcl", as_steps(reference[:k]))
            assert len(stopped.turns) == k
            assert multi_turn_verdict(as_steps(reference[:k]) + [[]] * (n - k), row) == (False, "empty", k)
            assert [get_reward(name)(stopped, 0, truth) for name in REWARDS] == pytest.approx(
                [k / n, k / n, k / n, 0.0, k / n]), (row["id"], k)
            checked += 1
    assert checked > 80


def test_multi_turn_rewards_through_the_reward_stage(rows):
    (row,) = [r for r in rows["base"] if r["id"] == "multi_turn_base_1"]
    reference = row["multi_turn"]["reference_calls"]
    assert reference[1] == ["cd(folder='workspace')", "mv(source='log.txt',destination='archive')"]
    truth = row["multi_turn"]
    exact = Trajectory.from_calls("bfcl", as_steps(reference))
    # turn 1 forgets the move, so the state is wrong from there on and the results of the later
    # turns' reference calls (grep and tail of the moved file) are never produced; one message
    # of turn 0 does not parse; one call is added to turn 3
    sloppy = Trajectory.from_texts("bfcl", [
        ["[ls(a=True)]", "[cd(folder=open('x').read())]", "Done."],
        ["[cd(folder='workspace')]"],
        ["[cd(folder='archive'), grep(file_name='log.txt',pattern='Error')]"],
        ["[tail(file_name='log.txt',lines=20), ls()]"],
    ])
    failed = Trajectory("bfcl", exact.turns, failure="step ran past the time limit")
    names = REWARDS
    with RewardStage([RewardSpec(name) for name in names], num_workers=1) as stage:
        rewards, metrics = stage.score([exact, sloppy, failed], [0, 0, 0], [truth] * 3)
    assert rewards[0].tolist() == [1.0] * 5
    # format per turn: 1 of 2 attempts accepted in turn 0 (one message does not parse), all
    # accepted after; state right only after turn 0: 1/4; response as well; efficiency per turn:
    # reference calls over made 1/1, 2/1 (capped), 2/2, 1/2
    assert rewards[1].tolist() == pytest.approx([(1 / 2 + 1 + 1 + 1) / 4, 1 / 4, 1 / 4, 0.0, (1 + 1 + 1 + 1 / 2) / 4])
    assert rewards[2].tolist() == [0.0] * 5
    assert all(metrics[f"reward/{name}/failures"] == 1.0 for name in names)


def test_the_split_is_by_scenario_and_fixed(rows):
    heldout = {int(r["id"].rsplit("_", 1)[1]) for r in rows["base"] if split_of(r["id"]) == "heldout"}
    assert len(heldout) == 31 and {0, 1, 2} & heldout == set()
    for category in CATEGORIES:
        assert {int(r["id"].rsplit("_", 1)[1]) for r in rows[category] if split_of(r["id"]) == "heldout"} == heldout
    assert len(bfcl_multi_turn_rows(["base"], "heldout")) == 31
    assert len(bfcl_multi_turn_rows(["base"], "train")) == 169


def test_rows_read_through_the_normal_data_path(tmp_path, rows):
    path = tmp_path / "bfcl_multi_turn.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows["miss_func"][:3] + rows["base"][173:174]))
    with pytest.warns(UserWarning, match="reference calls that do not fit"):
        samples = load_samples(path, "bfcl_multi_turn")
    assert [s.id for s in samples] == [f"multi_turn_miss_func_{n}" for n in range(3)]
    left_out = r"left out 2 questions .*: multi_turn_miss_func_49, multi_turn_miss_func_173$"
    with pytest.warns(UserWarning, match=left_out):
        direct = {s.id: s for s in load_bfcl_multi_turn(["miss_func"])}
    for sample in samples:
        assert sample.messages == direct[sample.id].messages and sample.ground_truth == direct[sample.id].ground_truth
    first = samples[0]
    assert first.messages[0]["role"] == "system" and '"name": "sort"' not in first.messages[0]["content"]
    revealed = first.ground_truth["later_turns"][2][0]["content"]  # turn 3 shows sort
    assert '"name": "sort"' in revealed and revealed.endswith("What about now?")


def test_efficiency_counts_only_where_the_state_is_right(rows):
    """Gated by ``advantage.conditions`` as any reward: a trajectory that used few calls but left the
    wrong state gets no efficiency, and GDPO normalizes the gated column in the group."""
    (row,) = [r for r in rows["base"] if r["id"] == "multi_turn_base_1"]
    reference = row["multi_turn"]["reference_calls"]
    group = [
        Trajectory.from_calls("bfcl", as_steps(reference)),
        Trajectory.from_calls("bfcl", as_steps([reference[0] + ["ls()"], *reference[1:]])),  # one call too many
        Trajectory.from_calls("bfcl", as_steps([reference[0], reference[1][:1], *reference[2:]])),  # no move
        Trajectory.from_calls("bfcl", as_steps([reference[0]])),  # stops after the first turn
    ]
    names = ["multi_turn_state", "multi_turn_efficiency"]
    rewards = torch.tensor([[get_reward(n)(t, 0, row["multi_turn"]) for n in names] for t in group])
    # state: right after every turn, or only after the first (the turns never reached are empty);
    # efficiency per turn (reference calls over made, capped at 1; 0 for a turn without calls):
    # exact; 1/2 in turn 0; 2/1 capped in turn 1; only turn 0
    assert rewards.flatten().tolist() == pytest.approx([1, 1, 1, (1 / 2 + 3) / 4, 1 / 4, 1, 1 / 4, 1 / 4])
    conditions = conditions_by_column([ConditionConfig(reward="multi_turn_efficiency", gate="multi_turn_state")],
                                      names)
    gated = compute_advantages(rewards, torch.zeros(4, dtype=torch.long), conditions=conditions)
    assert gated.rewards[:, 1].tolist() == pytest.approx([1, (1 / 2 + 3) / 4, 0, 0])
    by_hand = rewards.clone()
    by_hand[2:, 1] = 0.0
    assert torch.equal(gated.advantages, compute_advantages(by_hand, torch.zeros(4, dtype=torch.long)).advantages)
