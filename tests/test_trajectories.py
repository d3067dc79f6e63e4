"""Multi-turn rollouts: trajectory rows of the policy batch, chat-template continuations, and a
trainer run through a user's environment on the demo model."""
from pathlib import Path

import pytest
import torch

from gdpo_megatron.config import ConfigError, TrainConfig, load_config
from gdpo_megatron.data.chat import encode_prompt, render_prompt
from gdpo_megatron.environments import Trajectory
from gdpo_megatron.experience import Rollouts, to_policy_batch
from gdpo_megatron.trajectories import Span, TemplateMismatch, TrajectoryRollout, continuation_tokens

ROOT = Path(__file__).resolve().parents[1]
CITY_DESK = ROOT / "examples" / "environments" / "city_desk.py"


def _trajectory(prompt, spans):
    return TrajectoryRollout(prompt, spans, Trajectory.from_texts("env", [["x"]]), "answered",
                             sum(s.is_model for s in spans))


def test_only_the_model_spans_are_trained_with_their_sampling_logprobs():
    # prompt | model | environment | model | user | model, and a second row: prompt | model
    a = _trajectory([1, 2, 3], [Span([4, 5], [-0.1, -0.2]), Span([6, 7, 8]), Span([9], [-0.3]), Span([10]),
                                Span([11, 12], [-0.4, -0.5])])
    b = _trajectory([21, 22, 23, 24, 25], [Span([26], [-0.6])])
    rollouts = Rollouts([], torch.tensor([0, 1]), [a, b])
    batch = to_policy_batch(rollouts, 2, torch.tensor([1.0, -1.0]), torch.tensor([True, True]), pad_id=0,
                            pad_multiple=4)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [21, 22, 23, 24, 25, 26] + [0] * 6]
    model_positions = [[3, 4, 8, 10, 11], [5]]  # by hand: where each model token sits in its row
    expected_mask = torch.zeros(2, 12, dtype=torch.bool)
    expected_logprobs = torch.zeros(2, 11)
    for row, (positions, logprobs) in enumerate(zip(model_positions, [[-0.1, -0.2, -0.3, -0.4, -0.5], [-0.6]])):
        for p, lp in zip(positions, logprobs):
            expected_mask[row, p] = True
            expected_logprobs[row, p - 1] = lp  # the logprob of target p is predicted at p - 1
    assert torch.equal(batch.loss_mask, expected_mask)
    assert torch.equal(batch.rollout_logprobs, expected_logprobs)
    assert batch.lengths.tolist() == [12, 6]
    assert rollouts.num_tokens == [5, 1]
    batch.validate(vocab_size=32)
    assert int(batch.first_target()) == 2  # the first model token's target column
    # token-budget micro-batches keep each row's masks and logprobs
    order, micro = batch.split_by_tokens(12)
    assert [m.size for m in micro] == [1, 1] and order.tolist() == [0, 1]
    assert torch.equal(micro[1].loss_mask, expected_mask[1:, :6])
    assert torch.equal(micro[1].rollout_logprobs, expected_logprobs[1:, :5])
    # a rollout out of the update (the group filter) trains on nothing
    kept = to_policy_batch(rollouts, 2, torch.tensor([1.0, -1.0]), torch.tensor([False, True]), pad_id=0)
    assert not kept.loss_mask[0].any() and torch.equal(kept.loss_mask[1], expected_mask[1])


QWEN_LIKE = (  # Qwen2.5's layout: tool results grouped in a user turn as <tool_response> blocks
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DROPS_EARLIER_THOUGHTS = QWEN_LIKE.replace(
    "{{ m.content }}<|im_end|>\n{% endif %}",
    "{% if m.role == 'assistant' and not loop.last %}{{ m.content.split('</think>')[-1] }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endif %}")


def _tokenizer(template=None):
    """The demo model's tokenizer; with ``template``, Qwen's special tokens too."""
    from gdpo_megatron.demo.warmup import build_tokenizer

    tok = build_tokenizer()
    if template is not None:
        tok.add_special_tokens({"eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>"]})
        tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def tokenizers():
    return {"demo": _tokenizer(), "qwen_like": _tokenizer(QWEN_LIKE)}


@pytest.mark.parametrize("template", ["demo", "qwen_like"])
def test_continuations_extend_the_tokens_as_the_template_renders_the_chat(tokenizers, template):
    tok = tokenizers[template]
    chat = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "Weather in Oslo?"}]
    tokens = encode_prompt(tok, chat)
    turns = [
        ("[get_weather(city='Oslo')]", [{"role": "tool", "content": '{"weather": "rain"}'}]),
        ("[get_time(city='Oslo')]", [{"role": "tool", "content": "09:00"}, {"role": "tool", "content": "ok"}]),
        ("Rain, and it is nine.", [{"role": "user", "content": "And in Lima?"}]),
    ]
    for reply, new in turns:
        sampled = tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        text, following = continuation_tokens(tok, chat, sampled, "stop", new)
        assert text == reply  # the end-of-turn token is the template's, not the reply's
        earlier = list(tokens)
        tokens = tokens + sampled + following
        assert tokens[:len(earlier)] == earlier
        chat = [*chat, {"role": "assistant", "content": reply}, *new]
        assert tok.decode(tokens, skip_special_tokens=False) == render_prompt(tok, chat)
        assert tok.decode(following, skip_special_tokens=False).endswith(render_prompt(tok, chat)[-12:])
    # a reply cut by max_new_tokens: the template closes it
    cut = tok("[get_wea", add_special_tokens=False)["input_ids"]
    text, following = continuation_tokens(tok, chat, cut, "length", [{"role": "tool", "content": "err"}])
    whole = [*chat, {"role": "assistant", "content": text}, {"role": "tool", "content": "err"}]
    assert tok.decode(tokens + cut + following, skip_special_tokens=False) == render_prompt(tok, whole)


def test_a_template_that_rewrites_earlier_turns_cannot_be_continued():
    tok = _tokenizer(DROPS_EARLIER_THOUGHTS)
    chat = [{"role": "user", "content": "Weather in Oslo?"}]
    sampled = tok("<think>look</think>[get_weather(city='Oslo')]", add_special_tokens=False)["input_ids"]
    with pytest.raises(TemplateMismatch, match="renders the trajectory so far differently once tool messages follow"):
        continuation_tokens(tok, chat, sampled + [tok.eos_token_id], "stop", [{"role": "tool", "content": "rain"}])


def test_preflight_refuses_a_family_and_environment_that_do_not_fit():
    from gdpo_megatron.config import EnvironmentConfig
    from gdpo_megatron.environments.registry import check_family_environment

    with pytest.raises(ConfigError, match=r"^environment.name: data.family=multi_turn rolls out trajectories"):
        check_family_environment(EnvironmentConfig(), "multi_turn", True, None)
    with pytest.raises(ConfigError, match=r"^environment.name: data.family=tool is single-turn"):
        check_family_environment(EnvironmentConfig(name="bfcl"), "tool", False, None)
    check_family_environment(EnvironmentConfig(), "bfcl_multi_turn", True, "bfcl")
    check_family_environment(EnvironmentConfig(name="CityDesk", file=str(CITY_DESK)), "multi_turn", True, None)


# ---- how a rollout reacts to particular messages, from a policy that writes them ----------------

COUNTDOWN = """
from gdpo_megatron.environments import Environment


class Countdown(Environment):
    \"\"\"A game over after config["moves"] moves.\"\"\"

    def reset(self, config):
        self.left = config["moves"]
        return ""

    def tools(self):
        return [{"name": "move", "description": "One move.", "parameters": {"type": "dict", "properties": {}}}]

    def call(self, name, arguments):
        self.left -= 1
        self.done = self.left == 0
        return f"{self.left} left"
"""


class ScriptedPolicy:
    """Writes ``script[j][n]`` as sample ``j``'s ``n``-th model message (the rollout's keys are
    (prompt, sample, model turn)), in the demo tokenizer's tokens, ending on its EOS."""

    def __init__(self, script):
        self.tokenizer, self.script = _tokenizer(), script

    def continue_sequences(self, sequences, sampling, keys=None, on_completion=None):
        from gdpo_megatron.rollout.engine import Completion

        out = []
        for _, j, n in keys:
            ids = self.tokenizer(self.script[j][n], add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            out.append(Completion(ids, [0.0] * len(ids), "stop", self.script[j][n]))
        return out


def _roll_out_scripted(environment, config, script, later_turns):
    from gdpo_megatron.data.samples import Sample
    from gdpo_megatron.rollout.engine import SamplingConfig
    from gdpo_megatron.trajectories import TrajectoryRollouts

    sample = Sample("q", "multi_turn", [{"role": "user", "content": "Go."}],
                    {"environment_config": config, "later_turns": later_turns})
    policy = ScriptedPolicy(script)
    trajectories = TrajectoryRollouts(environment, 30.0, 4, 4096)
    try:
        rollouts = trajectories.roll_out(policy, [sample], len(script), SamplingConfig(max_new_tokens=64), [0])
    finally:
        trajectories.close()
    return rollouts, policy.tokenizer


def test_a_message_that_calls_nothing_ends_the_turn_as_an_answer_does():
    """``[]`` (or a list of comments only) runs no step: like a plain answer it ends the user turn
    and the next user message follows; no tool message is shown."""
    ref = f"{CITY_DESK}:CityDesk"
    later = [[{"role": "user", "content": "And in Rome?"}]]
    script = [["[]", "[  # lorem ipsum\n]"], ["<tool_call>[]</tool_call>", "Sunny."], ["Sunny.", "Rainy."]]
    rollouts, tok = _roll_out_scripted(ref, {}, script, later)
    for rollout, messages in zip(rollouts, script):
        assert rollout.ending == "answered" and rollout.model_turns == 2
        assert rollout.trajectory.turns == Trajectory.from_texts(ref, [[messages[0]], [messages[1]]]).turns
        (between,) = [tok.decode(s.token_ids) for s in rollout.spans if not s.is_model]
        assert "And in Rome?" in between and "tool" not in between
    assert len({tuple(s.token_ids) for s in rollouts[0].spans if not s.is_model}
               | {tuple(s.token_ids) for s in rollouts[2].spans if not s.is_model}) == 1


def test_an_environment_that_is_done_ends_the_trajectory(tmp_path):
    """The step after which the environment is ``done`` is the trajectory's last: no later
    message of the script is asked for, no user turn follows."""
    (tmp_path / "countdown.py").write_text(COUNTDOWN)
    ref = f"{tmp_path / 'countdown.py'}:Countdown"
    later = [[{"role": "user", "content": "Again."}]]
    script = [["[move()]", "[move()]", "[move()]"], ["[move()]", "Moved.", "[move()]"]]
    rollouts, _ = _roll_out_scripted(ref, {"moves": 2}, script, later)
    assert [r.ending for r in rollouts] == ["answered", "answered"]
    assert rollouts[0].trajectory.turns == Trajectory.from_texts(ref, [script[0][:2]]).turns  # over after 2 moves
    assert rollouts[0].model_turns == 2 and sum(not s.is_model for s in rollouts[0].spans) == 1
    # one move, an answer, the next user turn, the second move: over
    assert rollouts[1].trajectory.turns == Trajectory.from_texts(ref, [script[1][:2], script[1][2:]]).turns
    assert rollouts[1].model_turns == 3


# ---- a run on the demo model through a user's environment ---------------------------------------

CONFIG = "configs/multi_turn_cpu.yaml"  # CityDesk, the two-turn questions of examples/data/city_desk.jsonl


def _overrides(base_model, run_dir, steps, *extra):
    return [f"base_model={base_model}", f"run_dir={run_dir}", f"steps={steps}", "data.prompts_per_step=2",
            "rollout.group_size=2", "policy.micro_batch_size=2", "checkpoint.save_every=0",
            "checkpoint.export_hf=false", "logging.progress_bar=false", *extra]


def _train_and_roll_out(overrides):
    """Train, then roll out the first step's prompts once more with the trained engine."""
    from gdpo_megatron.experience import to_policy_batch
    from gdpo_megatron.rollout.engine import SamplingConfig
    from support.trainer import make_trainer

    trainer = make_trainer(load_config(TrainConfig, CONFIG, overrides))
    try:
        trainer.train()
        samples = [trainer.samples[i] for i in trainer.schedule.indices(0)]
        before = trainer.engine.prefix_cache
        rollouts = trainer.trajectories.roll_out(trainer.engine, samples, 2, SamplingConfig(max_new_tokens=48, seed=7),
                                                 list(range(len(samples))))
        cache = trainer.engine.prefix_cache - before
        batch = to_policy_batch(Rollouts([], torch.zeros(len(rollouts)), rollouts), 2, torch.ones(len(rollouts)),
                                torch.ones(len(rollouts), dtype=torch.bool), 0)
        decoded = [[(trainer.tokenizer.decode(s.token_ids), s.is_model) for s in r.spans] for r in rollouts]
        return rollouts, batch, decoded, (cache.queries, cache.hits)
    finally:
        trainer.close()


@pytest.mark.slow
def test_a_run_steps_trajectories_through_a_users_environment(demo_base_model, tmp_path):
    from gdpo_megatron.metrics import read_metrics
    from support.local_world import run_local

    run_dir = tmp_path / "run"
    ((rollouts, batch, decoded, (queries, hits)),) = run_local(
        _train_and_roll_out, 1, _overrides(demo_base_model, run_dir, 2))

    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["rollout/model_turns_mean"] > 1  # the model went again after the environment's replies
        assert r["rollout/observation_tokens_mean"] > 0
        assert r["rollout/prefix_cache_hit_frac"] > 0  # later turns reuse the earlier turns' blocks
        assert sum(r[f"rollout/ended_{e}_frac"] for e in ("answered", "turn_limit", "token_budget", "failed")) == 1
        assert r["rollout/ended_failed_frac"] == 0 and r["reward/multi_turn_state/failures"] == 0
        assert 0 <= r["reward/multi_turn_format/mean"] <= 1 and 0 <= r["reward/multi_turn_state/mean"] <= 1
        # the policy's recompute over the whole trajectory matches vLLM at the model's tokens
        assert r["rollout/logprob_mismatch"] < 1e-3 and r["train/num_tokens"] > 0
    assert hits > 0 and queries > hits

    observations = [text for spans in decoded for text, is_model in spans if not is_model]
    assert any('"city":' in text for text in observations), observations  # CityDesk's replies
    for rollout, row_mask, row_ids in zip(rollouts, batch.loss_mask, batch.input_ids):
        assert rollout.trajectory.environment.endswith("city_desk.py:CityDesk")
        assert rollout.model_turns == sum(s.is_model for s in rollout.spans) >= 1
        position = len(rollout.prompt_ids)
        for span in rollout.spans:  # masks: the model's spans, nothing of the environment's or the user's
            stop = position + len(span.token_ids)
            assert row_ids[position:stop].tolist() == span.token_ids
            assert row_mask[position:stop].all() if span.is_model else not row_mask[position:stop].any()
            position = stop
        assert not row_mask[:len(rollout.prompt_ids)].any() and not row_mask[position:].any()
        assert len(rollout.prompt_ids) + sum(len(s.token_ids) for s in rollout.spans) <= 320
        texts = [m.text for turn in rollout.trajectory.turns for m in turn]
        assert len(texts) == rollout.model_turns


def _train(overrides):
    from support.trainer import make_trainer

    trainer = make_trainer(load_config(TrainConfig, CONFIG, overrides))
    try:
        return trainer.train()
    finally:
        trainer.close()


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(), ("policy.parallel.tensor_model_parallel_size=2",)], ids=["dp2", "tp2"])
def test_trajectories_and_their_rewards_are_the_same_on_two_ranks(demo_base_model, tmp_path, layout):
    """Two data-parallel replicas (each rolling out half the step's prompts), or one replica of
    two tensor-parallel ranks (the leader's environments, the other rank's engine fed what came
    back), roll out the same trajectories as one rank: the same rewards, turns and tokens."""
    from gdpo_megatron.metrics import read_metrics
    from support.local_world import run_local

    records = {}
    for name, world in (("one", 1), ("two", 2)):
        run_dir = tmp_path / name
        extra = layout if world == 2 else ()
        assert run_local(_train, world, _overrides(demo_base_model, run_dir, 1, *extra)) == ["done"] * world
        (records[name],) = read_metrics(run_dir)
    same = [k for k in records["one"] if k.startswith(("reward/", "advantage/", "rollout/"))
            and not k.startswith(("rollout/logprob_mismatch", "rollout/prefix_cache"))]
    assert {k: records["two"][k] for k in same} == pytest.approx({k: records["one"][k] for k in same}, abs=1e-9)
    assert records["one"]["rollout/model_turns_mean"] > 1


def test_city_desk_demonstrations_are_trajectories_as_a_rollout_renders_and_judges_them(tokenizers, monkeypatch):
    """Without noise a warm-up demonstration of a two-turn question is, in the rows' tokens, the
    template's rendering of call, CityDesk's reply, plain answer, the next user turn, ...; the
    loss mask covers exactly the model's messages, and the rewards judge them fully right."""
    import json
    import random

    from gdpo_megatron.demo import city_desk_base
    from gdpo_megatron.rewards.multi_turn import multi_turn_efficiency, multi_turn_format, multi_turn_state

    tok = tokenizers["demo"]
    for noise in ("CALL_AGAIN", "WRONG_TOOL", "LONG_THOUGHT"):
        monkeypatch.setattr(city_desk_base, noise, 0.0)
    (question,) = city_desk_base.make_questions(1, seed=3)
    ids, mask = city_desk_base.demonstration_row(tok, question, random.Random(0))

    model_runs, run = [], []  # the masked tokens, one list per model message
    for token, in_loss in zip(ids, mask):
        if in_loss:
            run.append(token)
        elif run:
            model_runs.append(run)
            run = []
    model_runs.append(run)
    assert all(r[-1] == tok.eos_token_id and tok.eos_token_id not in r[:-1] for r in model_runs)
    messages = [tok.decode(r[:-1]) for r in model_runs]
    assert len(messages) == 4  # per user turn: the call, then the answer
    truth = question["multi_turn"]
    config = truth["environment_config"]["weather"]
    chat = list(question["messages"])
    for turn, (call, answer) in enumerate((messages[:2], messages[2:])):
        city = truth["reference_calls"][turn][0].split("'")[1]
        reply = ({"city": city, "weather": config[city]} if "weather" in truth["reference_calls"][turn][0]
                 else {"city": city, "time": f"{len(city) + 8:02d}:00"})  # CityDesk's answers, computed here
        assert answer == f"{reply.get('weather', reply.get('time'))} in {city}."
        chat += [*(truth["later_turns"][turn - 1] if turn else []), {"role": "assistant", "content": call},
                 {"role": "tool", "content": json.dumps(reply)}, {"role": "assistant", "content": answer}]
    assert tok.decode(ids) + "<|assistant|>" == render_prompt(tok, chat)

    trajectory = Trajectory.from_texts(city_desk_base.ENVIRONMENT, [messages[:2], messages[2:]])
    ground_truth = {k: truth[k] for k in ("environment_config", "reference_calls")}
    for reward in (multi_turn_state, multi_turn_format, multi_turn_efficiency):
        assert reward(trajectory, 0, ground_truth) == 1.0


def test_the_warm_up_questions_are_not_the_training_questions():
    import json

    from gdpo_megatron.demo.city_desk_base import make_questions

    rows = [json.loads(line) for line in (ROOT / "examples" / "data" / "city_desk.jsonl").read_text().splitlines()]
    training = {(r["messages"][-1]["content"], r["multi_turn"]["later_turns"][0][0]["content"]) for r in rows}
    questions = make_questions(200 * 16 // 2, 1)  # the warm-up's default
    asked = [(q["messages"][-1]["content"], q["multi_turn"]["later_turns"][0][0]["content"]) for q in questions]
    assert len(asked) == 1600 and not training & set(asked)
    assert {first for first, _ in training} <= {first for first, _ in asked}  # single requests do recur


@pytest.fixture(scope="module")
def city_desk_base_model(demo_base_model, tmp_path_factory):
    """The demo model after the city-desk warm-up (gdpo_megatron.demo.city_desk_base), built once."""
    from gdpo_megatron.demo.city_desk_base import make_city_desk_base_model

    return str(make_city_desk_base_model(demo_base_model, tmp_path_factory.mktemp("city_desk") / "model"))


@pytest.mark.slow
def test_a_short_multi_turn_run_learns_the_task(city_desk_base_model, tmp_path):
    """configs/multi_turn_cpu.yaml for 30 steps from the city-desk base model: the share of user
    turns after which CityDesk's lookups are the reference's rises, and so does the format reward
    (per turn, the share of call attempts that parse and fit CityDesk's functions; first and last
    five steps' means: state 0.16 -> 0.33, format 0.59 -> 0.93 here; with run seed 3 the state rose by 0.18;
    in the config's 20 steps only by 0.08 to 0.15 over run seeds 1234, 1, 2, 3, too close to
    the margin)."""
    from gdpo_megatron.metrics import read_metrics
    from support.local_world import run_local

    run_dir = tmp_path / "learn"
    overrides = [f"base_model={city_desk_base_model}", f"run_dir={run_dir}", "steps=30", "checkpoint.save_every=0",
                 "checkpoint.export_hf=false", "logging.progress_bar=false"]
    assert run_local(_train, 1, overrides) == ["done"]
    records = read_metrics(run_dir)
    assert len(records) == 30
    for reward in ("multi_turn_state", "multi_turn_format"):
        means = [r[f"reward/{reward}/mean"] for r in records]
        first, last = sum(means[:5]) / 5, sum(means[-5:]) / 5
        assert last > first + 0.1, (reward, means)


@pytest.mark.slow
def test_a_run_trains_through_bfcls_environments(demo_base_model, tmp_path):
    """configs/multi_turn_cpu.yaml on BFCL's multi-turn questions (the two base questions of the
    train split with the shortest prompts) through BFCL's own backends, for two steps: the demo
    model (declaring a context that holds them) takes every user turn of each question, and what
    its trajectories earn agrees with BFCL's checker run on the same calls."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from bfcl_reference import multi_turn_verdict
    from gdpo_megatron.data.bfcl_multi_turn import bfcl_multi_turn_rows
    from gdpo_megatron.metrics import read_metrics
    from gdpo_megatron.rewards import get_reward
    from support.local_world import run_local
    from test_eval_multi_turn import _prompt_tokens, _steps

    model = tmp_path / "model"
    shutil.copytree(demo_base_model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16384}))
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = sorted(bfcl_multi_turn_rows(["base"], "train"), key=lambda row: _prompt_tokens(tokenizer, row))[:2]
    data = tmp_path / "bfcl.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    longest = max(_prompt_tokens(tokenizer, row) for row in rows) + 256
    run_dir = tmp_path / "run"
    ((rollouts, _, decoded, _),) = run_local(_train_and_roll_out, 1, _overrides(
        model, run_dir, 2, "data.family=bfcl_multi_turn", f"data.train_path={data}", "data.system_prompt=null",
        f"data.max_prompt_tokens={longest}", f"rollout.max_model_len={longest + 1024}", "environment.file=null",
        "environment.name=null", "rollout.kv_cache_gib=0.5"))

    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["rollout/ended_failed_frac"] == 0 and r["reward/multi_turn_state/failures"] == 0
        assert r["rollout/model_turns_mean"] > 1 and r["train/num_tokens"] > 0
        assert r["rollout/logprob_mismatch"] < 1e-3
    told = ["".join(text for text, is_model in spans if not is_model) for spans in decoded]
    # BFCL's second user turn was fed in after the model answered the first
    assert any(row["multi_turn"]["later_turns"][0][0]["content"] in text for text in told for row in rows)
    for rollout in rollouts:
        assert rollout.trajectory.environment == "bfcl"
        prompt = tokenizer.decode(rollout.prompt_ids)
        (row,) = [r for r in rows if r["messages"][-1]["content"] in prompt]
        turns = [[m.text for m in turn] for turn in rollout.trajectory.turns]
        valid, _, _ = multi_turn_verdict(_steps(turns, row), row)
        assert get_reward("multi_turn_accuracy")(rollout.trajectory, 0, row["multi_turn"]) == float(valid)
