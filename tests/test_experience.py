"""A step's experience: prompt order and policy-batch layout."""
import pytest
import torch

from gdpo_megatron.experience import PromptSchedule, Rollouts, to_policy_batch
from gdpo_megatron.rollout.engine import Completion


def test_prompt_schedule_walks_through_shuffled_epochs_and_depends_on_the_step_only():
    schedule = PromptSchedule(num_samples=5, prompts_per_step=3, seed=7)
    steps = [schedule.indices(s) for s in range(5)]  # 15 positions = 3 epochs of 5
    flat = [i for step in steps for i in step]
    for epoch in range(3):
        assert sorted(flat[5 * epoch : 5 * epoch + 5]) == [0, 1, 2, 3, 4]
    assert flat[:5] != flat[5:10]  # each epoch has its own order
    assert PromptSchedule(5, 3, seed=7).indices(3) == steps[3]  # a resumed run sees the same prompts


def test_policy_batch_places_tokens_logprobs_and_loss_mask():
    completions = [Completion([7, 8], [-0.5, -0.25], "stop"), Completion([9], [-1.0], "length"),
                   Completion([4, 5, 6], [-0.1, -0.2, -0.3], "stop"), Completion([3], [-2.0], "stop")]
    rollouts = Rollouts(prompt_ids=[[1, 2, 3], [5]], group_ids=torch.tensor([0, 0, 1, 1]), completions=completions)
    batch = to_policy_batch(rollouts, 2, torch.tensor([1.0, -1.0, 0.5, -0.5]),
                            keep=torch.tensor([True, True, True, False]), pad_id=0, pad_multiple=4)
    assert batch.input_ids.tolist() == [[1, 2, 3, 7, 8, 0, 0, 0], [1, 2, 3, 9, 0, 0, 0, 0],
                                        [5, 4, 5, 6, 0, 0, 0, 0], [5, 3, 0, 0, 0, 0, 0, 0]]
    assert batch.loss_mask.int().tolist() == [[0, 0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 1, 0, 0, 0, 0],
                                              [0, 1, 1, 1, 0, 0, 0, 0], [0] * 8]
    # rollout_logprobs[i, t] belongs to the target input_ids[i, t + 1]
    assert batch.rollout_logprobs[0, 2:4].tolist() == [-0.5, -0.25]
    assert batch.rollout_logprobs[2, 0:3].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert batch.rollout_logprobs[3, 0].item() == -2.0
    assert batch.lengths.tolist() == [5, 4, 4, 2]  # prompt + completion, before the padding
    batch.validate(vocab_size=16)
