"""Token-budget micro-batches: which rows go together, their widths, and the way back; the
positions a batch keeps from its first target on."""
import pytest
import torch

from gdpo_megatron.policy.batch import PolicyBatch, merge_rows

LENGTHS = [5, 12, 3, 12, 7, 2, 9, 4]  # tokens before padding; T = 12


def batch() -> PolicyBatch:
    T = 12
    lengths = torch.tensor(LENGTHS)
    pos = torch.arange(T)
    ids = torch.where(pos < lengths[:, None], torch.arange(1, len(LENGTHS) + 1)[:, None] * 100 + pos, 0)
    mask = (pos >= 1) & (pos < lengths[:, None])
    old = -(torch.arange(len(LENGTHS))[:, None] + pos[:-1] / 100.0)
    return PolicyBatch(ids, mask, torch.arange(len(LENGTHS), dtype=torch.float32), old_logprobs=old, lengths=lengths)


def test_rows_are_packed_longest_first_within_the_budget_and_cut_to_their_width():
    order, micro = batch().split_by_tokens(24)
    # sorted lengths 12, 12, 9, 7, 5, 4, 3, 2 -> [12, 12] (24), [9, 7] (18; a third row: 27),
    # [5, 4, 3, 2] (20; a fifth row would not exist)
    assert order.tolist() == [1, 3, 6, 4, 0, 7, 2, 5]
    assert [tuple(m.input_ids.shape) for m in micro] == [(2, 12), (2, 9), (4, 5)]
    start = 0
    for m in micro:
        rows = order[start : start + m.size]
        width = m.seq_length
        torch.testing.assert_close(m.input_ids, batch().input_ids[rows, :width], rtol=0, atol=0)
        torch.testing.assert_close(m.loss_mask, batch().loss_mask[rows, :width], rtol=0, atol=0)
        torch.testing.assert_close(m.old_logprobs, batch().old_logprobs[rows, : width - 1], rtol=0, atol=0)
        torch.testing.assert_close(m.advantages, batch().advantages[rows], rtol=0, atol=0)
        assert m.lengths.max() == width
        m.validate(vocab_size=1000)
        start += m.size
    # every completion token is in exactly one micro-batch
    assert sum(int(m.loss_mask.sum()) for m in micro) == int(batch().loss_mask.sum())


def test_widths_round_up_to_the_multiple_and_a_row_over_budget_goes_alone():
    # widths 12, 12, 12 (9), 8 (7), 8 (5), 4, 4 (3), 4 (2): two rows fit only at width 4
    order, micro = batch().split_by_tokens(10, pad_multiple=4)
    assert [tuple(m.input_ids.shape) for m in micro] == [(1, 12), (1, 12), (1, 12), (1, 8), (1, 8), (2, 4), (1, 4)]
    assert order.tolist() == [1, 3, 6, 4, 0, 7, 2, 5]


def test_without_lengths_every_row_counts_as_full_width():
    b = batch()
    b.lengths = None
    order, micro = b.split_by_tokens(30)
    assert order.tolist() == list(range(8)) and [m.size for m in micro] == [2, 2, 2, 2]
    assert {m.seq_length for m in micro} == {12}


def test_from_the_first_target_keeps_every_target_and_its_columns():
    b = batch()
    b.loss_mask[:, :4] = False  # prompts of 4 tokens at least; row 3's of 6
    b.loss_mask[3, :6] = False
    assert int(b.first_target()) == 3  # target column 3 predicts position 4
    part = b.from_position(3)
    assert part.seq_length == 9 and part.target_mask.shape == (8, 8)
    torch.testing.assert_close(part.input_ids, b.input_ids[:, 3:], rtol=0, atol=0)
    torch.testing.assert_close(part.old_logprobs, b.old_logprobs[:, 3:], rtol=0, atol=0)
    assert part.lengths.tolist() == [max(n - 3, 0) for n in LENGTHS]
    assert int(part.target_mask.sum()) == int(b.target_mask.sum())  # no target left out
    assert not bool(part.loss_mask[:, 0].any())
    none = batch()
    none.loss_mask[:] = False
    assert int(none.first_target()) == 0


def test_merge_rows_puts_each_micro_batch_back_in_batch_order():
    b = batch()
    order, micro = b.split_by_tokens(24)
    merged = merge_rows(order, [m.old_logprobs for m in micro], (b.size, b.seq_length - 1))
    inside = torch.arange(b.seq_length - 1) < (b.lengths - 1)[:, None]
    torch.testing.assert_close(merged[inside], b.old_logprobs[inside], rtol=0, atol=0)


@pytest.mark.parametrize("lengths,match", [
    (torch.tensor([5, 12, 3, 12, 7, 2, 9]), "batch.lengths: expected int64 \\(8,\\)"),
    (torch.tensor([5, 13, 3, 12, 7, 2, 9, 4]), "values in \\[2, 12\\]"),
    (torch.tensor([5, 11, 3, 12, 7, 2, 9, 4]), "loss_mask: True past a row's length"),
])
def test_bad_lengths_are_named(lengths, match):
    b = batch()
    b.lengths = lengths
    with pytest.raises(ValueError, match=match):
        b.validate(vocab_size=1000)
