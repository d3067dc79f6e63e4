"""The demo's base model: a tiny Llama fine-tuned briefly on noisy demonstrations.

Writes a Hugging Face directory (config, safetensors, tokenizer with a chat template), the
same kind of starting point a user brings, so the demo goes through the real import path.
Takes about half a minute on 2 CPU cores; nothing is downloaded.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

import torch

from gdpo_megatron.demo import task


def build_tokenizer(vocab_size: int = 512, seed: int = 0):
    """A byte-level BPE tokenizer trained on the demo corpus, with the demo chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[task.EOS, task.USER, task.ASSISTANT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(task.tokenizer_corpus(seed), trainer=trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=task.EOS, bos_token=task.EOS, pad_token=task.EOS)
    out.chat_template = task.CHAT_TEMPLATE
    return out


def sft_batches(tokenizer, examples: list[dict], batch_size: int, rng: random.Random,
                demonstration: Callable[[dict, random.Random], str] = task.demonstration):
    """Endless shuffled batches of (input ids, loss mask over answer tokens) for the warm-up."""
    rows = []
    for ex in examples:
        prompt = tokenizer.apply_chat_template(ex["messages"], add_generation_prompt=True, tokenize=False)
        answer = demonstration(ex, rng) + task.EOS
        p, a = tokenizer(prompt)["input_ids"], tokenizer(answer)["input_ids"]
        rows.append((p + a, [0] * len(p) + [1] * len(a)))
    return padded_batches(rows, batch_size, tokenizer.pad_token_id, rng)


def padded_batches(rows: list[tuple[list[int], list[int]]], batch_size: int, pad_id: int, rng: random.Random):
    """Endless shuffled batches of ``rows`` (token ids, loss mask), padded to the longest."""
    while True:
        rng.shuffle(rows)
        for i in range(0, len(rows) - batch_size + 1, batch_size):
            chunk = rows[i : i + batch_size]
            width = max(len(ids) for ids, _ in chunk)
            ids = torch.full((batch_size, width), pad_id)
            mask = torch.zeros(batch_size, width)
            for j, (tokens, m) in enumerate(chunk):
                ids[j, : len(tokens)] = torch.tensor(tokens)
                mask[j, : len(m)] = torch.tensor(m, dtype=torch.float32)
            yield ids, mask


def fine_tune(model, batches, steps: int, lr: float) -> None:
    """``steps`` AdamW steps of ``model`` on ``batches``, the loss on the masked tokens only."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for _, (ids, mask) in zip(range(steps), batches):
        logits = model(input_ids=ids).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                reduction="none")
        loss = (nll * mask[:, 1:].reshape(-1)).sum() / mask[:, 1:].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def save_model(model, tokenizer, out_dir: Path) -> Path:
    """Write ``model`` and ``tokenizer`` to ``out_dir`` whole or not at all (through a sibling)."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.replace(out_dir)
    return out_dir


def make_base_model(out_dir: str | Path, steps: int = 150, batch_size: int = 32, lr: float = 3e-3, seed: int = 0,
                    demonstration: Callable[[dict, random.Random], str] = task.demonstration,
                    tools: tuple[str, ...] = task.TOOLS, max_position_embeddings: int = 1024) -> Path:
    """Fine-tune a tiny random Llama on noisy demonstrations; save it with its tokenizer.

    ``demonstration(example, rng)`` writes one answer (default: the demo task's noise) to
    requests for ``tools``; ``max_position_embeddings`` is the context the model declares.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    tokenizer = build_tokenizer(seed=seed)
    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=max_position_embeddings, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    batches = sft_batches(tokenizer, task.make_examples(2000, seed + 1, tools), batch_size, random.Random(seed), demonstration)
    fine_tune(model, batches, steps, lr)
    return save_model(model, tokenizer, Path(out_dir))
