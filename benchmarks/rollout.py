"""Rollout cost: vLLM vs transformers generate, weight sync vs model size, GPU colocation.

    OMP_NUM_THREADS=1 python benchmarks/rollout.py [--repeats 5]     # CPU parts
    python benchmarks/rollout.py --gpu                                 # GPU parts (needs CUDA)

(a) Generated tokens/s of random Llamas in fp32 (the tiny one: hidden 128, 2 heads of 64,
    2 layers, vocab 512; and a 17M one): 8 prompts x 8 completions, 32 new tokens,
    temperature 1, through the vLLM engine and through transformers `generate` (KV cache,
    sampling, same batch). The two alternate run by run in one process.
(b) One in-place weight sync (`update_weights` with the full Hugging Face state dict) vs
    model size, next to the engine start time: what re-creating the engine every step, the
    fallback when in-place updates do not work, would cost instead.
(c) --gpu: a 1.1B Llama shape in bf16: sync time, a full sleep -> update -> wake cycle, and
    tokens/s of a colocated engine (30% of the GPU, one sleep/wake cycle per round) vs a
    standalone one (85%, never sleeps).
Every number is the median of `--repeats` runs after one warm-up.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test support: local worlds, tiny models

from gdpo_megatron.commands.cpu_malloc import reexec_with_tcmalloc

if __name__ == "__main__":
    reexec_with_tcmalloc()  # before torch loads: both engines under the allocator training uses

import torch  # noqa: E402

from gdpo_megatron.device import this_machine  # noqa: E402
from gdpo_megatron.rollout import SamplingConfig, VLLMEngine, VLLMEngineConfig  # noqa: E402
from support.tiny_model import TinyLlamaSpec, save_tiny_llama  # noqa: E402
from timing import median_time  # noqa: E402

PROMPTS, SAMPLES, NEW_TOKENS, PROMPT_LEN = 8, 8, 32, 16
SYNC_SIZES = {
    "0.4M (tiny)": TinyLlamaSpec(),
    "17M": TinyLlamaSpec(hidden_size=512, num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=4, intermediate_size=1376, vocab_size=8192),
    "120M": TinyLlamaSpec(hidden_size=768, num_attention_heads=12, num_key_value_heads=12, num_hidden_layers=12, intermediate_size=2048, vocab_size=32000),
}
THROUGHPUT_SIZES = ("0.4M (tiny)", "17M")
GPU_1B = TinyLlamaSpec(
    hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, num_hidden_layers=22,
    intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048,
)


def prompts(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(1, vocab_size, (PROMPTS, PROMPT_LEN), generator=gen).tolist()


def timed_start(path: str, **overrides) -> tuple[VLLMEngine, float]:
    t0 = time.perf_counter()
    engine = VLLMEngine(VLLMEngineConfig(path, **overrides), this_machine())
    return engine, time.perf_counter() - t0


def generation_throughput(root: Path, repeats: int) -> None:
    print(f"(a) {PROMPTS} prompts x {SAMPLES} samples x {NEW_TOKENS} new tokens, fp32, tokens/s")
    print(f"    {'model':>12} {'vLLM':>9} {'transformers':>13} {'vLLM / transformers':>20}")
    for name in THROUGHPUT_SIZES:
        spec = SYNC_SIZES[name]
        path = root / f"gen-{spec.hidden_size}-{spec.num_hidden_layers}"
        model = save_tiny_llama(path, spec)
        engine, _ = timed_start(str(path), dtype="float32", max_model_len=256, kv_cache_gib=0.5)
        tps = tokens_per_second(engine, model, repeats)
        engine.close()
        ratio = tps["vllm"] / tps["transformers"]
        print(f"    {name:>12} {tps['vllm']:9.0f} {tps['transformers']:13.0f} {ratio:19.2f}x")


def tokens_per_second(engine: VLLMEngine, model, repeats: int) -> dict[str, float]:
    """Median generated tokens/s of the engine and of transformers, alternating run by run."""
    batch = prompts(model.config.vocab_size)
    eos = model.config.eos_token_id
    counts = {}

    def run_vllm():
        groups = engine.generate(batch, SAMPLES, SamplingConfig(max_new_tokens=NEW_TOKENS))
        counts["vllm"] = sum(len(c.token_ids) for g in groups for c in g)

    def run_transformers():
        ids = torch.tensor(batch).repeat_interleave(SAMPLES, dim=0)
        with torch.no_grad():
            out = model.generate(ids, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=NEW_TOKENS, pad_token_id=eos)
        new = out[:, ids.shape[1] :]
        ended = (new == eos).cumsum(1)  # tokens up to and including the first EOS count
        counts["transformers"] = int(((ended == 0) | ((ended == 1) & (new == eos))).sum())

    runs = {"vllm": run_vllm, "transformers": run_transformers}
    rates = {name: [] for name in runs}
    for fn in runs.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            rates[name].append(counts[name] / (time.perf_counter() - t0))
    return {name: statistics.median(r) for name, r in rates.items()}


def sync_vs_size(root: Path, repeats: int) -> None:
    print("(b) in-place weight sync vs model size (fp32, CPU)")
    print(f"    {'model':>12} {'params':>10} {'sync':>9} {'engine start':>13} {'start / sync':>13}")
    for name, spec in SYNC_SIZES.items():
        path = root / f"sync-{spec.hidden_size}-{spec.num_hidden_layers}"
        model = save_tiny_llama(path, spec)
        state = model.state_dict()
        engine, start_s = timed_start(str(path), dtype="float32", max_model_len=256, kv_cache_gib=0.25)
        sync_s = median_time(lambda: engine.update_weights(state.items()), repeats)
        engine.close()
        params = sum(t.numel() for t in state.values())
        print(f"    {name:>12} {params / 1e6:9.1f}M {sync_s * 1e3:7.1f}ms {start_s:12.1f}s {start_s / sync_s:12.0f}x")


def gpu_colocation(root: Path, repeats: int) -> None:
    model = save_tiny_llama(root / "1b", GPU_1B).to(device="cuda", dtype=torch.bfloat16)
    state = model.state_dict()
    batch = prompts(GPU_1B.vocab_size) * 8  # 64 prompts
    sampling = SamplingConfig(max_new_tokens=256, seed=0)
    params = sum(t.numel() for t in state.values())
    print(f"(c) GPU, {params / 1e9:.2f}B-parameter Llama shape, bf16, {len(batch)} prompts x {SAMPLES} samples x 256 tokens")

    results = {}
    for name, utilization, colocated in (("colocated", 0.3, True), ("standalone", 0.85, False)):
        engine, start_s = timed_start(str(root / "1b"), dtype="bfloat16", max_model_len=2048, gpu_memory_utilization=utilization, enable_sleep_mode=colocated)
        tokens = {}

        def round_trip():
            if colocated:  # what the trainer does around each policy update
                engine.sleep()
                engine.update_weights(state.items())
                engine.wake_up()
            groups = engine.generate(batch, SAMPLES, sampling)
            tokens["n"] = sum(len(c.token_ids) for g in groups for c in g)

        round_s = median_time(round_trip, repeats)
        results[name] = tokens["n"] / round_s
        if colocated:
            sync_s = median_time(lambda: engine.update_weights(state.items()), repeats)

            def cycle():
                engine.sleep()
                engine.update_weights(state.items())
                engine.wake_up()

            cycle_s = median_time(cycle, repeats)
            print(f"    sync (awake) {sync_s * 1e3:.0f} ms; sleep -> update -> wake {cycle_s * 1e3:.0f} ms; start {start_s:.0f} s")
        engine.close()
    for name, tps in results.items():
        print(f"    {name:<10} {tps:9.0f} tokens/s (sleep/sync/wake included when colocated)")
    print(f"    ratio colocated / standalone: {results['colocated'] / results['standalone']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gpu", action="store_true", help="run the GPU part instead of the CPU parts")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.gpu:
            if not torch.cuda.is_available():
                raise SystemExit("--gpu: no CUDA device")
            gpu_colocation(root, args.repeats)
        else:
            generation_throughput(root, args.repeats)
            sync_vs_size(root, args.repeats)


if __name__ == "__main__":
    main()
