"""The policy worker: this rank's model shard, its optimizer and LR schedule, and the update.

One :class:`PolicyWorker` per rank, created after ``torch.distributed`` is initialized; it owns
megatron's parallel state until :meth:`PolicyWorker.close`. Every rank calls the same methods
in the same order with the batch of its data-parallel replica (ranks of one tensor/pipeline
group pass the same batch). Micro-batches go through megatron-core's forward-backward
function (1F1B when pipelined); the loss functions return token sums and megatron divides the
gradients by the global number of tokens (or sequences) across micro-batches and
data-parallel ranks, so the update equals the single-process one whatever the layout.
"""
from __future__ import annotations

import functools
import gc
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func

from gdpo_megatron.policy import cpu_compat
from gdpo_megatron.policy.batch import PolicyBatch, merge_rows
from gdpo_megatron.device import Placement, release_cached_memory
from gdpo_megatron.distributed.collectives import all_reduce_sums
from gdpo_megatron.policy.logprobs import vocab_parallel_logprobs
from gdpo_megatron.policy.loss import TOKEN_METRICS, policy_loss
from gdpo_megatron.policy.model import (build_model, destroy_model_parallel, initialize_model_parallel, logits_from,
                                        torch_dtype)
from gdpo_megatron.policy.resolved import ResolvedPolicy

# Order of the per-micro-batch sums carried from the loss function to the metrics.
_SUMS = ("loss_sum", "count", "num_tokens", *TOKEN_METRICS)


class PolicyWorker:
    """Builds the model (and a frozen reference when ``loss.kl_coef > 0``), megatron DDP, the
    Adam optimizer and the LR schedule; runs :meth:`train_step` and :meth:`compute_logprobs`,
    and gives memory back to a colocated rollout engine with :meth:`release_memory`."""

    def __init__(self, policy: ResolvedPolicy, placement: Placement, *, seed: int = 1234, temperature: float = 1.0,
                 init_weights: Optional[Callable[[GPTModel], None]] = None, timeout: Optional[timedelta] = None):
        """``policy``: the policy section resolved for this machine and world; the model lives
        on ``placement``'s device (the launch's, ``init_distributed``). ``seed``
        seeds megatron's RNGs; logprobs are of the logits divided by ``temperature`` (the
        rollouts' sampling temperature). ``init_weights(model)``, when given, sets the freshly
        built (random) weights of this rank's model, e.g. from a checkpoint; the reference
        model starts from the result. ``timeout``: how long a collective of megatron's groups
        waits for a peer (None: megatron's default)."""
        if not dist.is_initialized():
            raise RuntimeError("PolicyWorker: torch.distributed is not initialized")
        config = policy.config
        self.config, self.micro_batches, self.temperature = config, policy.micro_batches, temperature
        self.placement, self.device = placement, placement.device
        initialize_model_parallel(config.parallel, seed, timeout)
        try:
            self._build(init_weights)
        except BaseException:
            destroy_model_parallel()
            raise
        self._forward_backward = get_forward_backward_func()
        self.steps = 0
        self.offloaded = False  # grad buffers freed and optimizer state on the host

    def _build(self, init_weights) -> None:
        """Model (and reference), DDP, optimizer and scheduler; hooks them into megatron's schedules."""
        config = self.config
        model = build_model(config.model, self.placement, config.parallel, config.precision)
        if init_weights is not None:
            init_weights(model)
        self.reference: Optional[GPTModel] = None
        if config.loss.kl_coef > 0:
            self.reference = build_model(config.model, self.placement, config.parallel, config.precision)
            self.reference.load_state_dict(model.state_dict())
            self.reference.requires_grad_(False).eval()

        optim, precision = config.optim, config.precision
        with cpu_compat.device_scope():
            self.model = DistributedDataParallel(
                config=model.config,
                ddp_config=DistributedDataParallelConfig(
                    grad_reduce_in_fp32=True, use_distributed_optimizer=optim.use_distributed_optimizer),
                module=model,
            )
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
                    adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
                    clip_grad=optim.clip_grad, bf16=precision.dtype == "bf16", params_dtype=torch_dtype(precision.dtype),
                    use_distributed_optimizer=optim.use_distributed_optimizer,
                ),
                [self.model],
            )
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=optim.lr, min_lr=optim.min_lr,
            lr_warmup_steps=optim.lr_warmup_steps, lr_decay_steps=optim.lr_decay_steps,
            lr_decay_style=optim.lr_decay_style, start_wd=optim.weight_decay, end_wd=optim.weight_decay,
            wd_incr_steps=optim.lr_decay_steps, wd_incr_style="constant",
        )
        # Token-budget micro-batches differ in shape; under PP the stages then send each other
        # the shape of every activation before it (megatron-core's variable_seq_lengths).
        for built in (model, self.reference):
            if built is not None:
                built.config.variable_seq_lengths = self.micro_batches.by_tokens
        model.config.no_sync_func = self.model.no_sync
        model.config.finalize_model_grads_func = finalize_model_grads
        model.config.grad_scale_func = self.optimizer.scale_loss

    @property
    def gpt_model(self) -> GPTModel:
        """This rank's pipeline stage of the policy (unwrapped from DDP)."""
        return self.model.module

    def close(self) -> None:
        """Release megatron's parallel state (the default process group stays)."""
        destroy_model_parallel()

    def __enter__(self) -> "PolicyWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- public API -------------------------------------------------------------------

    def compute_logprobs(self, batch: PolicyBatch) -> torch.Tensor:
        """``[B, T - 1]`` log-probabilities of the targets under the current policy, on every rank.

        Columns past a row's length are padding and mean nothing (0 where a token-budget
        micro-batch was cut shorter than the batch)."""
        batch.validate(self.config.model.vocab_size)
        logprobs = self._forward_logprobs(self.gpt_model, batch.to(self.device), every_position=True)
        return self._from_last_stage(logprobs, (batch.size, batch.seq_length - 1))

    def train_step(self, batch: PolicyBatch) -> dict[str, float]:
        """``ppo_epochs`` optimizer steps on ``batch``; returns the last step's metrics.

        The old logprobs are the policy's before the update (``old_logprobs: policy``): with
        one epoch those of the training pass itself, detached (the parameters do not change
        before the step, and dropout is off), otherwise a forward pass before the first step.
        With ``rollout`` they are the batch's rollout logprobs (the current policy's, detached,
        when the batch has none). ``logprob_mismatch`` in the result is the mean
        |policy - rollout| logprob of the trained tokens before the update (NaN without rollout
        logprobs).
        """
        batch.validate(self.config.model.vocab_size)
        self._reload_training_state()
        batch = batch.to(self.device)
        if self.config.old_logprobs == "rollout":
            batch.old_logprobs = batch.rollout_logprobs
        elif self.config.ppo_epochs > 1:
            batch.old_logprobs = self._forward_logprobs(self.gpt_model, batch)
        else:
            batch.old_logprobs = None  # the training pass's own, detached: see _loss
        if self.reference is not None:
            batch.ref_logprobs = self._forward_logprobs(self.reference, batch)
        micro_batches = self._split(batch)[1]  # the same for every epoch
        for epoch in range(self.config.ppo_epochs):
            metrics = self._optimizer_step(micro_batches)
            if epoch == 0:  # the policy's logprobs before any update entered this pass
                mismatch = metrics["rollout_gap"] if batch.rollout_logprobs is not None else float("nan")
        metrics.pop("rollout_gap")
        metrics["logprob_mismatch"] = mismatch
        return metrics

    def release_memory(self) -> None:
        """Before a colocated rollout engine takes the GPU: with ``offload_grads_and_optimizer``
        free megatron's gradient buffers and move the optimizer state to host memory
        (:meth:`train_step` brings both back); then hand PyTorch's cached CUDA blocks back to
        the driver, where the engine can allocate them. Without CUDA only the freed grad
        buffers change anything (the optimizer state is in host memory already).
        """
        if self.config.offload_grads_and_optimizer and not self.offloaded:
            with cpu_compat.device_scope():
                self.model.offload_grad_buffers(synchronize=True, empty_cache=False)
                self.optimizer.offload_to_cpu()
            self.offloaded = True
        if self.placement.machine.cuda:
            gc.collect()  # tensors held only by reference cycles hold their blocks too
            release_cached_memory()

    # ---- internals ----------------------------------------------------------------------

    def _reload_training_state(self) -> None:
        """Undo :meth:`release_memory`'s offload (grad buffers come back zeroed)."""
        if self.offloaded:
            with cpu_compat.device_scope():
                self.model.restore_grad_buffers(synchronize=True)
                self.optimizer.restore_from_cpu()
            self.offloaded = False

    def _optimizer_step(self, micro_batches: list[PolicyBatch]) -> dict[str, float]:
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._run(self.model, micro_batches, self._loss, forward_only=False)
        lr = self.optimizer.param_groups[0]["lr"]
        with cpu_compat.device_scope():
            ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
            self.steps += 1
        metrics = self._reduce_metrics(outputs)
        metrics.update(lr=lr, grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                       update_skipped=float(not ok))
        return metrics

    def _split(self, batch: PolicyBatch) -> tuple[Optional[torch.Tensor], list[PolicyBatch]]:
        """Micro-batches of ``micro_batch_size`` rows, or by the ``micro_batch_tokens`` budget
        (then with the row order, see :meth:`PolicyBatch.split_by_tokens`), each as wide as a
        multiple of :meth:`PolicyConfig.sequence_multiple` (sequence parallelism, FP8)."""
        budget = self.micro_batches.budget(batch.seq_length)
        if budget is None:
            return None, batch.micro_batches(self.micro_batches.rows)
        return batch.split_by_tokens(budget, self.config.sequence_multiple())

    def _run(self, model, micro_batches: list[PolicyBatch], loss_fn: Callable, forward_only: bool,
             every_position: bool = False) -> list:
        """``micro_batches`` through megatron's forward-backward function; ``loss_fn(micro, start,
        logits)`` gets the logits of positions ``start`` on: each micro-batch's first target
        (:meth:`_logits_starts`), or 0 with ``every_position``."""
        seq_length, multiple = max(m.seq_length for m in micro_batches), self.config.sequence_multiple()
        for micro in micro_batches:
            if micro.seq_length % multiple:
                raise ValueError(f"batch.input_ids: sequence length {micro.seq_length} must be a multiple of "
                                 f"{multiple} under these parallel and FP8 settings (pad the batch; see "
                                 "PolicyConfig.sequence_multiple)")
        positions = torch.arange(seq_length, device=self.device).unsqueeze(0)
        gpt = model.module if model is self.model else model
        starts = [0] * len(micro_batches) if every_position else self._logits_starts(micro_batches)

        def forward_step(data_iterator, module):
            micro, start = next(data_iterator)
            ids = micro.input_ids
            with logits_from(gpt, start):
                output = module(ids, positions[:, : ids.shape[1]].expand_as(ids), None)
            return output, functools.partial(loss_fn, micro, start)

        with cpu_compat.device_scope(), torch.set_grad_enabled(not forward_only):
            return self._forward_backward(
                forward_step_func=forward_step,
                data_iterator=zip(micro_batches, starts),
                model=[model],
                num_microbatches=len(micro_batches),
                seq_length=seq_length,
                micro_batch_size=max(m.size for m in micro_batches),
                forward_only=forward_only,
            )

    def _token_logprobs(self, logits: torch.Tensor, micro: PolicyBatch) -> tuple[torch.Tensor, torch.Tensor]:
        tp_group = parallel_state.get_tensor_model_parallel_group()
        return vocab_parallel_logprobs(
            logits[:, :-1], micro.input_ids[:, 1:], self.config.model.vocab_size,
            group=tp_group if dist.get_world_size(tp_group) > 1 else None,
            temperature=self.temperature,
        )

    def _logits_starts(self, micro_batches: list[PolicyBatch]) -> list[int]:
        """The first position whose logits the loss reads, per micro-batch: its first target,
        the earliest over the tensor-parallel group (whose vocab-parallel logits must agree in
        shape); 0 under sequence parallelism (see :func:`~gdpo_megatron.policy.model.logits_from`)
        and on stages without the output layer. One wait for the device per pass."""
        if self.config.parallel.sequence_parallel or not parallel_state.is_pipeline_last_stage():
            return [0] * len(micro_batches)
        starts = torch.stack([m.first_target() for m in micro_batches])
        tp_group = parallel_state.get_tensor_model_parallel_group()
        if dist.get_world_size(tp_group) > 1:
            dist.all_reduce(starts, op=dist.ReduceOp.MIN, group=tp_group)
        return starts.tolist()

    def _loss(self, micro: PolicyBatch, start: int, logits: torch.Tensor):
        micro = micro.from_position(start)
        logprobs, entropy = self._token_logprobs(logits, micro)
        old = micro.old_logprobs if micro.old_logprobs is not None else logprobs.detach()
        terms = policy_loss(logprobs, old, micro.advantages, micro.target_mask, self.config.loss,
                            ref_logprobs=micro.ref_logprobs, entropy=entropy, rollout_logprobs=micro.rollout_logprobs)
        sums = torch.stack([terms.loss_sum.detach(), terms.count.float(), terms.num_tokens.float(),
                            *(terms.metric_sums[name].float() for name in TOKEN_METRICS)])
        extrema = torch.stack([-terms.ratio_min, terms.ratio_max])
        return terms.loss_sum, terms.count, {"sums": sums, "extrema": extrema}

    def _forward_logprobs(self, model, batch: PolicyBatch, every_position: bool = False) -> Optional[torch.Tensor]:
        """Logprobs of the targets on the last pipeline stage (None on the others); without
        ``every_position``, 0 in the columns before each micro-batch's first target."""

        def collect(micro, start, logits):
            logprobs, _ = self._token_logprobs(logits, micro.from_position(start))
            logprobs = torch.nn.functional.pad(logprobs, (start, 0))
            return logits.new_zeros(()), torch.zeros((), dtype=torch.int, device=logits.device), logprobs

        order, micro_batches = self._split(batch)
        outputs = self._run(model, micro_batches, collect, forward_only=True, every_position=every_position)
        if not parallel_state.is_pipeline_last_stage():
            return None
        if order is None:
            return torch.cat(outputs)
        return merge_rows(order, outputs, (batch.size, batch.seq_length - 1))

    def _from_last_stage(self, tensor: Optional[torch.Tensor], shape) -> torch.Tensor:
        """Broadcast a float32 tensor held by the last pipeline stage to the whole PP group."""
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return tensor
        if tensor is None:
            tensor = torch.empty(shape, dtype=torch.float32, device=self.device)
        dist.broadcast(tensor, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
        return tensor

    def _reduce_metrics(self, outputs: list) -> dict[str, float]:
        """Global metrics from the per-micro-batch sums: reduced over data parallel on the last
        pipeline stage, then sent to the other stages."""
        values = None
        if parallel_state.is_pipeline_last_stage():
            dp_group = parallel_state.get_data_parallel_group()
            sums = all_reduce_sums(torch.stack([o["sums"] for o in outputs]).sum(0), self.device, dp_group)
            extrema = torch.stack([o["extrema"] for o in outputs]).amax(0)
            dist.all_reduce(extrema, op=dist.ReduceOp.MAX, group=dp_group)
            values = torch.tensor([*sums, *extrema.tolist()], dtype=torch.float32, device=self.device)
        *sums, neg_ratio_min, ratio_max = self._from_last_stage(values, (len(_SUMS) + 2,)).tolist()
        totals = dict(zip(_SUMS, sums))
        tokens = max(totals["num_tokens"], 1.0)
        metrics = {"loss": totals["loss_sum"] / max(totals["count"], 1.0), "num_tokens": totals["num_tokens"]}
        metrics.update({name: totals[name] / tokens for name in TOKEN_METRICS})
        metrics.update(ratio_min=-neg_ratio_min, ratio_max=ratio_max)
        return metrics
