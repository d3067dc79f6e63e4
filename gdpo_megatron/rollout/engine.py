"""The rollout engine's contract: what any engine takes and gives, and what it must do.

Data: :class:`SamplingConfig` in, :class:`Completion` (tokens, the logprobs they were sampled
with) out, :class:`PrefixCacheCounts` on the side. :class:`RolloutEngine` is what the trainer,
``gdpo-eval``, ``gdpo-plan`` and preflight speak to; :mod:`gdpo_megatron.rollout.factory` builds
the one ``rollout.engine`` names. Every engine is colocated: one per rank, in the trainer's
process, all ranks of one engine replica calling each method with the same arguments.

Seeds: a sequence's sampling depends only on ``SamplingConfig.seed`` and the sequence's own
key (:func:`derive_seed`), never on what else is in the batch.
"""
from __future__ import annotations

import abc
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, Hashable, Iterable, Literal, Sequence

if TYPE_CHECKING:
    import torch

    from gdpo_megatron.config.policy import ModelConfig
    from gdpo_megatron.config.rollout import RolloutConfig
    from gdpo_megatron.device import Machine

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


@dataclass(frozen=True)
class PrefixCacheCounts:
    """Prompt tokens of the finished requests (``queries``) and how many of them the engine found
    in its prefix cache (``hits``)."""

    queries: int = 0
    hits: int = 0

    def __add__(self, other: "PrefixCacheCounts") -> "PrefixCacheCounts":
        return PrefixCacheCounts(self.queries + other.queries, self.hits + other.hits)

    def __sub__(self, other: "PrefixCacheCounts") -> "PrefixCacheCounts":
        return PrefixCacheCounts(self.queries - other.queries, self.hits - other.hits)


def derive_seed(*parts) -> int:
    """A 63-bit seed that depends only on ``parts`` (e.g. seed, prompt, sample), not on a batch."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class RolloutEngine(abc.ABC):
    """A colocated rollout engine.

    Before one is built (class methods): whether it can load a checkpoint, and the memory it
    needs. Built (:meth:`build`): sampling, continuing sequences, taking new weights, sleeping
    while the policy trains.
    """

    # What the engine holds on a GPU besides its weights and KV cache (activations, sampler,
    # CUDA graphs, communication buffers), also while it sleeps: an allowance, for gdpo-plan.
    RUNTIME_GIB: ClassVar[float]
    # Log records of the engine's library that are harmless in this trainer, filtered by
    # gdpo_megatron.quiet: (logger name, start of the message, why it is harmless).
    HARMLESS_LOG_RECORDS: ClassVar[tuple[tuple[str, str, str], ...]] = ()

    # ---- before the engine exists ------------------------------------------------------------

    @classmethod
    @abc.abstractmethod
    def build(cls, rollout: "RolloutConfig", model_path: str, machine: "Machine", seed: int = 0) -> "RolloutEngine":
        """The engine for ``rollout`` (a section whose ``kv_cache_gib`` is the cache to build,
        see :meth:`kv_cache_gib`) on ``machine`` (this one, as the launch decided it), starting
        from the Hugging Face checkpoint ``model_path``."""

    @classmethod
    @abc.abstractmethod
    def check_model(cls, hf_config: dict) -> None:
        """Raise an InputError naming the ``config.json`` field this engine cannot load."""

    @classmethod
    @abc.abstractmethod
    def kv_cache_gib(cls, rollout: "RolloutConfig", model: "ModelConfig", machine: "Machine", sequences: int,
                     tokens_per_sequence: int) -> float | None:
        """The KV cache to build on ``machine`` for ``sequences`` sequences of up to
        ``tokens_per_sequence`` tokens each (one step's rollouts); None: the engine's own sizing."""

    @classmethod
    @abc.abstractmethod
    def kv_cache_bytes_per_token(cls, model: "ModelConfig", rollout: "RolloutConfig", element_bytes: int) -> int:
        """Keys and values of one token on one engine rank, in elements of ``element_bytes``."""

    @classmethod
    @abc.abstractmethod
    def weight_bytes(cls, layer_params: int, other_params: int, element_bytes: int, rollout: "RolloutConfig") -> int:
        """The weights on one engine rank: ``layer_params`` (the transformer layers') and
        ``other_params`` (embeddings, final norm), unquantized elements of ``element_bytes``."""

    # ---- the built engine ------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def tokenizer(self):
        """The checkpoint's tokenizer."""

    @property
    @abc.abstractmethod
    def prefix_cache(self) -> PrefixCacheCounts:
        """Prompt tokens looked up in the prefix cache and found there, since the engine was built."""

    @abc.abstractmethod
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: SamplingConfig,
                 on_completion: Callable[[int, int, Completion], None] | None = None) -> list[list[Completion]]:
        """``n`` completions for each prompt, grouped by prompt in input order; completion j of
        prompt i seeded from (``sampling.seed``, i, j).

        ``on_completion(prompt_index, sample_index, completion)``, when given, is called for
        each completion as soon as it finishes, while the others are still being generated
        (e.g. to score it). If it raises, the unfinished requests are aborted and the error
        propagates."""

    @abc.abstractmethod
    def continue_sequences(self, sequences: Sequence[Sequence[int]], sampling: SamplingConfig,
                           keys: Sequence[Hashable] | None = None,
                           on_completion: Callable[[int, Completion], None] | None = None) -> list[Completion]:
        """One continuation of each token sequence, in input order, all in one batch.

        A sequence is a whole trajectory so far (prompt, earlier completions, what came back
        from tools): its tokens already in the prefix cache are not computed again.
        Continuation k is seeded from (``sampling.seed``, ``keys[k]``), ``keys`` naming each
        trajectory within the step (default: its index; with the turn, or a seed per turn,
        where a trajectory continues more than once), so a trajectory samples the same
        whatever else is in the batch. ``on_completion(index, completion)`` as in
        :meth:`generate`."""

    @abc.abstractmethod
    def update_weights(self, weights: Iterable[tuple[str, "torch.Tensor"]]) -> None:
        """Load full Hugging Face-named tensors (any subset of the checkpoint's, every one after
        a sleep that discarded the weights); the prefix cache is reset after."""

    @abc.abstractmethod
    def sleep(self) -> None:
        """Release the engine's memory while the policy trains."""

    @abc.abstractmethod
    def wake_up(self) -> None:
        """Bring back what :meth:`sleep` released."""

    @abc.abstractmethod
    def close(self) -> None:
        """Shut the engine down."""
