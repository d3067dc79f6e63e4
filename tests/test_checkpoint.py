"""Training checkpoints: layout changes, exact resume after SIGKILL, pruning, damaged files."""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
import random
import shutil
import signal

import numpy as np
import pytest
import torch

from gdpo_megatron.checkpoint.manager import WRITER_THREADS, CheckpointError, CheckpointManager, read_training_state
from gdpo_megatron.distributed.launch import free_port
from gdpo_megatron.policy.batch import PolicyBatch
from gdpo_megatron.config.policy import ModelConfig, OptimConfig, ParallelConfig, PolicyConfig
from gdpo_megatron.device import transformer_engine_available
from support.placement import this_rank
from test_convert import megatron_logits

VOCAB = 250
B, T = 4, 12
STEPS, SAVE_EVERY, KILL_AFTER = 6, 2, 5  # killed after step 5: resume replays steps 5 and 6


def tiny_policy(tp: int = 1) -> PolicyConfig:
    return PolicyConfig(
        model=ModelConfig.preset("tiny", vocab_size=VOCAB, make_vocab_size_divisible_by=64),
        parallel=ParallelConfig(tensor_model_parallel_size=tp),
        # warmup + cosine decay: a resumed run needs the scheduler's state too
        optim=OptimConfig(lr=1e-3, lr_warmup_steps=2, lr_decay_steps=10, lr_decay_style="cosine"),
        micro_batch_size=2,
    )


def sampled_batch() -> PolicyBatch:
    """A batch drawn from the python, numpy and torch global RNGs (all three must be restored)."""
    ids = torch.randint(0, VOCAB, (B, T))
    prompt = torch.tensor([random.randint(1, 4) for _ in range(B)])
    completion = torch.from_numpy(np.random.randint(2, T - 4, size=B))
    pos = torch.arange(T).unsqueeze(0)
    mask = (pos >= prompt.unsqueeze(1)) & (pos < (prompt + completion).unsqueeze(1))
    old = -5.5 + 0.3 * torch.randn(B, T - 1)
    return PolicyBatch(ids, mask, torch.randn(B), rollout_logprobs=old)


def seed_batches(seed: int = 0) -> None:
    """Seed the three RNGs that :func:`sampled_batch` draws from (ranks of one tensor-parallel
    group must draw the same batch)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# --- functions run on every rank ---------------------------------------------------------------


def train(root, resume: bool, kill_after: int | None = None) -> dict[int, float]:
    """Train to ``STEPS`` (saving every ``SAVE_EVERY``), from scratch or the latest checkpoint."""
    from gdpo_megatron.policy.worker import PolicyWorker
    from support.policy import resolved_here

    manager = CheckpointManager(root, keep_last=2)
    losses = {}
    with PolicyWorker(resolved_here(tiny_policy()), this_rank()) as worker:
        if resume:
            state = manager.load(worker.model, worker.optimizer, worker.scheduler)
            first = state.data_position["next_step"]
        else:
            random.seed(0)
            np.random.seed(0)
            first = 1
        for step in range(first, STEPS + 1):
            losses[step] = worker.train_step(sampled_batch())["loss"]
            if step % SAVE_EVERY == 0:
                manager.save(step, worker.model, worker.optimizer, worker.scheduler,
                             data_position={"next_step": step + 1}, config={"policy": {"seed": 1234}})
            if step == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
    return losses


def _killed_rank(rank: int, port: int, root) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    train(root, resume=False, kill_after=KILL_AFTER)


def save_trained(root, tp: int):
    """One train step at ``tp``, then a checkpoint of step 1; returns the logits and the LR."""
    from gdpo_megatron.policy.worker import PolicyWorker
    from support.policy import resolved_here

    config = tiny_policy(tp)
    seed_batches()
    batch = sampled_batch()
    with PolicyWorker(resolved_here(config), this_rank()) as worker:
        worker.train_step(batch)
        CheckpointManager(root).save(1, worker.model, worker.optimizer, worker.scheduler, data_position={"next_step": 2},
                                     config={"policy": {"model": dataclasses.asdict(config.model)}})
        return megatron_logits(worker.gpt_model, VOCAB), worker.optimizer.param_groups[0]["lr"]


def load_trained(root, tp: int):
    from gdpo_megatron.policy.worker import PolicyWorker
    from support.policy import resolved_here

    with PolicyWorker(resolved_here(tiny_policy(tp)), this_rank()) as worker:
        state = CheckpointManager(root).load(worker.model, worker.optimizer, worker.scheduler)
        return state, megatron_logits(worker.gpt_model, VOCAB), worker.optimizer.param_groups[0]["lr"]


def load_error(root):
    from gdpo_megatron.policy.worker import PolicyWorker
    from support.policy import resolved_here

    with PolicyWorker(resolved_here(tiny_policy()), this_rank()) as worker:
        try:
            CheckpointManager(root).load(worker.model)
        except CheckpointError as e:
            return str(e)
    return None


# --- tests -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_at_tp2(gloo_world_2, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp2")
    logits, lr = gloo_world_2.run(save_trained, root, 2)[0]
    return root, logits, lr


def test_saved_at_tp2_loads_at_tp1_with_the_same_logits(gloo_world_2, saved_at_tp2):
    root, logits, lr = saved_at_tp2
    for state, loaded_logits, loaded_lr in gloo_world_2.run(load_trained, root, 1):
        torch.testing.assert_close(loaded_logits, logits, atol=1e-5, rtol=0)
        assert loaded_lr == lr > 0
        assert state.step == 1 and state.data_position == {"next_step": 2} and state.world_size == 2
        assert state.config["policy"]["model"]["vocab_size"] == VOCAB


def test_each_rank_writes_its_share_in_several_files_at_once(saved_at_tp2):
    root, _, _ = saved_at_tp2
    names = sorted(p.name for p in (root / "step_1" / "dist").glob("*.distcp"))
    assert names == [f"__{rank}_{i}.distcp" for rank in range(2) for i in range(WRITER_THREADS)]


@pytest.mark.slow
def test_resume_after_sigkill_repeats_the_uninterrupted_losses(gloo_world_2, tmp_path):
    expected = gloo_world_2.run(train, tmp_path / "uninterrupted", False)[0]

    root = tmp_path / "killed"
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    ranks = [ctx.Process(target=_killed_rank, args=(r, port, root)) for r in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=300)
    assert [p.exitcode for p in ranks] == [-signal.SIGKILL] * 2
    assert CheckpointManager(root).latest_step() == 4

    resumed = gloo_world_2.run(train, root, True)[0]
    assert sorted(resumed) == [5, 6]
    for step, loss in resumed.items():
        assert loss == pytest.approx(expected[step], abs=1e-6, rel=0)
    assert len({round(loss, 6) for loss in expected.values()}) == STEPS  # the losses do move
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_4", "step_6"]  # keep_last=2


def test_keep_last_latest_pointer_and_half_written_checkpoints(gloo_world_2, saved_at_tp2, tmp_path):
    source, _, _ = saved_at_tp2
    root = tmp_path / "root"
    root.mkdir()
    for step in (3, 7, 12):
        shutil.copytree(source / "step_1", root / f"step_{step}")
    shutil.copytree(source / "step_1", root / ".tmp-step_20")  # a crash while writing step 20
    (root / ".tmp-step_20" / "manifest.json").unlink()
    manager = CheckpointManager(root, keep_last=2)
    with pytest.warns(UserWarning, match=r"ignoring incomplete checkpoint .*\.tmp-step_20"):
        assert manager.latest_step() == 12
    with pytest.warns(UserWarning, match="incomplete"):
        assert manager.complete_steps() == [3, 7, 12]
    manager._prune(keep=12)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_12", "step_7"]
    assert (source / "latest").read_text().strip() == "step_1"
    assert read_training_state(root / "step_12").step == 1  # copied from step 1


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_checkpoint_files_are_named(saved_at_tp2, tmp_path, damage):
    source, _, _ = saved_at_tp2
    directory = tmp_path / "step_1"
    shutil.copytree(source / "step_1", directory)
    shard = sorted((directory / "dist").glob("*.distcp"))[0]
    data = shard.read_bytes()
    if damage == "truncate":
        shard.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        shard.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    else:
        shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard}: {'missing' if damage == 'delete' else 'corrupted'}"):
        CheckpointManager(tmp_path).verify(directory)


def test_load_names_the_missing_manifest_or_state_file(gloo_world_2, saved_at_tp2, tmp_path):
    source, _, _ = saved_at_tp2
    shutil.copytree(source / "step_1", tmp_path / "step_1")
    (tmp_path / "step_1" / "manifest.json").unlink()
    for message in gloo_world_2.run(load_error, tmp_path):
        assert message == f"{tmp_path / 'step_1' / 'manifest.json'}: missing (the checkpoint is incomplete)"

    (tmp_path / "step_1" / "trainer_state.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"trainer_state.json: corrupted"):
        read_training_state(tmp_path / "step_1")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        CheckpointManager(tmp_path / "empty").load(None)


def continue_after_reload(root, distributed_optimizer: bool):
    """Loss of step 3 when training on after step 1, and after reloading step 1's checkpoint.

    Step 3's loss follows step 2's update, which depends on the Adam moments and step count
    and on the LR schedule restored from the checkpoint.
    """
    from gdpo_megatron.policy.worker import PolicyWorker
    from support.policy import resolved_here

    config = tiny_policy()
    config.optim.use_distributed_optimizer = distributed_optimizer
    torch.manual_seed(0)
    batches = [sampled_batch() for _ in range(3)]
    with PolicyWorker(resolved_here(config), this_rank()) as worker:
        worker.train_step(batches[0])
        CheckpointManager(root).save(1, worker.model, worker.optimizer, worker.scheduler)
        worker.train_step(batches[1])
        continued = worker.train_step(batches[2])["loss"]
    losses = []
    for optimizer_too in (True, False):  # without the optimizer's state the loss must differ
        with PolicyWorker(resolved_here(config), this_rank()) as worker:
            CheckpointManager(root).load(worker.model, worker.optimizer if optimizer_too else None, worker.scheduler)
            worker.train_step(batches[1])
            losses.append(worker.train_step(batches[2])["loss"])
    return continued, *losses


def _use_the_gpu_of_this_rank() -> None:
    torch.cuda.set_device(torch.distributed.get_rank())


def distributed_optimizer_across_layouts(root, sharding: str):
    """The distributed optimizer saved at TP=2 (DP=1), then loaded at TP=1 (DP=2) on the same ranks.

    Returns the saved layout and format, and the loss of step 3 continued at TP=2 and reloaded at
    TP=1 (or the error of the reload)."""
    from gdpo_megatron.policy.worker import PolicyWorker
    from support.policy import resolved_here

    seed_batches()
    batches = [sampled_batch() for _ in range(3)]  # the same on both ranks: one TP=2 replica
    configs = {}
    for tp in (1, 2):
        config = tiny_policy(tp)
        optim = dataclasses.replace(config.optim, use_distributed_optimizer=True)
        configs[tp] = dataclasses.replace(config, optim=optim)
    manager = CheckpointManager(root, optimizer_sharding=sharding)
    with PolicyWorker(resolved_here(configs[2]), this_rank()) as worker:
        worker.train_step(batches[0])
        manager.save(1, worker.model, worker.optimizer, worker.scheduler)
        worker.train_step(batches[1])
        continued = worker.train_step(batches[2])["loss"]
    state = read_training_state(root / "step_1")
    with PolicyWorker(resolved_here(configs[1]), this_rank()) as worker:
        try:
            manager.load(worker.model, worker.optimizer, worker.scheduler)
        except CheckpointError as e:
            return state.layout, state.optimizer_sharding, continued, str(e)
        worker.train_step(batches[1])
        return state.layout, state.optimizer_sharding, continued, worker.train_step(batches[2])["loss"]


def test_distributed_optimizer_in_dp_reshardable_format_refuses_another_tp_size(gloo_world_2, tmp_path):
    for layout, sharding, _, error in gloo_world_2.run(distributed_optimizer_across_layouts, tmp_path,
                                                       "dp_reshardable"):
        assert layout == {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1}
        assert sharding == "dp_reshardable"
        assert error.startswith(f"{tmp_path / 'step_1'}: the distributed optimizer's state was saved in "
                                "megatron-core's dp_reshardable format")
        assert "tensor_model_parallel_size=2 -> 1" in error
        assert "checkpoint.optimizer_sharding=fully_reshardable" in error


def _plain_tensors(directory) -> dict[str, torch.Tensor]:
    """A dist_checkpointing directory's tensors by dotted name (collective: every rank reads)."""
    from megatron.core import dist_checkpointing

    def flat(tree, prefix=""):
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from flat(value, f"{prefix}{key}.")
            elif isinstance(value, torch.Tensor):
                yield f"{prefix}{key}", value

    return dict(flat(dist_checkpointing.load_plain_tensors(str(directory))))


def fully_reshardable_two_ways(root):
    """One step of the distributed optimizer at DP=2, its state saved as fully_reshardable by the
    manager and by megatron-core's default variant of the format (an NCCL all-gather to every
    rank, here over gloo); both read back as plain tensors, with the model's weights."""
    from megatron.core import dist_checkpointing

    from gdpo_megatron.checkpoint.manager import InProcessTorchDistSave
    from gdpo_megatron.checkpoint.weight_stream import unwrap
    from gdpo_megatron.policy import cpu_compat
    from gdpo_megatron.policy.worker import PolicyWorker
    from support.policy import resolved_here

    seed_batches()
    config = tiny_policy(1)
    config = dataclasses.replace(config, optim=dataclasses.replace(config.optim, use_distributed_optimizer=True))
    with PolicyWorker(resolved_here(config), this_rank()) as worker:
        worker.train_step(sampled_batch())
        CheckpointManager(root / "manager", optimizer_sharding="fully_reshardable").save(
            1, worker.model, worker.optimizer)
        with cpu_compat.device_scope():
            model_state = unwrap(worker.model).sharded_state_dict()
            optimizer_state = worker.optimizer.sharded_state_dict(
                model_state, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
            if torch.distributed.get_rank() == 0:
                (root / "default").mkdir()
            torch.distributed.barrier()
            dist_checkpointing.save({"model": model_state, "optimizer": optimizer_state}, str(root / "default"),
                                    sharded_strategy=InProcessTorchDistSave())
    saved = read_training_state(root / "manager" / "step_1").optimizer_sharding
    return saved, _plain_tensors(root / "manager" / "step_1" / "dist"), _plain_tensors(root / "default")


def test_fully_reshardable_gathers_on_one_rank_what_megatrons_default_variant_saves(gloo_world_2, tmp_path):
    """The memory-efficient variant (gloo gather to data-parallel rank 0) stores the same
    per-parameter Adam state as megatron-core's default one; the fp32 master weights in it are
    the model's."""
    saved, ours, default = gloo_world_2.run(fully_reshardable_two_ways, tmp_path)[0]
    assert saved == "fully_reshardable"
    assert sorted(ours) == sorted(default)
    for name, tensor in default.items():
        assert torch.equal(ours[name], tensor), name
    weights = [n for n in ours if not n.startswith("optimizer.")]  # stacked over layers
    for name in weights:
        assert torch.equal(ours[f"optimizer.state.param.{name}"], ours[name]), name
        assert ours[f"optimizer.state.exp_avg_sq.{name}"].abs().sum() > 0, name


# megatron-core 0.16.1 loads the distributed optimizer's state into TE's (or Apex's) Adam only:
# torch's Adam has no per-parameter ``step`` before its first step (CheckpointManager says so).
needs_te_adam = pytest.mark.skipif(not transformer_engine_available(), reason="needs Transformer Engine's Adam")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.mark.gpu
@two_gpus
@needs_te_adam
def test_distributed_optimizer_in_fully_reshardable_format_resumes_at_another_tp_size(tmp_path):
    from support.local_world import LocalWorld

    with LocalWorld(2, backend="nccl") as world:
        world.run(_use_the_gpu_of_this_rank)
        for layout, sharding, continued, reloaded in world.run(distributed_optimizer_across_layouts, tmp_path,
                                                               "fully_reshardable"):
            assert sharding == "fully_reshardable" and layout["tensor_model_parallel_size"] == 2
            assert reloaded == pytest.approx(continued, rel=1e-3)  # bf16: TP=1 and TP=2 sum in other orders


def test_optimizer_state_survives_a_reload(gloo_world_2, tmp_path):
    for continued, reloaded, without_optimizer in gloo_world_2.run(continue_after_reload, tmp_path, False):
        assert reloaded == pytest.approx(continued, abs=1e-6, rel=0)
        assert abs(without_optimizer - continued) > 1e-4


@pytest.mark.gpu
@two_gpus
@needs_te_adam
def test_distributed_optimizer_state_survives_a_reload(tmp_path):
    """Data parallelism over NCCL, one GPU per rank, as the trainer runs it."""
    from support.local_world import LocalWorld

    with LocalWorld(2, backend="nccl") as world:
        world.run(_use_the_gpu_of_this_rank)
        for continued, reloaded, without_optimizer in world.run(continue_after_reload, tmp_path, True):
            assert reloaded == pytest.approx(continued, abs=1e-6, rel=0)
            assert abs(without_optimizer - continued) > 1e-4
