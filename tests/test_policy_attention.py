"""The local spec's core attention: the causal softmax attention, with memory linear in the length."""
import math

import pytest
import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType

from gdpo_megatron.policy.attention import SDPAttention
from support.placement import this_rank


def config(heads=4, groups=4, head_dim=8, hidden=None, **overrides) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=hidden or heads * head_dim, num_attention_heads=heads,
                             num_query_groups=groups, kv_channels=head_dim, attention_dropout=0.0,
                             hidden_dropout=0.0, **overrides)


def attention(cfg: TransformerConfig, **kwargs) -> SDPAttention:
    return SDPAttention(cfg, layer_number=1, attn_mask_type=kwargs.pop("mask", AttnMaskType.causal),
                        attention_type="self", **kwargs)


def reference(query, key, value, scale=None):
    """Causal softmax attention written out, each query head reading its group's key and value."""
    sequence, batch, heads, head_dim = query.shape
    repeat = heads // key.shape[2]
    key, value = key.repeat_interleave(repeat, dim=2), value.repeat_interleave(repeat, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", query, key) * (scale or 1 / math.sqrt(head_dim))
    future = torch.ones(sequence, sequence, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,kbhd->qbhd", probs, value).reshape(sequence, batch, heads * head_dim)


@pytest.mark.parametrize("heads,groups,hidden,scale", [
    (4, 4, None, None), (4, 2, None, None), (4, 1, None, None),
    (4, 2, 16, None),  # kv_channels (8) is not hidden / heads (4)
    (4, 2, None, 0.37),  # a softmax scale from the config
])
def test_output_and_gradients_equal_the_written_out_attention(heads, groups, hidden, scale):
    torch.manual_seed(0)
    sequence, batch, head_dim = 7, 3, 8
    inputs = [torch.randn(sequence, batch, n, head_dim, dtype=torch.float64, requires_grad=True)
              for n in (heads, groups, groups)]
    grad = torch.randn(sequence, batch, heads * head_dim, dtype=torch.float64)

    out = attention(config(heads, groups, head_dim, hidden), softmax_scale=scale)(*inputs, None)
    grads = torch.autograd.grad(out, inputs, grad)
    expected = reference(*inputs, scale)
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
    change = dict(change)
    with pytest.raises(ValueError, match=name):
        attention(config(**change.pop("cfg", {})), **change)


@pytest.mark.parametrize("call", [
    lambda layer, q: layer(q, q, q, torch.zeros(1, 1, 3, 3, dtype=torch.bool)),
    lambda layer, q: layer(q, q, q, None, attention_bias=torch.zeros(1, 4, 3, 3)),
    lambda layer, q: layer(q[-1:], q, q, None),  # one query against a cache of three keys
    lambda layer, q: layer(q, q, q, None, attn_mask_type=AttnMaskType.no_mask),
])
def test_masks_biases_and_cached_keys_are_refused(call):
    with pytest.raises(ValueError, match="causal self-attention over the whole sequence"):
        call(attention(config()), torch.randn(3, 1, 4, 8))


def policy_logits_and_grads(megatron_attention: bool) -> tuple[torch.Tensor, dict]:
    """A small GQA policy built the project's way (or with megatron's core attention swapped
    in), its logits on fixed tokens and the gradients of a fixed function of them."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from gdpo_megatron.policy import cpu_compat, model
    from gdpo_megatron.config.policy import ModelConfig, ParallelConfig
    from support.policy import precision_here

    config = ModelConfig(vocab_size=96, hidden_size=64, ffn_hidden_size=128, num_layers=2, num_attention_heads=4,
                         num_query_groups=2, max_position_embeddings=64)
    placement = this_rank()
    model.initialize_model_parallel(ParallelConfig(), seed=3)
    project_attention = model.SDPAttention
    try:
        if megatron_attention:
            model.SDPAttention = DotProductAttention
        gpt = model.build_model(config, placement, ParallelConfig(), precision_here())
        kinds = {type(layer.self_attention.core_attention) for layer in gpt.decoder.layers}
        assert kinds == {DotProductAttention if megatron_attention else project_attention}
        tokens = torch.randint(0, config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))
        weights = torch.randn(3, 24, gpt.vocab_size, generator=torch.Generator().manual_seed(1))
        with cpu_compat.device_scope():
            logits = gpt(tokens, torch.arange(24).expand(3, 24), None)
            (logits * weights).sum().backward()
        return logits.detach(), {name: p.grad for name, p in gpt.named_parameters()}
    finally:
        model.SDPAttention = project_attention
        model.destroy_model_parallel()


def test_the_policy_runs_it_and_matches_megatrons_attention():
    from support.local_world import LocalWorld

    with LocalWorld(1) as world:
        (logits, grads), = world.run(policy_logits_and_grads, False)
        (expected_logits, expected_grads), = world.run(policy_logits_and_grads, True)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-5, msg=name)
