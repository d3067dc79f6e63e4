"""The step's collectives over a real gloo world: sums, shared verdicts, the leader's value."""
import torch
import torch.distributed as dist

from gdpo_megatron.distributed.collectives import PeerFailed, all_reduce_sums, any_rank, fail_together, leader_broadcast


def _score_on_the_leader(fails: bool):
    """What the trainer does with the leader's rewards: every rank learns of a failure, the
    others get the leader's value."""
    cpu = torch.device("cpu")

    def score():
        if dist.get_rank() == 0:
            if fails:
                raise RuntimeError("reward pool died")
            return 3
        return None

    try:
        return ("value", leader_broadcast(fail_together(score, cpu), dist.group.WORLD))
    except PeerFailed as e:
        return ("peer failed", str(e))
    except RuntimeError as e:
        return ("own error", str(e))


def _reduce(values, flagging_rank):
    cpu = torch.device("cpu")
    return all_reduce_sums(values, cpu), any_rank(dist.get_rank() == flagging_rank, cpu)


def test_a_failure_on_one_rank_reaches_every_rank_instead_of_hanging(gloo_world_2):
    assert gloo_world_2.run(_score_on_the_leader, False) == [("value", 3), ("value", 3)]
    leader, follower = gloo_world_2.run(_score_on_the_leader, True)
    assert leader == ("own error", "reward pool died")
    assert follower == ("peer failed", "another rank failed in this step (its error is in its log)")


def test_sums_and_flags_cover_every_rank(gloo_world_2):
    assert gloo_world_2.run(_reduce, [1.5, 2.0, 1e-9], None) == [([3.0, 4.0, 2e-9], False)] * 2
    assert gloo_world_2.run(_reduce, [1.0], 1) == [([2.0], True)] * 2
