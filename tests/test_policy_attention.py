"""The local spec's core attention: the causal softmax attention, with memory linear in the length."""
import math

import pytest
import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType

from gdpo_megatron.policy.attention import SDPAttention


def config(heads=4, groups=4, head_dim=8, **overrides) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                             num_query_groups=groups, kv_channels=head_dim, attention_dropout=0.0,
                             hidden_dropout=0.0, **overrides)


def attention(cfg: TransformerConfig, **kwargs) -> SDPAttention:
    return SDPAttention(cfg, layer_number=1, attn_mask_type=kwargs.pop("mask", AttnMaskType.causal),
                        attention_type="self", **kwargs)


def reference(query, key, value):
    """Causal softmax attention written out, each query head reading its group's key and value."""
    sequence, batch, heads, head_dim = query.shape
    repeat = heads // key.shape[2]
    key, value = key.repeat_interleave(repeat, dim=2), value.repeat_interleave(repeat, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", query, key) / math.sqrt(head_dim)
    future = torch.ones(sequence, sequence, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,kbhd->qbhd", probs, value).reshape(sequence, batch, heads * head_dim)


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (4, 1)])
def test_output_and_gradients_equal_the_written_out_attention(heads, groups):
    torch.manual_seed(0)
    sequence, batch, head_dim = 7, 3, 8
    inputs = [torch.randn(sequence, batch, n, head_dim, dtype=torch.float64, requires_grad=True)
              for n in (heads, groups, groups)]
    grad = torch.randn(sequence, batch, heads * head_dim, dtype=torch.float64)

    out = attention(config(heads, groups, head_dim))(*inputs, None)
    grads = torch.autograd.grad(out, inputs, grad)
    expected = reference(*inputs)
    expected_grads = torch.autograd.grad(expected, inputs, grad)

    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_what_backward_keeps_grows_linearly_with_the_sequence():
    """megatron's unfused attention keeps the [b, heads, s, s] probabilities for backward; this
    one keeps the inputs, the output and a log-sum-exp per query."""
    heads, head_dim, batch = 4, 16, 2
    layer = attention(config(heads, 2, head_dim))

    def saved_bytes(sequence: int) -> int:
        total = 0

        def pack(tensor):
            nonlocal total
            total += tensor.numel() * tensor.element_size()
            return tensor

        q = torch.randn(sequence, batch, heads, head_dim, requires_grad=True)
        k, v = (torch.randn(sequence, batch, 2, head_dim, requires_grad=True) for _ in range(2))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            layer(q, k, v, None)
        return total

    short, long = saved_bytes(128), saved_bytes(512)
    assert long == 4 * short
    probabilities = batch * heads * 512 * 512 * 4
    assert long < probabilities / 8


@pytest.mark.parametrize("change,name", [
    ({"cfg": {"window_size": (8, 0)}}, "window_size"),
    ({"cfg": {"softmax_type": "off-by-one"}}, "softmax_type"),
    ({"cfg": {"apply_query_key_layer_scaling": True}}, "apply_query_key_layer_scaling"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"mask": AttnMaskType.padding}, "attn_mask_type"),
])
def test_what_it_does_not_compute_is_refused_by_name(change, name):
    with pytest.raises(ValueError, match=name):
        attention(config(**change.pop("cfg", {})), **change)


def test_an_explicit_mask_is_refused():
    layer = attention(config())
    q = torch.randn(3, 1, 4, 8)
    with pytest.raises(ValueError, match="attention_mask"):
        layer(q, q, q, torch.zeros(1, 1, 3, 3, dtype=torch.bool))
