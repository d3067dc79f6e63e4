"""Multi-turn episodes in NeMo-RL: this project's environments behind NeMo-RL's environment
interface, driven by NeMo-RL's own multi-turn rollout loop, scored with the multi-turn rewards
and normalized per trajectory by the GDPO estimator.

NeMo-RL is not installable here. :func:`run_multi_turn_rollout` re-implements, step for step,
its synchronous loop as read at commit 7ea279abfbeb698b092856d0dab61e7cf39bc909
(``nemo_rl/experience/rollouts.py``, line numbers of that file), with a scripted policy in
place of vLLM: each of its messages is real model text, tokenized with the policy's tokenizer
plus the EOS token it stops on. ``grpo_inputs`` then builds the estimator's inputs as
``grpo_train`` does (``nemo_rl/algorithms/grpo.py``).

Expected values are computed independently: the rewards by calling this project's multi-turn
reward functions on a :class:`Trajectory` built directly from the scripted messages; the
sequence by rendering the chat (the environment's observations stepped in-process) with the
chat template; the advantages by this project's GDPO and by NeMo-RL's formulas.
"""
import copy
import json
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch

from gdpo_megatron.advantages import compute_advantages
from gdpo_megatron.config.advantage import AdvantageConfig
from gdpo_megatron.data.bfcl_multi_turn import bfcl_multi_turn_rows
from gdpo_megatron.data.chat import render_prompt
from gdpo_megatron.environments import Message, Trajectory, make_environment
from gdpo_megatron.environments.calls import CallRefused
from gdpo_megatron.environments.environment import ERROR_PREFIX
from gdpo_megatron.environments.registry import environment_reference
from gdpo_megatron.integrations.nemo_rl import (GDPOMegatronEstimator, MultiTurnEnvironment,
                                                multi_turn_prompt_processor, write_response_jsonl)
from gdpo_megatron.integrations.nemo_rl import multi_turn as multi_turn_module
from gdpo_megatron.rewards import get_reward
from gdpo_megatron.tasks.multi_turn import REWARDS
from nemo_rl_reference import nemo_rl_gdpo
from test_bfcl_multi_turn import changed_argument
from test_trajectories import QWEN_LIKE, _tokenizer

ROOT = Path(__file__).resolve().parents[1]
CITY_DESK = ROOT / "examples" / "environments" / "city_desk.py"
CITY_DATA = ROOT / "examples" / "data" / "city_desk.jsonl"
CITY_REF = environment_reference("CityDesk", str(CITY_DESK))
NO_SPEC = SimpleNamespace(system_prompt=None, prompt=None)
NAMES = sorted(REWARDS)  # NeMo-RL's column order


# ---- NeMo-RL's side -----------------------------------------------------------------------

class ScriptedPolicy:
    """Generation: sample ``i``'s messages in order, as the token ids vLLM returns (text, then
    the EOS token generation stops on: ``stop_token_ids`` defaults to ``[eos_token_id]``)."""

    def __init__(self, tokenizer, scripts):
        self.tokenizer, self.queues = tokenizer, [[m for turn in s for m in turn] for s in scripts]

    def generate(self, i):
        text = self.queues[i].pop(0)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return torch.tensor(ids, dtype=torch.int64)


def run_multi_turn_rollout(policy, batch, tokenizer, env, max_seq_len, max_rollout_turns):
    """``run_multi_turn_rollout`` (rollouts.py:840-1087) for one task's environment: returns the
    final batch and every step's ``EnvironmentReturn`` (with the live sample indices)."""
    batch = {**batch, "message_log": [copy.deepcopy(log) for log in batch["message_log"]],
             "extra_env_info": list(batch["extra_env_info"])}
    B = len(batch["message_log"])
    active = torch.arange(B)  # :871
    total_rewards = torch.zeros(B, dtype=torch.float32)  # :872
    multi_rewards = None  # :875
    steps = []
    for turn in range(max_rollout_turns):  # :893
        if len(active) == 0:
            break
        input_lengths = [sum(len(m["token_ids"]) for m in batch["message_log"][i]) for i in active.tolist()]  # :906
        generated = []
        for i in active.tolist():  # generate_responses, :469-551
            ids = policy.generate(i)
            generated.append(ids)
            batch["message_log"][i].append({  # :508-519: decoded without special tokens
                "role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True), "token_ids": ids,
                "generation_logprobs": torch.zeros(len(ids))})
        # calculate_rewards, :705-837: the role and content of every message, and extra_env_info
        to_env = [[{k: m[k] for k in ("role", "content")} for m in batch["message_log"][i]] for i in active.tolist()]
        out = env.step(to_env, [batch["extra_env_info"][i] for i in active.tolist()])
        observations, metadata, next_stop_strings, rewards, terminateds, answers = out  # :770-777
        rewards = {name: torch.stack([r[k] for k in range(len(active))]) for name, r in rewards.items()}  # :815
        steps.append((active.clone(), rewards, terminateds.clone()))
        if multi_rewards is None:  # :961-973
            multi_rewards = {name: torch.zeros(B, dtype=torch.float32) for name in rewards}
        for name, r in rewards.items():
            multi_rewards[name][active] += r
        total_rewards[active] += sum(rewards.values())
        truncation_mask = torch.zeros_like(terminateds, dtype=torch.bool)  # :979
        for k, i in enumerate(active.tolist()):  # :980-1026
            content = observations[k]["content"]
            obs = tokenizer(content, return_tensors="pt", add_special_tokens=False).input_ids[0].to(torch.int64)
            if len(obs) + len(generated[k]) + input_lengths[k] >= max_seq_len:  # :991-1005
                obs = obs[:max_seq_len - (len(generated[k]) + input_lengths[k])]
                truncation_mask[k] = True
            batch["message_log"][i].append({"role": observations[k]["role"], "content": content, "token_ids": obs})
        done = truncation_mask | terminateds.bool()  # :1029-1035
        local_next = torch.where(~done)[0]
        for k in local_next.tolist():  # :1046-1051
            if metadata[k] is not None:
                batch["extra_env_info"][active[k].item()] = metadata[k]
        active = active[local_next]
    batch["total_reward"] = total_rewards  # :1057-1062
    for name, r in multi_rewards.items():
        batch[name] = r
    return batch, steps


def grpo_inputs(batch, tokenizer):
    """(prompt_ids, mask) as grpo_train hands them to the estimator: the prompt messages found by
    ``length`` (grpo.py:1877-1907), right-padded; only generated assistant tokens in the loss
    (grpo.py:1910-1940), times ``loss_multiplier`` (grpo.py:3170-3171, 3289-3292)."""
    prompts, masks = [], []
    for log, length in zip(batch["message_log"], batch["length"]):
        kept, total = [], 0
        for m in log:
            if total >= length:
                break
            kept.append(m["token_ids"])
            total += len(m["token_ids"])
        prompts.append(torch.cat(kept))
        masks.append(torch.cat([torch.full((len(m["token_ids"]),), float(m["role"] == "assistant"
                                                                         and "generation_logprobs" in m))
                                for m in log]))
    pad = tokenizer.pad_token_id
    prompt_ids = torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True, padding_value=pad)
    token_mask = torch.nn.utils.rnn.pad_sequence(masks, batch_first=True)
    return prompt_ids, token_mask * torch.tensor(batch["loss_multiplier"]).unsqueeze(-1)


def nemo_rl_batch(rows, group_size):
    """The processed rows repeated ``group_size`` times each (``repeat_interleave``, grpo.py:2846)."""
    repeated = [r for r in rows for _ in range(group_size)]
    return {key: [r[key] for r in repeated] for key in ("message_log", "extra_env_info", "length", "loss_multiplier")}


# ---- fixtures -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen_like_tokenizer")
    _tokenizer(QWEN_LIKE).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def processed_rows(src, family, tmp_path, tokenizer):
    """Rows of ``src`` through write_response_jsonl, NeMo-RL's ResponseDataset loading and the
    multi-turn processor."""
    path = tmp_path / f"{family}.jsonl"
    write_response_jsonl(src, family, path)
    rows = datasets.load_dataset("json", data_files=str(path), cache_dir=str(tmp_path / "cache"))["train"]
    rows = rows.add_column("task_name", [family] * len(rows))
    return [multi_turn_prompt_processor(rows[i], NO_SPEC, tokenizer, 1 << 20, i) for i in range(len(rows))]


def environment(tokenizer_dir, name, file=None, **overrides):
    cfg = {"tokenizer": tokenizer_dir, "num_workers": 2, "timeout_s": 60.0,
           "environment": {"name": name, **({"file": str(file)} if file else {}), "max_steps_per_turn": 3},
           "max_steps": 8, "max_total_sequence_length": 1 << 20, "max_new_tokens": 64, **overrides}
    return MultiTurnEnvironment(cfg)


# ---- independent expectations -------------------------------------------------------------

def own_rewards(ref, scripts, truths, failed=()):
    """[B, K] in NeMo-RL's column order: this project's reward functions on Trajectories built
    directly from the scripts (a failed one scores 0.0, the rewards' lower bound)."""
    rows = []
    for b, (turns, truth) in enumerate(zip(scripts, truths)):
        trajectory = Trajectory.from_texts(ref, turns)
        rows.append([0.0 if b in failed else get_reward(name)(trajectory, 0, truth) for name in NAMES])
    return torch.tensor(rows, dtype=torch.float64)


def rendered_trajectory(tokenizer, ref, prompt, truth, turns):
    """The text the sample's tokens should hold: the chat with each message's observation (the
    environment stepped in this process) as tool messages, rendered by the template, up to the
    model's last message and its EOS."""
    env = make_environment(ref)
    env.reset(truth["environment_config"])
    chat = [dict(m) for m in prompt]
    for t, turn in enumerate(turns):
        if t:
            env.start_turn(t)
            chat += truth["later_turns"][t - 1]
        for text in turn:
            chat.append({"role": "assistant", "content": text})
            calls = Message(text).calls()
            if isinstance(calls, CallRefused):
                chat.append({"role": "tool", "content": f"{ERROR_PREFIX}{calls}"})
            elif calls is not None:
                chat.append({"role": "tool", "content": env.step(calls).observation})
    while chat[-1]["role"] != "assistant":
        chat.pop()
    return render_prompt(tokenizer, chat[:-1]) + chat[-1]["content"] + tokenizer.eos_token


def tool_call(name, **arguments):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# Per sample, the model's messages per user turn. city_desk.jsonl rows 0 (weather in Oslo, then
# the time in Cairo) and 1 (the time in Paris, then in Rome).
CITY_SCRIPTS = [
    [[tool_call("get_weather", city="Oslo"), "Fog in Oslo."], [tool_call("get_time", city="Cairo"), "13:00."]],
    [["[get_weather(city='Paris')]", "Sunny."],  # the wrong city
     ["[get_time(town='Cairo')]", "[get_time(city='Cairo')]", "13:00."]],  # a refused call, then the right one
    [["[get_weather(city=)]", "I cannot tell."], ["No idea."]],  # a call that does not parse; no call
    [["get_time(city='Paris')", "16:00 in Paris."], ["```\n[get_time(city='Rome')]\n```", "12:00 in Rome."]],
    [["[get_time(city='Paris'), get_weather(city='Paris')]", "16:00."], ["Rome is at 12:00."]],  # a call too many
    [["[get_time(city='Paris')]"] * 3,  # max_steps_per_turn: the next user turn follows
     ["<think>Rome now</think>\n" + tool_call("get_time", city="Rome"), "12:00."]],
]


@pytest.fixture(scope="module")
def city_rollout(tokenizer_dir, tokenizer, tmp_path_factory):
    rows = processed_rows(CITY_DATA, "multi_turn", tmp_path_factory.mktemp("city"), tokenizer)[:2]
    env = environment(tokenizer_dir, "CityDesk", CITY_DESK)
    try:
        batch, steps = run_multi_turn_rollout(ScriptedPolicy(tokenizer, CITY_SCRIPTS), nemo_rl_batch(rows, 3),
                                              tokenizer, env, max_seq_len=1 << 20, max_rollout_turns=8)
        metrics = env.take_metrics()
    finally:
        env.shutdown()
    return rows, batch, steps, metrics


def test_city_desk_episodes_end_with_the_projects_own_rewards(city_rollout, tokenizer):
    rows, batch, steps, metrics = city_rollout
    truths = [rows[b // 3]["extra_env_info"]["ground_truth"] for b in range(6)]
    want = own_rewards(CITY_REF, CITY_SCRIPTS, truths)
    for k, name in enumerate(NAMES):
        assert torch.equal(batch[f"reward/{name}"], want[:, k].float()), name
    # the cases are what they claim (the state is every lookup so far, so one wrong or extra call spoils it)
    assert want[:, NAMES.index("multi_turn_state")].tolist() == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert want[:, NAMES.index("multi_turn_response")].tolist() == [1.0, 0.5, 0.0, 1.0, 0.5, 1.0]
    # per turn: format the share of attempts accepted, efficiency reference calls over made (capped),
    # each 0 in a turn without a call
    assert want[:, NAMES.index("multi_turn_format")].tolist() == [1.0, (1 + 1 / 2) / 2, 0.0, 1.0, 1 / 2, 1.0]
    assert want[:, NAMES.index("multi_turn_efficiency")].tolist() == pytest.approx(
        [1.0, (1 + 1 / 2) / 2, 0.0, 1.0, 1 / 4, (1 / 3 + 1) / 2])
    # after the first step a sample's extra_env_info is its episode's id alone (the episode holds the rest)
    assert all(list(info) == [multi_turn_module.EPISODE] for info in batch["extra_env_info"])
    # every step before an episode's last returned zeros; each episode ended once, after its last message
    ended_at = {}
    for turn, (active, rewards, terminated) in enumerate(steps):
        for k, b in enumerate(active.tolist()):
            if terminated[k]:
                ended_at[b] = turn
            else:
                assert all(r[k].item() == 0.0 for r in rewards.values())
    assert ended_at == {b: sum(map(len, s)) - 1 for b, s in enumerate(CITY_SCRIPTS)}
    assert metrics["multi_turn/ended_answered_frac"] == 1.0 and metrics["multi_turn/open_episodes"] == 0.0
    assert metrics["reward/multi_turn_state/failures"] == 0.0
    assert metrics["reward/multi_turn_state/mean"] == pytest.approx(2 / 6)


def test_the_tokens_are_the_chat_template_rendering_of_the_trajectory(city_rollout, tokenizer):
    rows, batch, _, _ = city_rollout
    for b, log in enumerate(batch["message_log"]):
        row = rows[b // 3]
        tokens = torch.cat([m["token_ids"] for m in log]).tolist()
        prompt = json.loads(json.dumps(row["extra_env_info"]["messages"]))
        want = rendered_trajectory(tokenizer, CITY_REF, prompt, row["extra_env_info"]["ground_truth"],
                                   CITY_SCRIPTS[b])
        assert tokenizer.decode(tokens, skip_special_tokens=False) == want, b
        script = CITY_SCRIPTS[b]  # each turn ends on a plain answer: the next user turn follows it
        assert [m["role"] for m in log[1:]] == [
            role for t, turn in enumerate(script) for j in range(len(turn))
            for role in ("assistant", "user" if j == len(turn) - 1 and t < len(script) - 1 else "tool")]
        assert "<tool_response>" in log[2]["content"] and log[-1]["content"] == ""  # tool messages; none at the end


def test_the_estimator_normalizes_per_trajectory(city_rollout, tokenizer):
    rows, batch, _, _ = city_rollout
    prompt_ids, mask = grpo_inputs(batch, tokenizer)
    estimator = GDPOMegatronEstimator({"name": "gdpo"}, group_size=3)
    advantages = estimator.compute_advantage(prompt_ids=prompt_ids, rewards=batch["total_reward"], mask=mask,
                                             repeated_batch=batch, logprobs_policy=None, logprobs_reference=None)
    truths = [rows[b // 3]["extra_env_info"]["ground_truth"] for b in range(6)]
    want = own_rewards(CITY_REF, CITY_SCRIPTS, truths).float().double()  # the float32 columns NeMo-RL holds
    groups = torch.tensor([b // 3 for b in range(6)])
    ours = compute_advantages(want, groups, mask=torch.ones(6, dtype=torch.bool),
                              config=AdvantageConfig(mode="gdpo", leave_one_out=True, eps=1e-6), weights=[1.0] * 4)
    for b in range(6):  # the trajectory's advantage on each of its model tokens
        model_tokens = advantages[b][mask[b].bool()]
        assert len(model_tokens) > 0 and torch.equal(model_tokens, ours.advantages[b].float().expand_as(model_tokens))
    nemo_rl = nemo_rl_gdpo([b // 3 for b in range(6)], want.T.tolist(), [1.0] * 4, batch_eps=1e-6)
    assert ours.advantages.tolist() == pytest.approx(nemo_rl, abs=1e-9)
    assert ours.advantages.abs().max() > 0.5


def test_bfcl_episodes_score_as_the_projects_rewards(tokenizer_dir, tokenizer, tmp_path):
    source = [r for r in bfcl_multi_turn_rows(["base"]) if r["id"] in ("multi_turn_base_0", "multi_turn_base_1")]
    src = tmp_path / "bfcl.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in source))
    rows = processed_rows(src, "bfcl_multi_turn", tmp_path, tokenizer)
    scripts = []
    for row in rows:
        reference = row["extra_env_info"]["ground_truth"]["reference_calls"]
        right = [[f"[{', '.join(calls)}]", "Done."] if calls else ["Nothing to do."] for calls in reference]
        wrong = [list(messages) for messages in right]  # turn 1 changes into a folder that is not there
        wrong[1][0] = f"[{', '.join([changed_argument(reference[1][0]), *reference[1][1:]])}]"
        scripts += [right, wrong]
    env = environment(tokenizer_dir, "bfcl", max_steps=16)
    try:
        batch, _ = run_multi_turn_rollout(ScriptedPolicy(tokenizer, scripts), nemo_rl_batch(rows, 2), tokenizer,
                                          env, max_seq_len=1 << 20, max_rollout_turns=16)
    finally:
        env.shutdown()
    want = own_rewards("bfcl", scripts, [rows[b // 2]["extra_env_info"]["ground_truth"] for b in range(4)])
    for k, name in enumerate(NAMES):
        assert torch.equal(batch[f"reward/{name}"], want[:, k].float()), name
    assert want[0].tolist() == want[2].tolist() == [1.0] * 4  # the reference calls
    judged = [NAMES.index("multi_turn_state"), NAMES.index("multi_turn_response")]
    assert want[1, judged].min() < 1.0 and want[3, judged].min() < 1.0  # a wrong argument: a state or result is off


FLAKY = '''
import os
from gdpo_megatron.environments import Environment

class Flaky(Environment):
    """ping(n): n < 0 kills the environment's process; after ping(n=7) the next user turn raises."""

    def reset(self, config):
        self.pings = []
        return ""

    def tools(self):
        return [{"name": "ping", "description": "Ping.",
                 "parameters": {"type": "dict", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}]

    def call(self, name, arguments):
        if arguments["n"] < 0:
            os._exit(3)
        self.pings.append(arguments["n"])
        return "pong"

    def start_turn(self, index):
        if 7 in self.pings:
            raise RuntimeError("no second turn after 7")
        return ""
'''


def test_a_failing_environment_fails_only_its_trajectorys_rewards(tokenizer_dir, tokenizer, tmp_path):
    env_file = tmp_path / "flaky.py"
    env_file.write_text(FLAKY)
    truth = {"environment_config": {}, "reference_calls": [["ping(n=1)"], ["ping(n=2)"]],
             "later_turns": [[{"role": "user", "content": "Again, with 2."}]]}
    src = tmp_path / "flaky.jsonl"
    src.write_text(json.dumps({"id": "ping-0", "messages": [{"role": "user", "content": "Ping with 1."}],
                               "multi_turn": truth}) + "\n")
    rows = processed_rows(src, "multi_turn", tmp_path, tokenizer)
    scripts = [
        [["[ping(n=1)]", "ok"], ["[ping(n=2)]", "ok"]],
        [["[ping(n=-1)]"]],  # its process dies
        [["[ping(n=7)]", "ok"]],  # raises as the next user turn starts
        [["[ping(n=1)]", "ok"], ["[ping(n=2)]", "[ping(n=2)]"]],  # max_steps (4) ends it
    ]
    env = environment(tokenizer_dir, "Flaky", env_file, max_steps=4)
    try:
        batch, steps = run_multi_turn_rollout(ScriptedPolicy(tokenizer, scripts), nemo_rl_batch(rows, 4), tokenizer,
                                              env, max_seq_len=1 << 20, max_rollout_turns=4)
        metrics = env.take_metrics()
        # an episode this actor does not hold (a restarted actor's) fails too, counted
        lost = env.step([[{"role": "assistant", "content": "ok"}]], [{multi_turn_module.EPISODE: "gone"}])
        lost_metrics = env.take_metrics()
    finally:
        env.shutdown()
    ref = environment_reference("Flaky", str(env_file))
    want = own_rewards(ref, scripts, [truth] * 4, failed={1, 2})
    for k, name in enumerate(NAMES):
        assert torch.equal(batch[f"reward/{name}"], want[:, k].float()), name
    assert want[0].tolist() == [1.0] * 4 and want[3, NAMES.index("multi_turn_efficiency")] == (1 + 1 / 2) / 2
    assert [len(active) for active, _, _ in steps] == [4, 3, 2, 2]  # each failure ends its episode at once
    assert metrics["reward/multi_turn_format/failures"] == 2.0
    assert metrics["multi_turn/ended_failed_frac"] == 0.5 and metrics["multi_turn/ended_max_steps_frac"] == 0.25
    assert lost.terminateds.tolist() == [1.0] and lost_metrics["reward/multi_turn_state/failures"] == 1.0


def test_the_token_budget_ends_an_episode_before_nemo_rl_cuts_it(tokenizer_dir, tokenizer, tmp_path):
    rows = processed_rows(CITY_DATA, "multi_turn", tmp_path, tokenizer)[:1]
    script = CITY_SCRIPTS[0]
    first = len(rows[0]["message_log"][0]["token_ids"])
    budget, most = first + 200, 64  # room for two messages of the most max_new_tokens allows, not three
    env = environment(tokenizer_dir, "CityDesk", CITY_DESK, max_total_sequence_length=budget, max_new_tokens=most)
    try:
        batch, steps = run_multi_turn_rollout(ScriptedPolicy(tokenizer, [script]), nemo_rl_batch(rows, 1), tokenizer,
                                              env, max_seq_len=budget, max_rollout_turns=8)
        metrics = env.take_metrics()
    finally:
        env.shutdown()
    assert metrics["multi_turn/ended_token_budget_frac"] == 1.0
    made = sum(m["role"] == "assistant" for m in batch["message_log"][0])
    assert made == 2 and len(steps) == made and steps[-1][2].tolist() == [1.0]  # ended by the environment
    assert sum(len(m["token_ids"]) for m in batch["message_log"][0]) <= budget
    # The environment counts each message as `most` tokens (it sees text only): after the first
    # message and its observation, one more message of `most` tokens still fit.
    observation = len(batch["message_log"][0][2]["token_ids"])
    assert first + most + observation + most <= budget
    kept, left = [], made  # the script's first messages, in their user turns
    for turn in script:
        if left:
            kept.append(turn[:left])
            left -= len(kept[-1])
    want = own_rewards(CITY_REF, [kept], [rows[0]["extra_env_info"]["ground_truth"]])
    for k, name in enumerate(NAMES):
        assert torch.equal(batch[f"reward/{name}"], want[:, k].float()), name


@pytest.mark.parametrize("overrides, match", [
    ({"max_steps": None}, r"env.<name>.max_steps: required key is missing"),
    ({"environment": {"max_steps_per_turn": 2}}, r"env.<name>.environment.name: expected a built-in environment"),
    ({"environment": {"name": "NoSuch", "file": str(CITY_DESK)}}, r"env.<name>.environment.file: .*no class 'NoSuch'"),
    ({"max_new_tokens": 64, "max_total_sequence_length": 64}, r"env.<name>.max_total_sequence_length: expected more"),
    ({"rewards": [{"name": "no_such_reward"}]}, r"env.<name>.rewards"),
])
def test_bad_config_is_named_before_anything_starts(overrides, match):
    cfg = {"tokenizer": "/nonexistent", "environment": {"name": "bfcl"}, "max_steps": 4,
           "max_total_sequence_length": 4096, "max_new_tokens": 256, **overrides}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        MultiTurnEnvironment(cfg)


def test_multi_turn_rows_are_refused_by_name(tmp_path, tokenizer):
    path = tmp_path / "tool.jsonl"
    write_response_jsonl(ROOT / "examples" / "data" / "tool.jsonl", "tool", path)
    row = {**json.loads(path.read_text().splitlines()[0]), "task_name": "tool"}
    with pytest.raises(ValueError, match=r"row 0 \(.*\): the ground truth has no environment_config, later_turns, "
                                         "reference_calls; write the data with write_response_jsonl of a multi-turn"):
        multi_turn_prompt_processor(row, NO_SPEC, tokenizer, 4096, 0)


def test_the_actor_class_is_built_on_demand():
    try:
        import ray  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="MultiTurnEnvironmentActor needs ray"):
            multi_turn_module.MultiTurnEnvironmentActor
    else:
        assert hasattr(multi_turn_module.MultiTurnEnvironmentActor, "remote")


def test_bad_step_inputs_are_named(tokenizer_dir):
    env = environment(tokenizer_dir, "CityDesk", CITY_DESK)
    try:
        with pytest.raises(ValueError, match=r"message_log_batch\[0\]: expected the model's message last"):
            env.step([[{"role": "user", "content": "x"}]], [{"ground_truth": {}, "messages": []}])
        with pytest.raises(ValueError, match=r"metadata\[0\]: expected \{'ground_truth', 'messages'\}"):
            env.step([[{"role": "assistant", "content": "x"}]], [{"environment_config": {}}])
        answer = [[{"role": "assistant", "content": "x"}]]
        chat = [{"role": "user", "content": "Weather in Oslo?"}]
        with pytest.raises(ValueError, match=r"metadata\[0\].ground_truth: no environment_config"):
            env.step(answer, [{"ground_truth": {}, "messages": chat}])
        with pytest.raises(ValueError, match=r"metadata\[0\].messages: expected the prompt's chat, a non-empty list"):
            env.step(answer, [{"ground_truth": {"environment_config": {}}, "messages": []}])
        with pytest.raises(ValueError, match=r"metadata\[0\].messages: expected the prompt's chat"):
            env.step(answer, [{"ground_truth": {"environment_config": {}}, "messages": [{"role": "user"}]}])
        assert env.take_metrics()["multi_turn/open_episodes"] == 0.0  # nothing started
    finally:
        env.shutdown()


def test_example_config_sections_build():
    import yaml

    from gdpo_megatron.config import RewardsConfig, from_dict
    from gdpo_megatron.rewards.registry import validate_specs

    with open(ROOT / "examples" / "nemo_rl" / "gdpo_bfcl_multi_turn_1B.yaml") as f:
        cfg = yaml.safe_load(f)

    def resolved(value):  # the interpolations into this file ("${a.b}")
        if isinstance(value, str) and value.startswith("${"):
            node = cfg
            for key in value[2:-1].split("."):
                node = node[key]
            return node
        return value

    default = cfg["data"]["default"]
    assert (default["processor"], default["prompt_file"], default["system_prompt_file"]) == (
        "gdpo_megatron_multi_turn_prompt", None, None)
    env_cfg = dict(cfg["env"][default["env_name"]])
    assert env_cfg.pop("tokenizer") == "${policy.tokenizer.name}"
    own = {key: resolved(env_cfg.pop(key)) for key in ("environment", "max_steps", "max_total_sequence_length",
                                                        "max_new_tokens")}
    episode = from_dict(multi_turn_module.EpisodeConfig, own, f"env.{default['env_name']}")
    assert episode.max_steps == cfg["grpo"]["max_rollout_turns"]  # NeMo-RL never stops an episode first
    assert episode.max_new_tokens < episode.max_total_sequence_length == cfg["policy"]["max_total_sequence_length"]
    rewards = from_dict(RewardsConfig, env_cfg, f"env.{default['env_name']}")
    validate_specs(rewards.rewards)
    estimator = GDPOMegatronEstimator(cfg["grpo"]["adv_estimator"],
                                      group_size=cfg["grpo"]["num_generations_per_prompt"])
    assert len(estimator.config.reward_weights) == len(rewards.names)  # one weight per reward column
    assert estimator._conditions_for(sorted(rewards.names))  # the gate names rewards of the batch


ECHO = '''
from gdpo_megatron.environments import Environment

class Echo(Environment):
    """echo(text): returns its argument as it is; the next user turn's note repeats it; echoing
    "bye" ends the trajectory (done)."""

    def reset(self, config):
        self.last = ""
        return ""

    def start_turn(self, index):
        return self.last

    def tools(self):
        return [{"name": "echo", "description": "Echo.",
                 "parameters": {"type": "dict", "properties": {"text": {"type": "string"}}, "required": ["text"]}}]

    def call(self, name, arguments):
        self.last = arguments["text"]
        self.done = self.last == "bye"
        return self.last
'''


def echo_rows(tmp_path, tokenizer):
    env_file = tmp_path / "echo.py"
    env_file.write_text(ECHO)
    truth = {"environment_config": {}, "reference_calls": [['echo(text="a")'], []],
             "later_turns": [[{"role": "user", "content": "Thanks."}]]}
    src = tmp_path / "echo.jsonl"
    src.write_text(json.dumps({"id": "echo-0", "messages": [{"role": "user", "content": "Echo a."}],
                               "multi_turn": truth}) + "\n")
    return env_file, processed_rows(src, "multi_turn", tmp_path, tokenizer)


def echo_rollout(tokenizer_dir, tokenizer, env_file, rows, scripts):
    """NeMo-RL's rollout of the two Echo questions ``rows`` under ``scripts``: the batch, its steps,
    the metrics."""
    env = environment(tokenizer_dir, "Echo", env_file)
    try:
        batch, steps = run_multi_turn_rollout(ScriptedPolicy(tokenizer, scripts), nemo_rl_batch(rows, 2), tokenizer,
                                              env, max_seq_len=1 << 20, max_rollout_turns=4)
        metrics = env.take_metrics()
    finally:
        env.shutdown()
    return batch, steps, metrics


def test_a_lone_surrogate_echoed_back_is_escaped_not_fatal(tokenizer_dir, tokenizer, tmp_path):
    attack = '<tool_call>{"name": "echo", "arguments": {"text": "\\ud800"}}</tool_call>'
    assert "\\ud800" in attack and json.loads(attack[11:-12])["arguments"]["text"] == "\ud800"
    scripts = [[[attack, "done"], ["bye"]], [['[echo(text="a")]', "done"], ["bye"]]]
    env_file, rows = echo_rows(tmp_path, tokenizer)
    batch, steps, metrics = echo_rollout(tokenizer_dir, tokenizer, env_file, rows, scripts)
    log = batch["message_log"][0]
    assert "\\ud800" in log[2]["content"]  # escaped: NeMo-RL's tokenizer took it
    assert log[4]["role"] == "user" and log[4]["content"].count("\\ud800") == 1  # the next turn's note too
    assert metrics["multi_turn/ended_answered_frac"] == 1.0 and metrics["reward/multi_turn_format/failures"] == 0.0
    assert [len(active) for active, _, _ in steps] == [2, 2, 2]


def test_an_episode_nemo_rl_stops_is_closed_once_idle(tokenizer_dir, tokenizer, tmp_path):
    import multiprocessing
    import time

    env_file, rows = echo_rows(tmp_path, tokenizer)
    env = environment(tokenizer_dir, "Echo", env_file, episode_idle_s=0.5)
    processes, metrics = [], []
    try:
        for _ in range(3):
            # max_rollout_turns=1: NeMo-RL stops both samples after a call; their episodes stay open.
            run_multi_turn_rollout(ScriptedPolicy(tokenizer, [[['[echo(text="a")]']]] * 2), nemo_rl_batch(rows, 2),
                                   tokenizer, env, max_seq_len=1 << 20, max_rollout_turns=1)
            processes.append(len(multiprocessing.active_children()))
            metrics.append(env.take_metrics())
            time.sleep(0.6)
            metrics.append(env.take_metrics())
    finally:
        env.shutdown()
    assert processes[0] == processes[1] == processes[2]  # the environments' processes do not pile up
    for right_after, idle in zip(metrics[::2], metrics[1::2]):
        assert (right_after["multi_turn/open_episodes"], right_after["multi_turn/orphaned"]) == (2.0, 0.0)
        assert (idle["multi_turn/open_episodes"], idle["multi_turn/orphaned"]) == (0.0, 2.0)


class SpecialTokenPolicy(ScriptedPolicy):
    """Samples 50 ``<|im_start|>`` tokens before its text: decoded without special tokens, the
    text NeMo-RL hands the environment is only the last few."""

    def generate(self, i):
        ids = super().generate(i)
        return torch.cat([torch.full((50,), self.tokenizer.convert_tokens_to_ids("<|im_start|>")), ids])


def test_the_token_count_bounds_messages_of_invisible_special_tokens(tokenizer_dir, tokenizer, tmp_path):
    env_file, rows = echo_rows(tmp_path, tokenizer)
    first = len(rows[0]["message_log"][0]["token_ids"])
    sampled = 50 + len(tokenizer('[echo(text="a")]', add_special_tokens=False)["input_ids"]) + 1
    budget, most = first + 2 * 64 + 40, 64  # one observation and two messages of `most` tokens fit
    env = environment(tokenizer_dir, "Echo", env_file, max_total_sequence_length=budget, max_new_tokens=most)
    try:
        batch, steps = run_multi_turn_rollout(
            SpecialTokenPolicy(tokenizer, [[['[echo(text="a")]'] * 3]]), nemo_rl_batch(rows, 1), tokenizer, env,
            max_seq_len=budget, max_rollout_turns=8)
        metrics = env.take_metrics()
    finally:
        env.shutdown()
    log = batch["message_log"][0]
    assert len(log[1]["token_ids"]) == sampled and len(log[1]["content"]) < 20  # the text shows few of them
    assert metrics["multi_turn/ended_token_budget_frac"] == 1.0 and steps[-1][2].tolist() == [1.0]
    assert sum(len(m["token_ids"]) for m in log) <= budget


def test_a_step_that_leaves_the_environment_done_ends_the_episode(tokenizer_dir, tokenizer, tmp_path):
    scripts = [[['[echo(text="bye")]', "never sent"], ["never sent"]], [['[echo(text="a")]', "done"], ["bye"]]]
    env_file, rows = echo_rows(tmp_path, tokenizer)
    batch, steps, metrics = echo_rollout(tokenizer_dir, tokenizer, env_file, rows, scripts)
    assert [len(active) for active, _, _ in steps] == [2, 1, 1]  # the first ends at its first step
    assert steps[0][2].tolist() == [1.0, 0.0] and metrics["multi_turn/ended_answered_frac"] == 1.0
    want = own_rewards(environment_reference("Echo", str(env_file)), [[['[echo(text="bye")]']], scripts[1]],
                       [rows[0]["extra_env_info"]["ground_truth"]] * 2)
    for k, name in enumerate(NAMES):
        assert torch.equal(batch[f"reward/{name}"], want[:, k].float()), name
