"""Multi-turn episodes in NeMo-RL: this project's environments and multi-turn rewards behind
NeMo-RL's environment interface, one trajectory per NeMo-RL sample.

What NeMo-RL does (``run_multi_turn_rollout`` in ``nemo_rl/experience/rollouts.py``, read at
commit ``7ea279abfbeb698b092856d0dab61e7cf39bc909``): each turn the policy writes one message
for every live sample (its tokens end with the EOS token it stopped on, ``stop_token_ids``
defaulting to the tokenizer's EOS; the message's text is decoded without special tokens);
``env.step(message_logs, metadata)`` gets every live sample's messages (role and content) and
its ``extra_env_info``; the observation's content is tokenized as it is and appended; the
returned metadata becomes the sample's ``extra_env_info``; each ``reward/<name>`` returned is
added to the sample's float32 column; a sample stops when ``terminateds`` says so, when its
observation would reach ``policy.max_total_sequence_length``, or after
``grpo.max_rollout_turns`` turns.

:class:`MultiTurnEnvironment` runs one episode per sample, as this project's own rollouts do
(:mod:`gdpo_megatron.trajectories`):

* its first step starts the episode: the configured environment (BFCL's, or a user's class in a
  file) in an :class:`~gdpo_megatron.environments.host.EnvironmentHost` from the actor's pool
  of environment workers (kept until :meth:`MultiTurnEnvironment.shutdown`), reset with the
  ground truth's ``environment_config``; the returned metadata carries the episode's id. A
  step sends every episode's request before it reads any answer, so the environments step at
  once;
* each step takes the model's last message: a call attempt is parsed as data and stepped in the
  environment, its observation a ``tool`` message; a plain answer ends the user turn and the
  question's next user message follows (with the environment's ``start_turn`` note), after the
  last one the episode ends (``answered``); so does a user turn of ``max_steps_per_turn``
  messages (``turn_limit`` after the last turn), ``max_steps`` messages in all
  (``max_steps``), and the token budget (below);
* the observation is what the chat template writes after the model's message: the
  rendering of the chat with the new messages (and the generation prompt), less the rendering so
  far, the model's text and its EOS token. So the sample's tokens are the template's rendering
  of the whole chat (tokenizing the text is NeMo-RL's part). A template whose end of an
  assistant message is not the EOS token, or that renders earlier messages differently once
  more follow, cannot be continued: the episode fails. A message cut by
  ``max_new_tokens`` has no EOS; it is continued as if it had one (NeMo-RL flags its sample
  ``truncated``; ``grpo.overlong_filtering`` leaves it out of the loss);
* token budget: the episode ends (``token_budget``, its rewards judging the calls it made)
  where the sequence after the next observation would leave less than ``max_new_tokens`` of
  ``max_total_sequence_length``, so NeMo-RL never cuts an episode for length first. The count
  is exact for the prompt and the observations and re-tokenizes the model's text (plus its EOS);
* rewards: zeros on every step but the episode's last, which returns the rewards of the whole
  trajectory (the config's reward stage scoring its
  :class:`~gdpo_megatron.environments.Trajectory`, the multi-turn rewards by default). NeMo-RL
  starts each column at 0.0 and adds a step's value in float32: ``0 + ... + 0 + r`` is ``r``
  exactly, so the final column holds the trajectory's rewards, each rounded once to float32,
  and the GDPO estimator (one row per sample) normalizes them per trajectory;
* failures: an environment that raises outside a call, runs past ``step_timeout_s`` or dies, a
  template that cannot be continued, or an episode this actor no longer holds (a restarted
  actor) ends the episode with its ``failure`` set: each of its rewards scores its failure
  value and is counted (``reward/<name>/failures``); the batch goes on.

``max_steps`` must not exceed ``grpo.max_rollout_turns`` (NeMo-RL would stop the sample first,
with zero rewards): the example config sets it to ``${grpo.max_rollout_turns}``.

Its config (``env.<name>``) is :class:`RewardStageEnvironment
<gdpo_megatron.integrations.nemo_rl.RewardStageEnvironment>`'s (the ``rewards`` section, by
default the multi-turn rewards, and ``tokenizer``) plus::

    environment: {name: bfcl}            # or {file: my_env.py, name: MyEnv}; step_timeout_s, max_steps_per_turn
    max_steps: ${grpo.max_rollout_turns}
    max_total_sequence_length: ${policy.max_total_sequence_length}
    max_new_tokens: ${policy.generation.max_new_tokens}

Each sample's ``extra_env_info`` is ``{"ground_truth", "messages"}``, as
:func:`~gdpo_megatron.integrations.nemo_rl.multi_turn_prompt_processor` builds it. Episodes
NeMo-RL stops without this environment ending them keep their environment's worker until
:meth:`MultiTurnEnvironment.shutdown`; ``multi_turn/open_episodes`` counts them.
"""
from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch

from gdpo_megatron.config.environment import EnvironmentConfig
from gdpo_megatron.config.loader import ConfigError, from_dict, require, section
from gdpo_megatron.data.chat import encode_prompt
from gdpo_megatron.environments.calls import Call, CallRefused
from gdpo_megatron.environments.environment import ERROR_PREFIX
from gdpo_megatron.environments.host import EnvironmentFailed, EnvironmentHost, EnvironmentPool
from gdpo_megatron.environments.registry import environment_reference
from gdpo_megatron.environments.trajectory import Message, Trajectory
from gdpo_megatron.integrations.nemo_rl.environment import (CONFIG_PATH, EnvironmentReturn, ScoringEnvironment,
                                                             ray_actor_class)
from gdpo_megatron.preflight.validation import check_environment
from gdpo_megatron.tasks.multi_turn import REWARDS
from gdpo_megatron.trajectories import TemplateMismatch, continuation_text

ACTOR_CLASS = "MultiTurnEnvironmentActor"
EPISODE = "episode"  # the metadata key of an episode's id
Ending = Literal["answered", "turn_limit", "max_steps", "token_budget", "failed"]
ENDINGS: tuple[str, ...] = Ending.__args__
_actor_class = None


@section
class EpisodeConfig:
    """The multi-turn environment's own keys of ``env.<name>`` (see the module docstring)."""

    environment: EnvironmentConfig
    max_steps: int
    max_total_sequence_length: int
    max_new_tokens: int

    def __post_init__(self):
        require(self.environment.name is not None, "environment.name",
                "a built-in environment (bfcl) or, with environment.file, the class defined in it", None)
        require(self.max_steps >= 1, "max_steps", ">= 1 (at most grpo.max_rollout_turns)", self.max_steps)
        require(self.max_new_tokens >= 1, "max_new_tokens", ">= 1", self.max_new_tokens)
        require(self.max_total_sequence_length > self.max_new_tokens, "max_total_sequence_length",
                f"more than max_new_tokens={self.max_new_tokens}", self.max_total_sequence_length)


@dataclass
class _Episode:
    """One sample's trajectory in progress."""

    host: EnvironmentHost | None
    chat: list[dict]  # what the template has rendered so far, less the generation prompt
    later_turns: list[list[dict]]
    tokens: int  # the sample's sequence length, as counted here
    messages: list[list[str]] = field(default_factory=lambda: [[]])  # the model's, per user turn
    steps: int = 0
    steps_in_turn: int = 0
    ending: Ending | None = None
    failure: str | None = None


class MultiTurnEnvironment(ScoringEnvironment):
    """NeMo-RL ``EnvironmentInterface`` whose episodes are trajectories through one of this
    project's environments, scored with the multi-turn rewards at their last step."""

    def __init__(self, cfg: Mapping):
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"{CONFIG_PATH}: expected a mapping, got {cfg!r}")
        cfg = dict(cfg)
        own = {f.name: cfg.pop(f.name) for f in fields(EpisodeConfig) if f.name in cfg}
        self.config: EpisodeConfig = from_dict(EpisodeConfig, own, CONFIG_PATH)
        check_environment(self.config.environment, f"{CONFIG_PATH}.environment")
        self.environment = environment_reference(self.config.environment.name, self.config.environment.file)
        cfg.setdefault("rewards", [{"name": name} for name in REWARDS])
        super().__init__(cfg)
        if not self._tokenizer.eos_token:
            super().shutdown()
            raise ConfigError(f"{CONFIG_PATH}.tokenizer: {cfg['tokenizer']} has no EOS token, which ends the "
                              "model's messages (NeMo-RL's stop_token_ids default)")
        self._episodes: dict[str, _Episode] = {}
        self._endings: Counter = Counter()  # since take_metrics
        self._pool = EnvironmentPool(self.environment, self.config.environment.step_timeout_s)

    def step(self, message_log_batch: Sequence[Sequence[Mapping]], metadata: Sequence[Mapping]) -> EnvironmentReturn:
        """Advance each sample's episode by the model's last message (see the module docstring)."""
        if len(message_log_batch) != len(metadata):
            raise ValueError(f"step: {len(message_log_batch)} message logs but {len(metadata)} metadata entries")
        texts = [_last_model_message(log, i) for i, log in enumerate(message_log_batch)]
        infos = [_episode_info(m, i) for i, m in enumerate(metadata)]
        keys = [info.get(EPISODE) or uuid.uuid4().hex for info in infos]
        starting = [(key, info) for key, info in zip(keys, infos) if info.get(EPISODE) is None]
        for (key, info), host in zip(starting, self._pool.hosts(len(starting))):
            host.send("reset", info["ground_truth"]["environment_config"])
            self._episodes[key] = self._start(info, host)
        for key, _ in starting:
            self._reset(self._episodes[key])
        episodes = [self._episodes.get(key) for key in keys]
        calls = [self._send_calls(e, text) if e is not None else None for e, text in zip(episodes, texts)]
        observations, returned, ended = [], [], []
        for i, (key, episode, text, call, info) in enumerate(zip(keys, episodes, texts, calls, infos)):
            if episode is None:
                episode = _Episode(None, [], [], 0, ending="failed",
                                   failure=f"episode {key} is not held by this environment (its actor restarted?)")
                following = None
            else:
                following = self._advance(episode, text, call)
            observations.append({"role": "tool", "content": following or ""})
            returned.append({**info, EPISODE: key})
            if following is None:
                self._episodes.pop(key, None)
                ended.append((i, episode, info["ground_truth"]))
        rewards = torch.zeros(len(texts), len(self.reward_keys))
        if ended:
            for _, episode, _ in ended:
                self._close(episode)
                self._endings[episode.ending] += 1
            scored = self._score([self._trajectory(e) for _, e, _ in ended],
                                 [self._model_tokens(e) for _, e, _ in ended], [truth for _, _, truth in ended])
            rewards[[i for i, _, _ in ended]] = scored
        terminated = torch.zeros(len(texts))
        terminated[[i for i, _, _ in ended]] = 1.0
        return EnvironmentReturn(
            observations=observations,
            metadata=returned,
            next_stop_strings=[None] * len(texts),
            rewards={key: rewards[:, k].clone() for k, key in enumerate(self.reward_keys)},
            terminateds=terminated,
            answers=None,
        )

    def take_metrics(self) -> dict[str, float]:
        """The rewards' metrics, and ``multi_turn/ended_<why>_frac`` over the episodes ended
        since the last call and ``multi_turn/open_episodes`` now."""
        out = super().take_metrics()
        endings, self._endings = self._endings, Counter()
        total = sum(endings.values())
        if total:
            out.update({f"multi_turn/ended_{why}_frac": endings[why] / total for why in ENDINGS})
        out["multi_turn/open_episodes"] = float(len(self._episodes))
        return out

    def shutdown(self) -> None:
        for episode in self._episodes.values():
            self._close(episode)
        self._episodes.clear()
        self._pool.close()
        super().shutdown()

    # ---- one episode ---------------------------------------------------------------------

    def _start(self, info: Mapping, host: EnvironmentHost) -> _Episode:
        """The episode of ``info``, its environment's reset sent to ``host``."""
        truth, chat = info["ground_truth"], [dict(m) for m in info["messages"]]
        return _Episode(host, chat, list(truth.get("later_turns") or []), len(encode_prompt(self._tokenizer, chat)))

    def _reset(self, episode: _Episode) -> None:
        """Read the answer to the episode's reset."""
        try:
            note = episode.host.receive()
        except EnvironmentFailed as e:
            self._fail(episode, str(e))
            return
        if note:
            self._fail(episode, f"environment {self.environment!r}: reset returned an opening note, which NeMo-RL "
                                "cannot show (its prompt is built before the episode starts)")

    @staticmethod
    def _send_calls(e: _Episode, text: str) -> list[Call] | CallRefused | None:
        """The calls of the model's message ``text`` (:meth:`Message.calls`), sent to be stepped."""
        if e.ending is not None:  # failed at its start
            return None
        calls = Message(text).calls()
        if calls is not None and not isinstance(calls, CallRefused):
            e.host.send("step", calls)
        return calls

    def _advance(self, e: _Episode, text: str, calls: list[Call] | CallRefused | None) -> str | None:
        """The observation that follows the model's message ``text`` and the step of its
        ``calls`` (sent), or None when the episode ends here (``e.ending`` says why)."""
        if e.ending is not None:  # failed at its start
            return None
        e.messages[-1].append(text)
        e.steps += 1
        e.steps_in_turn += 1
        e.tokens += len(self._tokenizer(text, add_special_tokens=False)["input_ids"]) + 1  # and its EOS
        new: list[dict] = []
        if calls is not None:
            if isinstance(calls, CallRefused):
                observation = f"{ERROR_PREFIX}{calls}"
            else:
                try:
                    observation = e.host.receive().observation
                except EnvironmentFailed as error:
                    return self._fail(e, str(error))
            new.append({"role": "tool", "content": observation})
        if calls is None or e.steps_in_turn >= self.config.environment.max_steps_per_turn:
            turn = len(e.messages)
            if turn > len(e.later_turns):
                e.ending = "answered" if calls is None else "turn_limit"
                return None
            try:
                note = e.host.start_turn(turn)
            except EnvironmentFailed as error:
                return self._fail(e, str(error))
            user = [dict(m) for m in e.later_turns[turn - 1]]
            if note:
                user[-1] = {**user[-1], "content": f"{user[-1]['content']}\n\n{note}"}
            new += user
            e.messages.append([])
            e.steps_in_turn = 0
        if e.steps >= self.config.max_steps:
            e.ending = "max_steps"
            return None
        try:
            following = continuation_text(self._tokenizer, e.chat, text + self._tokenizer.eos_token, text, new)
        except TemplateMismatch as error:
            return self._fail(e, str(error))
        e.tokens += len(self._tokenizer(following, add_special_tokens=False)["input_ids"])
        if e.tokens + self.config.max_new_tokens > self.config.max_total_sequence_length:
            e.ending = "token_budget"
            return None
        e.chat += [{"role": "assistant", "content": text}, *new]
        return following

    def _fail(self, e: _Episode, why: str) -> None:
        e.ending, e.failure = "failed", why
        self._close(e)

    @staticmethod
    def _close(e: _Episode) -> None:
        if e.host is not None:
            e.host.close()
            e.host = None

    def _trajectory(self, e: _Episode) -> Trajectory:
        messages = list(e.messages)
        while len(messages) > 1 and not messages[-1]:
            messages.pop()  # a user turn fed in but never answered
        return Trajectory.from_texts(self.environment, messages, e.failure)

    def _model_tokens(self, e: _Episode) -> int:
        """The model's tokens in the trajectory, re-tokenized (the rewards' ``num_tokens``)."""
        texts = [t for turn in e.messages for t in turn]
        ids = self._tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        return sum(len(i) + 1 for i in ids)


def __getattr__(name: str):
    """``MultiTurnEnvironmentActor``: the Ray actor class, built (and Ray imported) on first use."""
    global _actor_class
    if name != ACTOR_CLASS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _actor_class is None:
        _actor_class = ray_actor_class(MultiTurnEnvironment, __name__, ACTOR_CLASS)
    return _actor_class


def _last_model_message(message_log: Sequence[Mapping], row: int) -> str:
    if not (isinstance(message_log, Sequence) and message_log and isinstance(message_log[-1], Mapping)
            and message_log[-1].get("role") == "assistant"):
        roles = [m.get("role") for m in message_log] if isinstance(message_log, Sequence) else message_log
        raise ValueError(f"message_log_batch[{row}]: expected the model's message last (roles: {roles})")
    return str(message_log[-1].get("content", ""))


def _episode_info(metadata: Any, row: int) -> Mapping:
    if not (isinstance(metadata, Mapping) and isinstance(metadata.get("ground_truth"), Mapping)
            and isinstance(metadata.get("messages"), list)):
        raise ValueError(f"metadata[{row}]: expected {{'ground_truth', 'messages'}} as multi_turn_prompt_processor "
                         f"builds it, got {type(metadata).__name__}"
                         + (f" with keys {sorted(metadata)}" if isinstance(metadata, Mapping) else ""))
    return metadata
