"""A tokenizer of realistic vocabulary, trained here from this repository's text.

Byte-level BPE (as GPT-2, Llama 3 and Qwen use) asked for ``VOCAB_SIZE`` tokens, trained on
ToolRL's SFT excerpt (``rlla_sft_first50.json``), the bundled JSONL data, the documentation
and the source code: about 1.7 MB of English, JSON and Python, from which BPE finds about
18,000 tokens before every word is one token; ``extra_texts`` adds more (the ToolRL base
model adds the SFT rows it may see). ToolRL's test prompts are never part of the training
text, so they are tokenized as unseen text is: about 3.9 characters a token, as real
tokenizers do on such text. A model built for it keeps ``VOCAB_SIZE`` rows (ids past the
tokenizer's carry no text, like the padded tables of real checkpoints), so its output layer
costs what a realistic one does. Training takes seconds; nothing is downloaded or cached.
Reads the source checkout, so it runs from one (as ``make`` and the benchmarks do).

Chat template: ChatML (as Qwen's), ``<|im_end|>`` ends a turn and is the end-of-sequence
token.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

ROOT = Path(__file__).resolve().parents[2]
VOCAB_SIZE = 32_000
PAD, TURN_START, TURN_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}" + TURN_START + "{{ m['role'] }}\n{{ m['content'] }}" + TURN_END + "\n{% endfor %}"
    "{% if add_generation_prompt %}" + TURN_START + "assistant\n{% endif %}"
)
SFT_EXCERPT = "examples/data/toolrl/rlla_sft_first50.json"
# The training text after the SFT excerpt, in this order; ToolRL's test parquet is not part of it.
TEXT_FILES = ("examples/data/*.jsonl", "docs/**/*.md", "*.md", "configs/*.yaml",
              "gdpo_megatron/**/*.py", "benchmarks/*.py", "tests/**/*.py")


def training_text() -> list[str]:
    """ToolRL's SFT excerpt (system message, user message, reference answer of each row),
    then every file of ``TEXT_FILES``."""
    texts = []
    for row in json.loads((ROOT / SFT_EXCERPT).read_text()):
        texts += [row["instruction"], row["input"], row["output"]]
    for pattern in TEXT_FILES:
        texts += [path.read_text(errors="replace") for path in sorted(ROOT.glob(pattern)) if path.is_file()]
    return texts


def build_tokenizer(vocab_size: int = VOCAB_SIZE, extra_texts: Iterable[str] = ()):
    """A byte-level BPE ``PreTrainedTokenizerFast`` of at most ``vocab_size`` tokens, trained
    on :func:`training_text` and ``extra_texts``, with the ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, TURN_START, TURN_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([*training_text(), *extra_texts], trainer=trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=TURN_END, bos_token=PAD, pad_token=PAD)
    out.chat_template = CHAT_TEMPLATE
    return out
