"""benchmarks/gpu_check.py's dry run: the code path a GPU machine runs, on the CPU with a tiny model.

The GPU figures come only from a run on a GPU; here the report must be complete and its numbers
consistent with each other and with what is computed independently below.
"""
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from gdpo_megatron.checkpoint.layout import hf_shapes
from gdpo_megatron.config.policy import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    run = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert (out / "gpu_check.md").read_text().startswith("# gpu-check (dry run on the CPU)")
    return json.loads((out / "gpu_check.json").read_text())


def test_every_part_ran_without_an_error(report):
    assert report["dry_run"] is True and report["device"]["cuda"] is False
    for part in ("tests", "logprob_peak", "logprobs", "weight_stream", "checkpoint", "sleep_copy", *report["update"]):
        assert "error" not in (report[part] if isinstance(part, str) else part), part
    tests = report["tests"]
    assert tests["returncode"] == 0 and tests["failed"] == 0
    assert tests["skipped"] > 0 and tests["passed"] == 0  # every gpu-marked test skips without CUDA


def test_update_figures_agree_with_each_other(report):
    (update,) = report["update"]
    assert update["model"] == "tiny" and update["micro_batches"] >= 2  # the token budget splits the rows
    assert update["seconds_per_step"] == statistics.median(update["seconds"])
    assert update["tokens_per_s"] == pytest.approx(update["tokens_per_step"] / update["seconds_per_step"])
    # at least 6 x parameters x tokens (causal attention's term comes on top); no bf16 peak on a CPU
    flops = update["tflops"] * 1e12 * update["seconds_per_step"]
    assert flops >= 6 * update["parameters"] * update["tokens_per_step"] * 0.99
    assert update["mfu"] is None and update["peak_allocated_gib"] is None
    # the plan holds at least the bf16 weights, fp32 gradients and Adam's fp32 state of the model
    assert update["plan_gib"] * GIB >= (2 + 4 + 12) * update["parameters"]


def test_the_log_prob_step_holds_what_the_plan_counts(report):
    """bf16 logits (2 bytes) and three fp32 buffers per element, planned and measured."""
    peak = report["logprob_peak"]
    assert peak["model"] == "tiny" and peak["positions"] == report["update"][0]["micro_batch_tokens"]
    assert peak["plan_bytes_per_logit"] == 2 + 3 * 4
    assert peak["measured_over_plan"] == pytest.approx(peak["measured_bytes_per_logit"] / peak["plan_bytes_per_logit"])
    assert 0.9 <= peak["measured_over_plan"] <= 1.1


def test_the_policy_matches_transformers_and_the_weights_travel_exactly(report):
    rows, length = 2, 48
    assert report["logprobs"]["fp32"]["tokens"] == rows * (length - 1)
    assert report["logprobs"]["fp32"]["max_abs"] < 1e-4
    assert report["logprobs"]["bf16"]["mean_abs"] < 1e-2
    stream = report["weight_stream"]
    assert stream["logits_equal"] and stream["logits_max_abs"] == 0.0
    assert stream["tensors"] == len(hf_shapes(ModelConfig.preset("tiny", tie_word_embeddings=True,
                                                                   add_qkv_bias=True)))
    assert stream["policy_mean_abs"] < 1e-2  # bf16: the policy's own kernels against transformers'
    checkpoint = report["checkpoint"]
    assert checkpoint["bit_exact"] and checkpoint["mismatched"] == [] and checkpoint["tensors"] > 0


def test_the_level_1_sleep_cost_is_left_to_a_gpu(report):
    from gdpo_megatron.preflight.plan import total_params

    copy = report["sleep_copy"]
    assert copy["skipped"] == "pinned memory needs CUDA"
    assert copy["weights_7b_gib"] == pytest.approx(2 * total_params(ModelConfig.preset("qwen2-7b")) / GIB)
