"""The policy update under every parallel layout equals one plain PyTorch computation.

The expected values come from the same GPTModel run forward by hand on the whole batch, with
``log_softmax`` logprobs, the clipped loss written out below, ``autograd``, and the first
Adam step written out below. Megatron runs (its forward-backward schedules, DDP, optimizer,
vocab-parallel logprobs) must match them at TP=1 with uneven data-parallel shards, TP=2 (with
and without sequence parallelism), PP=2 (1F1B over 4 micro-batches) and TP=2 x PP=2, for the
tiny Llama, its tied-embedding variant and a Qwen2-like GQA model with QKV bias.

The weight helpers below are written from megatron's tensor attributes (``partition_dim``,
``partition_stride``, the global ``layer_number``), independently of the project's checkpoint
conversion, so that every layout starts from, and is compared on, the same full weights.
"""
import contextlib
import math
import re

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from gdpo_megatron.policy import cpu_compat
from gdpo_megatron.policy.batch import PolicyBatch
from gdpo_megatron.config.policy import (
    LossConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PolicyConfig,
    PrecisionConfig,
)
from gdpo_megatron.policy.model import build_model, destroy_model_parallel, initialize_model_parallel
from gdpo_megatron.policy.worker import PolicyWorker
from support.placement import this_rank
from support.policy import precision_here, resolved_here

VOCAB = 500  # padded to 512 rows: the padding must stay out of every softmax
B, T = 8, 16
# eps well above float noise: a gradient that is ~0 in one layout and ~1e-9 in another
# must not turn into opposite Adam updates of size lr.
OPTIM = dict(lr=1e-3, weight_decay=0.01, adam_eps=1e-6, clip_grad=1.0)
SEED = 1234  # the worker's default seed


# Model variants: the tiny Llama, the same with tied embeddings, and a Qwen2-like one (GQA with
# 4 query heads in 2 groups, QKV bias, another RoPE base and norm epsilon).
MODELS = {
    "llama": dict(),
    "llama-tied": dict(tie_word_embeddings=True),
    "qwen2-gqa": dict(hidden_size=256, ffn_hidden_size=512, num_attention_heads=4, num_query_groups=2,
                      add_qkv_bias=True, rotary_base=1e6, norm_epsilon=1e-6),
}


def tiny_config(tp=1, pp=1, sp=False, mbs=2, model="llama", loss=None, optim=None, **kwargs) -> PolicyConfig:
    """Micro-batches of ``mbs`` consecutive rows unless ``micro_batch_tokens`` says otherwise."""
    kwargs.setdefault("micro_batch_tokens", None)
    return PolicyConfig(
        model=ModelConfig.preset("tiny", vocab_size=VOCAB, **MODELS[model]),
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp),
        optim=OptimConfig(**{**OPTIM, **(optim or {})}),
        loss=LossConfig(**(loss or {})),
        micro_batch_size=mbs,
        **kwargs,
    )


def make_batch(seed=0) -> PolicyBatch:
    """Prompts of 3-6 tokens, completions of uneven length (the first half much longer)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    prompt = torch.randint(3, 7, (B,), generator=g)
    completion = torch.tensor([10, 9, 8, 9, 3, 2, 4, 1])
    pos = torch.arange(T).unsqueeze(0)
    mask = (pos >= prompt.unsqueeze(1)) & (pos < (prompt + completion).clamp(max=T).unsqueeze(1))
    ids = torch.where(pos < (prompt + completion).unsqueeze(1), ids, 0)  # right padding
    # rollout-engine logprobs near the model's (~log 1/500) with spread: clipping on both sides
    old = -6.2 + 0.4 * torch.randn(B, T - 1, generator=g)
    adv = torch.randn(B, generator=g)
    return PolicyBatch(ids, mask, adv, rollout_logprobs=old, lengths=(prompt + completion).clamp(max=T))


def data_parallel_share(batch: PolicyBatch) -> PolicyBatch:
    """This rank's contiguous share of the batch by data-parallel rank."""
    rank, size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    rows = batch.size // size
    return batch.slice(rank * rows, (rank + 1) * rows)


def global_name(model, name: str) -> str:
    """Parameter name with the pipeline stage's local layer index made global."""
    match = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if not match:
        return name
    layer = model.decoder.layers[int(match.group(1))]
    return f"decoder.layers.{layer.layer_number - 1}.{match.group(2)}"


def _tp_chunks(param):
    return parallel_state.get_tensor_model_parallel_world_size() * getattr(param, "partition_stride", 1)


def full_state(model) -> dict:
    """This stage's parameters as full (TP-gathered) tensors under global names."""
    group = parallel_state.get_tensor_model_parallel_group()
    tp = dist.get_world_size(group)
    out = {}
    for name, param in model.named_parameters():
        tensor = param.detach()
        if getattr(param, "tensor_model_parallel", False) and tp > 1:
            shards = [torch.empty_like(tensor) for _ in range(tp)]
            dist.all_gather(shards, tensor.contiguous(), group=group)
            stride, dim = getattr(param, "partition_stride", 1), param.partition_dim
            pieces = [s.chunk(stride, dim=dim) for s in shards]
            tensor = torch.cat([pieces[r][j] for j in range(stride) for r in range(tp)], dim=dim)
        out[global_name(model, name)] = tensor.clone()
    return out


def loader(full: dict):
    """``init_weights`` callback copying this rank's shard of ``full`` into the model."""

    def load(model):
        rank = parallel_state.get_tensor_model_parallel_rank()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        with torch.no_grad():
            for name, param in model.named_parameters():
                key = global_name(model, name)
                if key not in full and key == "output_layer.weight":  # tied copy on the last stage
                    key = "embedding.word_embeddings.weight"
                tensor = full[key]
                if getattr(param, "tensor_model_parallel", False) and tp > 1:
                    chunks = tensor.chunk(_tp_chunks(param), dim=param.partition_dim)
                    tensor = torch.cat(chunks[rank::tp], dim=param.partition_dim)
                param.copy_(tensor)

    return load


def merge_stages(states: list) -> dict:
    """One dict from the per-rank dicts of a pipelined run (ranks agree where they overlap)."""
    merged = {}
    for state in states:
        for name, tensor in state.items():
            if name in merged:
                torch.testing.assert_close(tensor, merged[name], rtol=0, atol=0)
            merged[name] = tensor
    return merged


# ---- functions run on every rank of a local world --------------------------------------

def initial_weights(model: str) -> dict:
    """Full weights of a freshly built (seeded) model."""
    config, placement = tiny_config(model=model), this_rank()
    initialize_model_parallel(config.parallel, SEED)
    try:
        return full_state(build_model(config.model, placement, config.parallel, precision_here(config.precision)))
    finally:
        destroy_model_parallel()


def plain_step(full: dict, loss: dict, model: str) -> dict:
    """Expected logprobs, loss, gradient norm and weights after one step, in plain PyTorch."""
    config, placement = tiny_config(model=model, loss=loss), this_rank()
    initialize_model_parallel(config.parallel, SEED)
    try:
        model = build_model(config.model, placement, config.parallel, precision_here(config.precision))
        loader(full)(model)
        batch = make_batch()
        with cpu_compat.device_scope():
            logits = model(batch.input_ids, torch.arange(T).expand(B, T), None)
            logp = torch.log_softmax(logits[:, :-1, :VOCAB], dim=-1)
            logprobs = logp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
            mask = batch.loss_mask[:, 1:]
            ratio = torch.where(mask, logprobs - batch.rollout_logprobs, 0.0).exp()
            adv = batch.advantages[:, None]
            low, high = config.loss.ratio_clip_low, config.loss.ratio_clip_high
            per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - low, 1 + high)) * mask
            if config.loss.loss_agg_mode == "token_mean":
                loss_value = per_token.sum() / mask.sum()
            else:
                loss_value = (per_token.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / (mask.sum(-1) > 0).sum()
            loss_value.backward()
        params = dict(model.named_parameters())
        grad_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in params.values())).item()
        optim = config.optim
        scale = min(1.0, optim.clip_grad / (grad_norm + 1e-6))
        after = {}
        for name, p in params.items():
            g = p.grad * scale
            decay = 0.0 if p.dim() == 1 else optim.weight_decay  # no decay on norms
            # First Adam step: the bias-corrected moments are g and g**2.
            after[name] = p.detach() * (1 - optim.lr * decay) - optim.lr * g / (g.abs() + optim.adam_eps)
        clipped = (torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - low, 1 + high)) > -adv * ratio) & mask
        return dict(logprobs=logprobs.detach(), loss=loss_value.item(), grad_norm=grad_norm, weights=after,
                    clip_fraction=(clipped.sum() / mask.sum()).item())
    finally:
        destroy_model_parallel()


@contextlib.contextmanager
def worker_with_batch(full: dict, config_kwargs: dict, split: bool):
    """A worker on ``full`` weights, the logprobs of the whole batch, and this rank's batch
    (its data-parallel share when ``split``)."""
    with PolicyWorker(resolved_here(tiny_config(**config_kwargs)), this_rank(), init_weights=loader(full)) as worker:
        batch = make_batch()
        logprobs = worker.compute_logprobs(batch)
        yield worker, logprobs, data_parallel_share(batch) if split else batch


def megatron_steps(full: dict, config_kwargs: dict, split: bool, steps: int = 1) -> dict:
    """Logprobs of the whole batch, then ``steps`` train steps on this rank's batch."""
    with worker_with_batch(full, config_kwargs, split) as (worker, logprobs, batch):
        metrics = [worker.train_step(batch) for _ in range(steps)]
        return dict(logprobs=logprobs, metrics=metrics, weights=full_state(worker.gpt_model))


# ---- tests -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def initial(gloo_world_2):
    """Initial full weights of each model variant (from rank 0; every rank built the same)."""
    return {model: gloo_world_2.run(initial_weights, model)[0] for model in MODELS}


@pytest.fixture(scope="module")
def expected(gloo_world_2, initial):
    cache = {}

    def get(agg="token_mean", model="llama"):
        if (agg, model) not in cache:
            cache[agg, model] = gloo_world_2.run(plain_step, initial[model], dict(loss_agg_mode=agg), model)[0]
        return cache[agg, model]

    return get


def check_matches(results, want):
    weights = merge_stages([r["weights"] for r in results])
    if "output_layer.weight" not in want["weights"] and "output_layer.weight" in weights:
        # the last pipeline stage's copy of the tied embedding must have followed it
        embedding = want["weights"]["embedding.word_embeddings.weight"]
        torch.testing.assert_close(weights.pop("output_layer.weight"), embedding, rtol=0, atol=1e-5)
    assert weights.keys() == want["weights"].keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, want["weights"][name], rtol=0, atol=1e-5, msg=name)
    for r in results:
        torch.testing.assert_close(r["logprobs"], want["logprobs"], rtol=0, atol=1e-5)
        metrics = r["metrics"][0]
        assert metrics["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-6)
        assert metrics["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        assert metrics["clip_fraction"] == pytest.approx(want["clip_fraction"], abs=1e-6)


LAYOUTS_2 = {
    "tp1-dp2-uneven-shards": (dict(), True),
    "tp2": (dict(tp=2), False),
    "tp2-sequence-parallel": (dict(tp=2, sp=True), False),
    "pp2-1f1b-4-micro-batches": (dict(pp=2), False),
}


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("layout", LAYOUTS_2)
def test_update_matches_plain_pytorch(gloo_world_2, initial, expected, layout, agg):
    config_kwargs, split = LAYOUTS_2[layout]
    want = expected(agg)
    assert 0.2 < want["clip_fraction"] < 0.8 and want["grad_norm"] > OPTIM["clip_grad"]  # clipping is exercised
    results = gloo_world_2.run(megatron_steps, initial["llama"], {**config_kwargs, "loss": dict(loss_agg_mode=agg)},
                               split)
    check_matches(results, want)


@pytest.mark.parametrize("model,layout", [
    ("llama-tied", "tp2"), ("llama-tied", "pp2-1f1b-4-micro-batches"), ("qwen2-gqa", "tp2"),
    ("qwen2-gqa", "tp1-dp2-uneven-shards")])
def test_other_model_variants_match_plain_pytorch(gloo_world_2, initial, expected, model, layout):
    config_kwargs, split = LAYOUTS_2[layout]
    results = gloo_world_2.run(megatron_steps, initial[model], {**config_kwargs, "model": model}, split)
    check_matches(results, expected(model=model))


def test_tp2_pp2_update_matches_plain_pytorch(gloo_world_4, initial, expected):
    results = gloo_world_4.run(megatron_steps, initial["llama"], dict(tp=2, pp=2, mbs=1), False)
    check_matches(results, expected())


def one_backward(full: dict, config_kwargs: dict, split: bool) -> dict:
    """Gradients (after megatron's finalize: DP all-reduce, division by the global token
    count), metrics and logprobs of one forward-backward, plus the micro-batch shapes."""
    with worker_with_batch(full, config_kwargs, split) as (worker, logprobs, batch):
        worker.model.zero_grad_buffer()
        _, micro_batches = worker._split(batch)
        outputs = worker._run(worker.model, micro_batches, worker._loss, forward_only=False)
        grads = {global_name(worker.gpt_model, n): p.main_grad.clone() for n, p in worker.gpt_model.named_parameters()}
        return dict(grads=grads, metrics=worker._reduce_metrics(outputs), logprobs=logprobs,
                    shapes=[tuple(m.input_ids.shape) for m in micro_batches])


TOKEN_BUDGET_LAYOUTS = {
    "tp1-dp2-uneven-shards": (dict(), True),
    "tp2-sequence-parallel": (dict(tp=2, sp=True), False),
    "pp2-1f1b": (dict(pp=2), False),
}


@pytest.mark.parametrize("layout,agg", [
    ("tp1-dp2-uneven-shards", "seq_mean_token_mean"), ("tp2-sequence-parallel", "token_mean"),
    ("pp2-1f1b", "token_mean"), ("pp2-1f1b", "seq_mean_token_mean")])
def test_token_budget_micro_batches_give_the_loss_and_gradients_of_fixed_ones(gloo_world_2, initial, layout, agg):
    """Micro-batches of at most 40 tokens (rows sorted by length, each cut to its longest row)
    against 2 rows each at full width: same loss, metrics, gradients and logprobs up to fp32
    summation order."""
    config_kwargs, split = TOKEN_BUDGET_LAYOUTS[layout]
    common = {**config_kwargs, "loss": dict(loss_agg_mode=agg)}
    fixed = gloo_world_2.run(one_backward, initial["llama"], {**common, "mbs": 2}, split)
    budget = gloo_world_2.run(one_backward, initial["llama"], {**common, "micro_batch_tokens": 40}, split)
    lengths, mask = make_batch().lengths, make_batch().target_mask
    assert len({width for b in budget for _, width in b["shapes"]}) > 1  # widths follow the rows' lengths
    for f, b in zip(fixed, budget):
        assert all(rows * width <= 40 or rows == 1 for rows, width in b["shapes"])
        assert sum(r * w for r, w in b["shapes"]) < sum(r * w for r, w in f["shapes"])  # less padding
        assert f["grads"].keys() == b["grads"].keys()
        for name, grad in f["grads"].items():
            assert grad.abs().max() > 0, name
            # fp32, other GEMM shapes: entries agree to ~1e-5 of the tensor's largest one
            scale = grad.abs().max().item()
            torch.testing.assert_close(b["grads"][name], grad, rtol=1e-5, atol=1e-5 * scale, msg=name)
        for key, value in f["metrics"].items():
            assert b["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
        inside = torch.arange(T - 1) < (lengths - 1).unsqueeze(1)  # targets before each row's padding
        torch.testing.assert_close(b["logprobs"][inside], f["logprobs"][inside], rtol=0, atol=1e-5)
        assert mask[~inside].sum() == 0  # padding: its logprobs mean nothing in either run


def output_layer_positions(full: dict, config_kwargs: dict) -> dict:
    """The sequence lengths the output layer computed logits for, per call, in
    compute_logprobs and in train_step (with a second epoch, whose old logprobs come from a
    forward pass of their own), and each micro-batch's first target from the loss mask."""
    with worker_with_batch(full, config_kwargs, split=False) as (worker, _, batch):
        seen, last_stage = [], worker.gpt_model.post_process  # a first pipeline stage has no output layer
        if last_stage:
            worker.gpt_model.output_layer.register_forward_hook(lambda _, args, out: seen.append(out[0].shape[0]))
        worker.compute_logprobs(batch)
        every, seen[:] = list(seen), []
        worker.train_step(batch)
    if not last_stage:
        return None
    rows = config_kwargs["mbs"]
    firsts = [int(batch.loss_mask[r : r + rows].any(0).nonzero()[0]) - 1 for r in range(0, B, rows)]
    return dict(every=every, train=seen, firsts=firsts)


@pytest.mark.parametrize("layout", ["tp2", "tp2-sequence-parallel", "pp2-1f1b-4-micro-batches"])
def test_the_update_computes_logits_from_each_micro_batchs_first_target(gloo_world_2, initial, layout):
    """The update's passes (old logprobs, then the training pass) compute logits from each
    micro-batch's first target on, compute_logprobs at every position; under sequence
    parallelism every pass takes every position. That the update is unchanged by it is
    test_update_matches_plain_pytorch (its reference computes logits everywhere)."""
    config_kwargs = {**LAYOUTS_2[layout][0], "mbs": 2, "ppo_epochs": 2}
    results = [r for r in gloo_world_2.run(output_layer_positions, initial["llama"], config_kwargs) if r]
    assert len(results) == (1 if "pp2" in layout else 2)
    for result in results:
        firsts = result["firsts"]
        assert min(firsts) >= 2 and len(set(firsts)) > 1  # the windows differ by micro-batch
        assert result["every"] == [T] * len(firsts)
        if config_kwargs.get("sp"):
            assert result["train"] == [T] * 2 * len(firsts)
        else:
            assert result["train"] == [T - first for first in firsts] * 2


def positions_when_tp_ranks_differ(full: dict) -> list[int]:
    """TP=2, one micro-batch, where rank 1's completions all start 3 tokens later than rank 0's
    first: the output layer's sequence lengths on this rank."""
    with PolicyWorker(resolved_here(tiny_config(tp=2, mbs=B)), this_rank(), init_weights=loader(full)) as worker:
        batch = make_batch()
        if dist.get_rank() == 1:
            batch.loss_mask[:, : int(batch.loss_mask.any(0).nonzero()[0]) + 3] = False
        seen = []
        handle = worker.gpt_model.output_layer.register_forward_hook(lambda _, args, out: seen.append(out[0].shape[0]))
        worker.train_step(batch)
        handle.remove()
        return seen


def test_tensor_parallel_ranks_take_the_earliest_first_target_of_their_group(gloo_world_2, initial):
    """The vocab-parallel logprobs reduce over the TP group, so its ranks must cut the same
    positions even when their batches disagree (a caller's bug, which must not hang them)."""
    first = int(make_batch().loss_mask.any(0).nonzero()[0]) - 1
    assert gloo_world_2.run(positions_when_tp_ranks_differ, initial["llama"]) == [[T - first]] * 2


def test_ppo_epochs_recompute_old_logprobs_and_kl_enters_the_loss(gloo_world_2, initial):
    """Two epochs per batch; the batch's rollout logprobs are far from the policy's.

    Epoch 1 must use recomputed old logprobs (ratio 1), so epoch 2 sees ratios near 1. The KL
    gradient is zero while policy == reference, so both runs share the weights of epoch 2 and
    their losses differ by exactly kl_coef * KL.
    """
    kl_coef = 0.5
    # a small step: epoch 2's ratios stay near 1
    common = dict(ppo_epochs=2, optim=dict(lr=1e-4), old_logprobs="policy")
    runs = {}
    for name, kwargs, split in [
        ("tp1-dp2", dict(), True), ("tp2", dict(tp=2), False), ("pp2", dict(pp=2), False)]:
        runs[name] = gloo_world_2.run(megatron_steps, initial["llama"],
                                      {**kwargs, **common, "loss": dict(kl_coef=kl_coef)}, split)
    without_kl = gloo_world_2.run(megatron_steps, initial["llama"], common, True)[0]["metrics"][0]

    reference = merge_stages([r["weights"] for r in runs["tp1-dp2"]])
    for name in ("tp2", "pp2"):
        weights = merge_stages([r["weights"] for r in runs[name]])
        for key, tensor in weights.items():
            torch.testing.assert_close(tensor, reference[key], rtol=0, atol=1e-5, msg=f"{name}: {key}")
    metrics = runs["tp1-dp2"][0]["metrics"][0]
    for name in ("tp2", "pp2"):
        other = runs[name][0]["metrics"][0]
        for key in ("loss", "kl_ref", "ratio_mean", "approx_kl"):
            assert other[key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-8), (name, key)

    # The batch's rollout logprobs would give ratios of 0.5-2 (see make_batch) and clip ~1/3 of tokens.
    assert abs(metrics["ratio_mean"] - 1) < 0.05 and 0.75 < metrics["ratio_min"] and metrics["ratio_max"] < 1.3
    assert metrics["clip_fraction"] < 0.1 and metrics["approx_kl"] > 0
    assert metrics["kl_ref"] > 0 and without_kl["kl_ref"] == 0.0
    assert metrics["loss"] - without_kl["loss"] == pytest.approx(kl_coef * metrics["kl_ref"], rel=1e-4)


def test_recomputed_old_logprobs_start_at_ratio_one_and_tis_weighs_the_mismatch(gloo_world_2, initial, expected):
    """old_logprobs: policy with tis_cap, against the plain PyTorch logprobs: the ratio is 1 on every
    token, the mismatch metric is |policy - rollout|, and each token's loss is -A * min(exp(policy -
    rollout), cap)."""
    cap = 1.5
    want = expected()
    results = gloo_world_2.run(megatron_steps, initial["llama"], dict(old_logprobs="policy", loss=dict(tis_cap=cap)),
                               True)
    batch = make_batch()
    mask = batch.target_mask
    log_weights = (want["logprobs"] - batch.rollout_logprobs)[mask]
    weights = log_weights.exp()
    assert (weights > cap).any() and (weights < 1).any()
    token_advantages = batch.advantages[:, None].expand_as(mask)[mask]
    for r in results:
        metrics = r["metrics"][0]
        assert metrics["ratio_min"] == pytest.approx(1.0, abs=1e-6) == metrics["ratio_max"]
        assert metrics["logprob_mismatch"] == pytest.approx(log_weights.abs().mean().item(), rel=1e-5)
        assert metrics["tis_weight"] == pytest.approx(weights.clamp(max=cap).mean().item(), rel=1e-5)
        assert metrics["tis_truncated"] == pytest.approx((weights > cap).float().mean().item(), abs=1e-6)
        assert metrics["loss"] == pytest.approx(-(token_advantages * weights.clamp(max=cap)).mean().item(), rel=1e-5)


def offload_between_steps(full: dict, offload: bool) -> dict:
    """Two steps with the distributed optimizer; between them the memory given to the rollout
    engine: grad buffers freed (and the optimizer state moved to the host, a no-op on CPU)."""
    config = tiny_config(optim=dict(use_distributed_optimizer=True), offload_grads_and_optimizer=offload)
    with PolicyWorker(resolved_here(config), this_rank(), init_weights=loader(full)) as worker:
        batch = data_parallel_share(make_batch())
        worker.train_step(batch)
        worker.release_memory()
        grad_storage = [buffer.grad_data.untyped_storage().nbytes() for buffer in worker.model.buffers]
        offloaded = worker.offloaded
        metrics = worker.train_step(batch)  # Adam's second step: needs the first step's moments
        return dict(grad_storage=grad_storage, offloaded=offloaded, back=not worker.offloaded, metrics=metrics,
                    weights=full_state(worker.gpt_model))


def test_offloading_between_steps_frees_the_grad_buffers_and_changes_nothing(gloo_world_2, initial):
    kept, offloaded = (gloo_world_2.run(offload_between_steps, initial["llama"], o) for o in (False, True))
    for k, o in zip(kept, offloaded):
        assert not k["offloaded"] and all(size > 0 for size in k["grad_storage"])
        assert o["offloaded"] and o["back"] and o["grad_storage"] and all(size == 0 for size in o["grad_storage"])
        assert o["metrics"]["loss"] == k["metrics"]["loss"] and o["metrics"]["grad_norm"] == k["metrics"]["grad_norm"]
        for name, tensor in k["weights"].items():
            torch.testing.assert_close(o["weights"][name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("style", ["cosine", "constant"])
def test_learning_rate_warms_up_then_follows_its_schedule(gloo_world_2, initial, style):
    optim = dict(lr=1e-3, min_lr=1e-4, lr_warmup_steps=2, lr_decay_steps=4, lr_decay_style=style)
    result = gloo_world_2.run(megatron_steps, initial["llama"], dict(optim=optim, mbs=4), True, 6)[0]

    def expected(step):
        if step <= 2:
            return 1e-3 * step / 2
        if style == "constant":
            return 1e-3
        progress = min((step - 2) / (4 - 2), 1.0)
        return 1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + math.cos(math.pi * progress))

    assert [m["lr"] for m in result["metrics"]] == pytest.approx([expected(s) for s in range(6)], abs=1e-12)


def bf16_steps(full: dict, distributed_optimizer: bool) -> dict:
    # the batch's rollout logprobs as the old ones, as in the fp32 reference (bf16 would recompute)
    config = tiny_config(precision=PrecisionConfig(dtype="bf16"), old_logprobs="rollout",
                         optim=dict(use_distributed_optimizer=distributed_optimizer))
    with PolicyWorker(resolved_here(config), this_rank(), init_weights=loader(full)) as worker:
        dtypes = {p.dtype for p in worker.gpt_model.parameters()}
        metrics = worker.train_step(data_parallel_share(make_batch()))
        return dict(dtypes=dtypes, metrics=metrics, weights=full_state(worker.gpt_model))


def bf16_neighbours(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Whether each pair of bf16 values is equal or adjacent (one unit in the last place apart)."""

    def rank(t: torch.Tensor) -> torch.Tensor:  # bf16 bit patterns as integers in value order
        bits = t.view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (rank(a) - rank(b)).abs() <= 1


def test_bf16_step_tracks_fp32_with_either_optimizer(gloo_world_2, initial, expected):
    """Both optimizers keep fp32 master weights of the bf16 parameters and take the same step.

    The plain optimizer computes the gradient norm tensor by tensor, the distributed one shard
    by shard, so the clipping factor differs in its last bits (float sums in another order,
    vectorized as wide as the CPU allows). Adam itself is elementwise, so that is the only
    difference: the fp32 masters agree to float rounding, and rounding them to bf16 may land
    a few elements on neighbouring bf16 values.
    """
    want = expected()
    plain, sharded = (gloo_world_2.run(bf16_steps, initial["llama"], d)[0] for d in (False, True))
    for results in (plain, sharded):
        assert results["dtypes"] == {torch.bfloat16}
        assert results["metrics"]["loss"] == pytest.approx(want["loss"], rel=0.02)
    assert sharded["metrics"]["grad_norm"] == pytest.approx(plain["metrics"]["grad_norm"], rel=1e-6)
    assert plain["metrics"]["grad_norm"] > OPTIM["clip_grad"]  # the clipping factor enters the update
    differing = total = 0
    for name, tensor in plain["weights"].items():
        other = sharded["weights"][name]
        assert bf16_neighbours(other, tensor).all(), name
        differing += int((other != tensor).sum())
        total += tensor.numel()
    assert differing <= total * 1e-4, f"{differing} of {total} weights differ"


def build_errors_and_names() -> dict:
    """Parameter names of the local spec, and the errors of building at the wrong time."""
    config = tiny_config(tp=2, model="qwen2-gqa")
    errors = {}
    try:
        build_model(config.model, this_rank(), config.parallel, precision_here(config.precision))
    except RuntimeError as e:
        errors["before"] = str(e)
    initialize_model_parallel(config.parallel, SEED)
    try:
        try:
            build_model(config.model, this_rank(), ParallelConfig(), precision_here(config.precision))
        except ValueError as e:
            errors["mismatch"] = str(e)
        try:
            initialize_model_parallel(config.parallel)
        except RuntimeError as e:
            errors["twice"] = str(e)
        model = build_model(config.model, this_rank(), config.parallel, precision_here(config.precision))
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    finally:
        destroy_model_parallel()
    return dict(errors=errors, shapes=shapes)


def test_local_spec_names_shapes_and_build_errors(gloo_world_2):
    result = gloo_world_2.run(build_errors_and_names)[0]
    assert "call initialize_model_parallel first" in result["errors"]["before"]
    assert "parallel.tensor_model_parallel_size=1" in result["errors"]["mismatch"]
    assert "already initialized" in result["errors"]["twice"]
    # Qwen2-like at TP=2: 4 query heads in 2 groups of head_dim 64, QKV bias, 512 vocab rows.
    per_layer = {
        "input_layernorm.weight": (256,),
        "self_attention.linear_qkv.weight": ((4 + 2 * 2) * 64 // 2, 256),
        "self_attention.linear_qkv.bias": ((4 + 2 * 2) * 64 // 2,),
        "self_attention.linear_proj.weight": (256, 4 * 64 // 2),
        "pre_mlp_layernorm.weight": (256,),
        "mlp.linear_fc1.weight": (2 * 512 // 2, 256),
        "mlp.linear_fc2.weight": (256, 512 // 2),
    }
    assert result["shapes"] == {
        "embedding.word_embeddings.weight": (256, 256),
        **{f"decoder.layers.{i}.{name}": shape for i in (0, 1) for name, shape in per_layer.items()},
        "decoder.final_layernorm.weight": (256,),
        "output_layer.weight": (256, 256),
    }
