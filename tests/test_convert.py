"""Hugging Face <-> Megatron conversion: layout functions, import, export, the weight stream, the CLI.

Reference values come from transformers' own Llama / Qwen2 models and from layouts built
element by element in this file.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from support.placement import this_rank

from gdpo_megatron.checkpoint.layout import (
    ModelLayout, merge_qkv, rule_for, split_qkv, to_hf, to_megatron, tp_shard, tp_unshard,
)

VOCAB = 250  # Megatron pads it to 256 rows: exercises the vocabulary padding
ARCHS = {
    "llama": dict(tie_word_embeddings=False),  # GQA: 4 query heads in 2 groups
    "qwen2": dict(tie_word_embeddings=True),  # QKV biases, tied embeddings
}
INPUT_IDS = torch.tensor([[1, 17, 42, 249, 3, 99, 7, 128], [5, 0, 200, 31, 31, 64, 2, 11]])


# --- tiny random Hugging Face models ------------------------------------------------------------


def make_hf_model(arch: str, seed: int = 0):
    """A random ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` whose norms and biases are not trivial."""
    import transformers

    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    config = config_class(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        rope_theta=50000.0, rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
        **ARCHS[arch],
    )
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.5)
    return model


def make_tokenizer():
    """A word-level tokenizer over ``VOCAB`` made-up words."""
    import tokenizers
    import transformers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                                bos_token="<s>", eos_token="</s>")


def hf_logits(model, input_ids=INPUT_IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids).logits


@pytest.fixture(scope="module", params=sorted(ARCHS))
def hf_dir(request, tmp_path_factory):
    """A saved random model of each architecture and its logits on ``INPUT_IDS``."""
    directory = tmp_path_factory.mktemp(request.param)
    model = make_hf_model(request.param)
    model.save_pretrained(directory)
    make_tokenizer().save_pretrained(directory)
    return directory, model, hf_logits(model)


# --- functions run on every gloo rank ----------------------------------------------------------


def build_megatron(hf_directory, tp: int, pp: int = 1):
    """Megatron parallel state and a model of the Hugging Face directory's shape (random weights)."""
    from gdpo_megatron.checkpoint.hf_config import model_config_from_hf, read_hf_config
    from gdpo_megatron.policy import model as policy_model
    from gdpo_megatron.config.policy import ParallelConfig
    from support.policy import precision_here

    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    placement = this_rank()
    policy_model.initialize_model_parallel(parallel)
    config = model_config_from_hf(read_hf_config(hf_directory))
    return config, policy_model.build_model(config, placement, parallel, precision_here())


def megatron_logits(gpt, vocab_size: int, input_ids=INPUT_IDS) -> torch.Tensor:
    """Full-vocabulary logits of a PP=1 model (gathered over tensor-parallel ranks)."""
    from megatron.core import tensor_parallel

    from gdpo_megatron.policy import cpu_compat

    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    with torch.no_grad(), cpu_compat.device_scope():
        logits = gpt(input_ids, positions, attention_mask=None)
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    return logits[..., :vocab_size]


def import_logits(hf_directory, tp: int):
    from gdpo_megatron.checkpoint.hf_io import load_hf_weights
    from gdpo_megatron.policy.model import destroy_model_parallel

    try:
        config, gpt = build_megatron(hf_directory, tp)
        load_hf_weights(gpt, config, hf_directory)
        return megatron_logits(gpt, config.vocab_size)
    finally:
        destroy_model_parallel()


def import_then_export(hf_directory, out_dir, tp: int, pp: int, max_shard_bytes: int):
    """Import at TP/PP, export in fp32 and in bf16 (to ``out_dir``-bf16), and return what the
    weight stream yields on this rank and the rank's output-layer shard (the last stage's)."""
    from gdpo_megatron.checkpoint.hf_config import read_hf_config
    from gdpo_megatron.checkpoint.hf_io import load_hf_weights, save_hf_checkpoint
    from gdpo_megatron.checkpoint.weight_stream import iter_hf_weights
    from gdpo_megatron.policy.model import destroy_model_parallel

    try:
        config, gpt = build_megatron(hf_directory, tp, pp)
        load_hf_weights(gpt, config, hf_directory)
        for dtype, out in ((None, out_dir), (torch.bfloat16, out_dir.with_name(out_dir.name + "-bf16"))):
            save_hf_checkpoint(gpt, config, out, base_hf_config=read_hf_config(hf_directory),
                               tokenizer_dir=hf_directory, max_shard_bytes=max_shard_bytes, dtype=dtype)
        output_layer = dict(gpt.named_parameters()).get("output_layer.weight")
        return ([(name, tensor.clone()) for name, tensor in iter_hf_weights(gpt, config)],
                None if output_layer is None else output_layer.detach().clone())
    finally:
        destroy_model_parallel()


def expect_import_error(hf_directory):
    from gdpo_megatron.checkpoint.hf_io import load_hf_weights
    from gdpo_megatron.policy.model import destroy_model_parallel

    try:
        config, gpt = build_megatron(hf_directory, 1)
        load_hf_weights(gpt, config, hf_directory)
    except (KeyError, ValueError, FileNotFoundError) as e:
        return str(e)
    finally:
        destroy_model_parallel()
    return None


def run_cli(argv):
    from gdpo_megatron.commands.convert import main

    main(argv)
    dist.barrier()


# --- layout functions (pure) -------------------------------------------------------------------

LAYOUT = ModelLayout(num_layers=2, num_attention_heads=6, num_query_groups=2, head_dim=3,
                     vocab_size=10, padded_vocab_size=16, tie_word_embeddings=False)


def test_merge_qkv_matches_megatron_group_layout_built_row_by_row():
    hidden = 5
    q, k, v = torch.randn(6 * 3, hidden), torch.randn(2 * 3, hidden), torch.randn(2 * 3, hidden)
    rows = []
    for group in range(2):  # per group: its 3 query heads, its key head, its value head
        for head in range(3 * group, 3 * group + 3):
            rows += [q[head * 3 + i] for i in range(3)]
        rows += [k[group * 3 + i] for i in range(3)]
        rows += [v[group * 3 + i] for i in range(3)]
    expected = torch.stack(rows)
    assert torch.equal(merge_qkv(q, k, v, LAYOUT), expected)
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(expected, LAYOUT), (q, k, v)))
    bias = merge_qkv(q[:, 0], k[:, 0], v[:, 0], LAYOUT)  # biases follow the same layout
    assert torch.equal(bias, expected[:, 0])


def test_fc1_shards_hold_their_slice_of_gate_and_of_up():
    gate, up = torch.randn(8, 5), torch.randn(8, 5)
    name = "decoder.layers.1.mlp.linear_fc1.weight"
    full = to_megatron(name, [gate, up], LAYOUT)
    shards = [tp_shard(name, full, r, 4) for r in range(4)]
    for r, shard in enumerate(shards):
        assert torch.equal(shard, torch.cat([gate[2 * r : 2 * r + 2], up[2 * r : 2 * r + 2]]))
    assert torch.equal(tp_unshard(name, shards), full)
    row_parallel = "decoder.layers.0.mlp.linear_fc2.weight"
    w = torch.randn(5, 8)
    assert torch.equal(tp_shard(row_parallel, w, 1, 2), w[:, 4:])
    assert torch.equal(tp_shard("decoder.final_layernorm.weight", w[0], 1, 2), w[0])


def test_both_layer_specs_map_to_the_same_hugging_face_names():
    pairs = {
        "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
        "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    }
    for local, te in pairs.items():
        assert rule_for(f"decoder.layers.7.{local}")[1] == rule_for(f"decoder.layers.7.{te}")[1]
    assert rule_for("decoder.layers.7.input_layernorm.weight")[1] == ("model.layers.7.input_layernorm.weight",)
    assert rule_for("decoder.layers.3.mlp.linear_fc1.layer_norm_weight")[1] == (
        "model.layers.3.post_attention_layernorm.weight",)
    with pytest.raises(KeyError, match="decoder.layers.0.mlp.router.weight"):
        rule_for("decoder.layers.0.mlp.router.weight")


def test_vocab_padding_round_trips_and_checks_rows():
    embedding = torch.randn(10, 4)
    padded = to_megatron("embedding.word_embeddings.weight", [embedding], LAYOUT)
    assert padded.shape == (16, 4) and torch.equal(padded[10:], torch.zeros(6, 4))
    assert torch.equal(to_hf("output_layer.weight", padded, LAYOUT)[0][1], embedding)
    with pytest.raises(ValueError, match="expected 10, got 11"):
        to_megatron("embedding.word_embeddings.weight", [torch.randn(11, 4)], LAYOUT)


# --- import / export against transformers ------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2])
def test_imported_model_gives_the_hugging_face_logits(gloo_world_2, hf_dir, tp):
    directory, _, expected = hf_dir
    for logits in gloo_world_2.run(import_logits, directory, tp):
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_export_is_bit_identical_and_loads_in_transformers(gloo_world_2, hf_dir, tmp_path, tp, pp):
    import transformers

    directory, model, expected_logits = hf_dir
    out = tmp_path / "exported"
    results = gloo_world_2.run(import_then_export, directory, out, tp, pp, 40_000)

    original = {n: t for n, t in model.state_dict().items()
                if not (model.config.tie_word_embeddings and n == "lm_head.weight")}
    exported = {}
    for path in out.glob("*.safetensors"):
        exported.update(load_file(path))
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    head = model.state_dict()["lm_head.weight"]  # the embedding when tied
    for rank, (stream, output_layer) in enumerate(results):
        assert sorted(n for n, _ in stream) == sorted(original)  # every rank sees every full tensor, once
        assert all(torch.equal(t, original[n]) for n, t in stream)
        if output_layer is not None:  # a pipeline's last stage holds the head even when tied
            rows = output_layer.shape[0]
            padded = torch.cat([head, torch.zeros(256 - VOCAB, head.shape[1])])
            assert torch.equal(output_layer, padded[rank * rows : (rank + 1) * rows] if tp > 1 else padded)
    holders = sum(output_layer is not None for _, output_layer in results)
    assert holders == (1 if pp == 2 else 0 if model.config.tie_word_embeddings else 2)

    bf16 = out.with_name(out.name + "-bf16")
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    for path in bf16.glob("*.safetensors"):
        for name, tensor in load_file(path).items():
            assert torch.equal(tensor, original[name].to(torch.bfloat16)), name

    index = json.loads((out / "model.safetensors.index.json").read_text())  # 40 kB shards: several files
    assert len(set(index["weight_map"].values())) > 1
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(model)
    torch.testing.assert_close(hf_logits(reloaded), expected_logits, atol=0, rtol=0)


def test_cli_round_trip_through_a_megatron_checkpoint_at_other_layouts(gloo_world_2, hf_dir, tmp_path):
    import transformers

    directory, model, expected_logits = hf_dir
    root, out = tmp_path / "megatron", tmp_path / "hf"
    gloo_world_2.run(run_cli, ["hf-to-megatron", str(directory), str(root), "--tp", "2", "--dtype", "fp32"])
    assert (root / "step_0" / "manifest.json").is_file() and (root / "latest").read_text().strip() == "step_0"
    gloo_world_2.run(run_cli, ["megatron-to-hf", str(root), str(out), "--pp", "2"])

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name
    torch.testing.assert_close(hf_logits(reloaded), expected_logits, atol=0, rtol=0)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # copied from the imported directory
        assert (out / name).read_bytes() == (directory / name).read_bytes()
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(out)
    assert tokenizer("w5 w249 nope")["input_ids"] == [5, 249, 0]


def test_import_names_the_missing_or_unexpected_tensor(gloo_world_2, hf_dir, tmp_path):
    directory, model, _ = hf_dir
    state = {n: t.clone() for n, t in model.state_dict().items() if n != "model.layers.1.mlp.up_proj.weight"}
    missing = tmp_path / "missing"
    model.save_pretrained(missing, state_dict=state)
    for message in gloo_world_2.run(expect_import_error, missing):
        assert "'model.layers.1.mlp.up_proj.weight' is missing" in message

    state = {**model.state_dict(), "model.layers.0.self_attn.q_norm.weight": torch.ones(16)}
    extra = tmp_path / "extra"
    model.save_pretrained(extra, state_dict=state)
    for message in gloo_world_2.run(expect_import_error, extra):
        assert "unexpected tensor 'model.layers.0.self_attn.q_norm.weight'" in message


def test_unsupported_hugging_face_configs_are_refused():
    from gdpo_megatron.checkpoint.hf_config import model_config_from_hf

    config = make_hf_model("llama").config.to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    assert model_config_from_hf(config).num_query_groups == 2
    with pytest.raises(ValueError, match="architectures: expected one of"):
        model_config_from_hf({**config, "architectures": ["MistralForCausalLM"]})
    with pytest.raises(ValueError, match="hidden_act: only 'silu'"):
        model_config_from_hf({**config, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="rope_type: only 'default'"):
        model_config_from_hf({**config, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}})


def test_cli_runs_as_a_single_process_command(tmp_path):
    import os
    import subprocess
    import sys

    from gdpo_megatron.checkpoint.manager import read_training_state
    from gdpo_megatron.distributed.launch import free_port

    directory, root = tmp_path / "hf", tmp_path / "megatron"
    make_hf_model("llama").save_pretrained(directory)
    env = {**os.environ, "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "gdpo_megatron", "convert", "hf-to-megatron", str(directory), str(root)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == f"wrote {root / 'step_0'}"
    assert "import: 100%" in run.stderr  # the progress bar
    back = subprocess.run(
        [sys.executable, "-m", "gdpo_megatron", "convert", "megatron-to-hf", str(root), str(tmp_path / "back")],
        env={**env, "MASTER_PORT": str(free_port())}, capture_output=True, text=True, timeout=300,
    )
    assert back.returncode == 0, back.stderr[-3000:]
    assert back.stdout.strip() == f"wrote {tmp_path / 'back'}"
    # The libraries' known, harmless warnings (gdpo_megatron.quiet) are filtered: only the progress bars are left.
    for done, bar in ((run, "import"), (back, "export")):
        redraws = [part for line in done.stderr.splitlines() for part in line.split("\r") if part]
        assert redraws and all(part.startswith(f"{bar}: ") for part in redraws), done.stderr[-3000:]
    state = read_training_state(root / "step_0")
    assert state.config["hf_config"] == json.loads((directory / "config.json").read_text())
    assert state.config["model"]["vocab_size"] == VOCAB and state.world_size == 1
