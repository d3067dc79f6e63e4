"""The ToolRL base model: a small Llama that has seen ToolRL's SFT rows, for GDPO on a CPU.

``make runs/toolrl_base`` (``python -m gdpo_megatron.demo.toolrl_base``) writes a Hugging
Face directory: a Llama of ``SHAPE`` with a 4,096-token context (ToolRL's prompts are about
800 tokens, up to about 2,500, under the chat template), the repository-trained BPE
tokenizer (:mod:`gdpo_megatron.demo.repo_tokenizer`, plus the SFT rows' text) with ChatML,
and ``rl_prompts.json``, the SFT rows kept for reinforcement learning, in the test split's
layout (:func:`verl_row`). Nothing is downloaded.

Rows. ToolRL's SFT set (``examples/data/toolrl/rlla_sft.json``, 400 rows) is split by a
fixed rule: a row whose user message is also one of the 80 test prompts
(``rlla_4k_test.parquet``, the evaluation set) is dropped from both parts; of the rest, row
``i`` goes to the RL prompts when SHA-256 of ``rlla_sft:<i>`` is divisible by 4 as a
big-endian integer, else to the warm-up. The warm-up never sees an RL prompt's answer.

Warm-up. Supervised steps on the warm-up rows, loss on the answer tokens only. Each answer's
``<think>`` block is cut to its first sentences (at least ``THINK_CHARS`` characters): the
full distilled blocks run to about 400 tokens, which a CPU run cannot afford to sample; the
shape ToolRL's format reward checks (think block, then ``<tool_call>`` and/or
``<response>``) is unchanged. A share (``RENAME_SHARE``) of the rows is seen with every
listed tool renamed to a fresh random identifier (:func:`rename_tools`), so that a call's
name can only be copied from the tool list, never remembered: the held-out prompts list
tools that no warm-up row calls. The default budget (``WARMUP_STEPS`` of 4 rows, about 20
minutes of one core) leaves a model that writes ToolRL's format in most of its greedy
completions on the test prompts but does not yet copy a listed name into a call (the
measurements: docs/benchmarks.md, "ToolRL on the CPU").
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import sys
import time
from pathlib import Path

import torch

from gdpo_megatron.demo.repo_tokenizer import ROOT, build_tokenizer

SFT_PATH = ROOT / "examples/data/toolrl/rlla_sft.json"
TEST_PATH = ROOT / "examples/data/toolrl/rlla_4k_test.parquet"
RL_PROMPTS = "rl_prompts.json"
RL_SHARE = 4  # one row in RL_SHARE (by hash) is an RL prompt
THINK_CHARS = 80
WARMUP_STEPS = 600
RENAME_SHARE = 1.0  # share of warm-up rows seen with their tools renamed
TOOL_LINE = re.compile(r"^\d+\. Name: (.+?)\s*$", re.MULTILINE)
ID_FIRST = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
ID_CHARS = ID_FIRST + "0123456789_"
SHAPE = dict(vocab_size=32_000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096)


def split_sft_rows(rows: list[dict], test_inputs: set[str]) -> tuple[list[dict], list[dict]]:
    """(warm-up rows, RL prompt rows) of ToolRL's SFT set by the module's rule."""
    warmup, rl = [], []
    for i, row in enumerate(rows):
        if row["input"] in test_inputs:
            continue
        digest = int.from_bytes(hashlib.sha256(f"rlla_sft:{i}".encode()).digest(), "big")
        (rl if digest % RL_SHARE == 0 else warmup).append(row)
    return warmup, rl


def verl_row(row: dict) -> dict:
    """An SFT row in the test split's layout (verl's), so training and evaluation read the
    same fields: ``prompt`` (system and user message), ``reward_model.ground_truth``."""
    return {"data_source": "rlla", "prompt": [{"role": "system", "content": row["instruction"]},
                                              {"role": "user", "content": row["input"]}],
            "reward_model": {"ground_truth": row["output"]}}


def held_out_prompts() -> set[str]:
    """The user messages of the held-out test split."""
    import pyarrow.parquet as pq

    return {info["input"] for info in pq.read_table(TEST_PATH, columns=["extra_info"]).column(0).to_pylist()}


def short_think(answer: str) -> str:
    """``answer`` with its ``<think>`` block cut after the first sentence that ends past
    ``THINK_CHARS`` characters (answers without one are returned as they are)."""
    match = re.match(r"\s*<think>(.*?)</think>", answer, re.DOTALL)
    if not match:
        return answer
    thought = match.group(1).strip()
    end = re.search(r"[.!?](\s|$)", thought[THINK_CHARS:])
    if end:
        thought = thought[:THINK_CHARS + end.start() + 1]
    return f"<think> {thought} </think>" + answer[match.end():]


def tool_names(instruction: str) -> list[str]:
    """The names in the tool list of a ToolRL system prompt (its ``N. Name: ...`` lines)."""
    return TOOL_LINE.findall(instruction)


def rename_tools(row: dict, rng: random.Random) -> dict:
    """``row`` with every listed tool renamed to a fresh random identifier, in the tool list,
    the user message and the answer alike: a row whose answer can only be written by copying
    the called tools' names from the list."""
    renames = {}
    for name in tool_names(row["instruction"]):
        length = rng.randint(5, 15)
        renames[name] = rng.choice(ID_FIRST) + "".join(rng.choice(ID_CHARS) for _ in range(length - 1))
    if not renames:
        return row
    names = "|".join(re.escape(name) for name in sorted(renames, key=len, reverse=True))
    pattern = re.compile(rf"(?<!\w)(?:{names})(?!\w)")
    return {key: pattern.sub(lambda m: renames[m.group(0)], row[key]) for key in ("instruction", "input", "output")}


def encode_row(tokenizer, row: dict) -> tuple[list[int], int]:
    """(prompt + answer ids, prompt length) of ``row``, the answer ending the turn."""
    messages = [{"role": "system", "content": row["instruction"]}, {"role": "user", "content": row["input"]}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    a = tokenizer(short_think(row["output"]) + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    return p + a, len(p)


def answer_loss(model, batch: list[tuple[list[int], int]], pad_id: int) -> torch.Tensor:
    """Mean next-token loss over the answer tokens of ``batch``; the output layer runs only
    where a target is an answer token."""
    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id)
    targets = torch.zeros(len(batch), width, dtype=torch.bool)
    for j, (tokens, prompt_len) in enumerate(batch):
        ids[j, : len(tokens)] = torch.tensor(tokens)
        targets[j, prompt_len : len(tokens)] = True
    hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
    where = targets[:, 1:]
    logits = model.lm_head(hidden[where])
    return torch.nn.functional.cross_entropy(logits, ids[:, 1:][where])


def make_toolrl_base(out_dir: str | Path, steps: int = WARMUP_STEPS, batch_size: int = 4, lr: float = 2e-3, seed: int = 0,
                     rename_share: float = RENAME_SHARE, log=print) -> Path:
    """Warm up a random Llama of ``SHAPE`` on the warm-up rows; write it, its tokenizer and
    the RL prompt rows to ``out_dir``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    rows = json.loads(SFT_PATH.read_text())
    warmup, rl = split_sft_rows(rows, held_out_prompts())
    started = time.time()
    tokenizer = build_tokenizer(extra_texts=[r[k] for r in warmup + rl for k in ("instruction", "input", "output")])
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        **SHAPE, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, torch_dtype="float32"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20) * (1 - s / steps))
    rng = random.Random(seed)
    order: list[int] = []
    model.train()
    for step in range(steps):
        if len(order) < batch_size:
            order += rng.sample(range(len(warmup)), len(warmup))
        picked = [order.pop() for _ in range(batch_size)]
        batch = [encode_row(tokenizer, rename_tools(warmup[i], rng) if rng.random() < rename_share else warmup[i])
                 for i in picked]
        loss = answer_loss(model, batch, tokenizer.pad_token_id)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if (step + 1) % 25 == 0 or step + 1 == steps:
            log(f"warm-up step {step + 1}/{steps}: answer loss {loss.item():.3f}, {time.time() - started:.0f} s")
    model.eval()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / RL_PROMPTS).write_text(json.dumps([verl_row(row) for row in rl], indent=1, ensure_ascii=False))
    tmp.replace(out_dir)
    log(f"wrote {out_dir}: {len(warmup)} warm-up rows, {len(rl)} RL prompt rows ({out_dir / RL_PROMPTS}), "
        f"{len(rows) - len(warmup) - len(rl)} row(s) left out as test prompts")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gdpo_megatron.demo.toolrl_base", description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", nargs="?", default="runs/toolrl_base")
    parser.add_argument("--steps", type=int, default=WARMUP_STEPS)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rename-share", type=float, default=RENAME_SHARE,
                        help="share of warm-up rows seen with their tools renamed (rename_tools)")
    args = parser.parse_args(argv)
    if not 0.0 <= args.rename_share <= 1.0:
        parser.error(f"--rename-share: expected a share in [0, 1], got {args.rename_share}")
    if Path(args.out_dir).exists():
        parser.error(f"{args.out_dir} exists; remove it to write the base model again")
    make_toolrl_base(args.out_dir, args.steps, args.batch_size, args.lr, args.seed, args.rename_share)
    return 0


if __name__ == "__main__":
    sys.exit(main())
