"""What a rollout engine takes and gives: sampling settings in, completions with logprobs out."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingConfig:
    """How completions are sampled.

    ``seed`` makes every completion reproducible on its own: completion j of prompt i is
    drawn with its own generator seeded from (seed, i, j), whatever else is in the batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass
class Completion:
    """One sampled continuation of a prompt.

    ``logprobs[t]`` is the log-probability of ``token_ids[t]`` under the distribution it was
    sampled from (logits divided by the temperature). ``text`` is cut before a matched stop
    string; ``token_ids`` keep every sampled token, including the one that completed it.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    text: str = ""


def derive_seed(*parts) -> int:
    """A 63-bit seed that depends only on ``parts`` (e.g. seed, prompt, sample), not on a batch."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
