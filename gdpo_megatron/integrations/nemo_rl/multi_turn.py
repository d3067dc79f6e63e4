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

:class:`MultiTurnEnvironment` runs one episode per sample
(:class:`~gdpo_megatron.environments.episode.Episode`, as this project's own rollouts,
:mod:`gdpo_megatron.trajectories`, do):

* its first step starts the episode: the configured environment (BFCL's, or a user's class in a
  file) in an :class:`~gdpo_megatron.environments.host.EnvironmentHost` from the actor's pool
  of environment workers (a worker goes back to the pool when its episode ends), reset with the
  ground truth's ``environment_config``; the episode keeps the ground truth and the chat, and
  the returned metadata (the sample's next ``extra_env_info``) is only the episode's id, so
  later steps send no more through Ray than that. A step sends every episode's request before
  it reads any answer, so the environments step at once;
* each step takes the model's last message: a call attempt is parsed as data and stepped in the
  environment, its observation a ``tool`` message (text that UTF-8 cannot encode, such as a lone
  surrogate a call's JSON asked for, is backslash-escaped); a plain answer ends the user turn
  and the question's next user message follows (with the environment's ``start_turn`` note;
  the observation's role is then ``user``), after the
  last one the episode ends (``answered``, as after a step that leaves the environment
  ``done``); so does a user turn of ``max_steps_per_turn``
  messages (``turn_limit`` after the last turn), ``max_steps`` messages in all
  (``max_steps``), and the token budget (below);
* the observation is what the chat template writes after the model's message: the
  rendering of the chat with the new messages (and the generation prompt), less the rendering so
  far, the model's text and its EOS token. So the sample's tokens are the template's rendering
  of the whole chat (tokenizing the text is NeMo-RL's part). A template whose end of an
  assistant message is not the EOS token, or that renders earlier messages differently once
  more follow, cannot be continued: the episode fails. A message cut by
  ``max_new_tokens`` has no EOS; it is continued as if it had one and judged like any other
  (NeMo-RL's vLLM flags its sample ``truncated``; ``grpo.overlong_filtering`` would drop the
  whole trajectory from the loss but not from its group's statistics, so the example config
  leaves it off);
* token budget: the episode ends (``token_budget``, its rewards judging the calls it made)
  where the sequence after the next observation could leave less than ``max_new_tokens`` of
  ``max_total_sequence_length``, so NeMo-RL never cuts an episode for length first. NeMo-RL
  hands ``step`` each message's text only (``role`` and ``content``; the text decoded without
  special tokens), which does not tell how many tokens the model sampled, so the count is an
  upper bound: exact for the prompt and the observations, ``max_new_tokens`` for each of the
  model's messages (the most vLLM generates for one). An episode of short messages therefore
  ends before the sequence is full;
* rewards: zeros on every step but the episode's last, which returns the rewards of the whole
  trajectory (the config's reward stage scoring its
  :class:`~gdpo_megatron.environments.Trajectory`, the multi-turn rewards by default). NeMo-RL
  starts each column at 0.0 and adds a step's value in float32: ``0 + ... + 0 + r`` is ``r``
  exactly, so the final column holds the trajectory's rewards, each rounded once to float32,
  and the GDPO estimator (one row per sample) normalizes them per trajectory;
* failures: an environment that raises outside a call, runs past ``step_timeout_s`` or dies, a
  template that cannot be continued, an episode this actor no longer holds (a restarted actor
  or one closed as idle), or any other error while advancing one sample ends that episode with
  its ``failure`` set: each of its rewards scores its failure value and is counted
  (``reward/<name>/failures``); the batch goes on. Malformed metadata (not what
  :func:`~gdpo_megatron.integrations.nemo_rl.multi_turn_prompt_processor` builds) is an error
  of the data and raises before any episode moves.

``max_steps`` must not exceed ``grpo.max_rollout_turns`` (NeMo-RL would stop the sample first,
with zero rewards): the example config sets it to ``${grpo.max_rollout_turns}``.

Its config (``env.<name>``) is :class:`RewardStageEnvironment
<gdpo_megatron.integrations.nemo_rl.RewardStageEnvironment>`'s (the ``rewards`` section, by
default the multi-turn rewards, and ``tokenizer``) plus::

    environment: {name: bfcl}            # or {file: my_env.py, name: MyEnv}; step_timeout_s, max_steps_per_turn
    max_steps: ${grpo.max_rollout_turns}
    max_total_sequence_length: ${policy.max_total_sequence_length}
    max_new_tokens: ${policy.generation.max_new_tokens}
    episode_idle_s: 900                  # close an episode no step touched for this long

Each sample's first ``extra_env_info`` is ``{"ground_truth", "messages"}``, as
:func:`~gdpo_megatron.integrations.nemo_rl.multi_turn_prompt_processor` builds it. NeMo-RL can
stop a sample without this environment ending its episode (``grpo.max_rollout_turns`` below
``max_steps``, an error elsewhere in its rollout): such an episode is closed, its worker given
back to the pool, by the first ``step`` or :meth:`~MultiTurnEnvironment.take_metrics` call more
than ``episode_idle_s`` after the step that last touched it (``multi_turn/orphaned`` counts
them; they get no rewards, NeMo-RL keeps the zeros it holds). ``episode_idle_s`` must exceed the
longest wait between two turns of one sample (a generation round of the batch).
"""
from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from gdpo_megatron.config.environment import EnvironmentConfig
from gdpo_megatron.config.loader import ConfigError, from_dict, require, section
from gdpo_megatron.data.chat import encode_prompt
from gdpo_megatron.environments.calls import Call, CallRefused
from gdpo_megatron.environments.episode import Ending, Episode
from gdpo_megatron.environments.host import EnvironmentFailed, EnvironmentPool
from gdpo_megatron.environments.registry import environment_reference
from gdpo_megatron.integrations.nemo_rl.environment import (CONFIG_PATH, EnvironmentReturn, ScoringEnvironment,
                                                             actor_class_attribute)
from gdpo_megatron.preflight.validation import check_environment
from gdpo_megatron.tasks.multi_turn import REWARDS
from gdpo_megatron.trajectories import TemplateMismatch, continuation_text

ACTOR_CLASS = "MultiTurnEnvironmentActor"
EPISODE = "episode"  # the metadata key of an episode's id
ENDINGS: tuple[str, ...] = Ending.__args__


@section
class EpisodeConfig:
    """The multi-turn environment's own keys of ``env.<name>`` (see the module docstring)."""

    environment: EnvironmentConfig
    max_steps: int
    max_total_sequence_length: int
    max_new_tokens: int
    episode_idle_s: float = 900.0

    def __post_init__(self):
        require(self.environment.name is not None, "environment.name",
                "a built-in environment (bfcl) or, with environment.file, the class defined in it", None)
        require(self.max_steps >= 1, "max_steps", ">= 1 (at most grpo.max_rollout_turns)", self.max_steps)
        require(self.max_new_tokens >= 1, "max_new_tokens", ">= 1", self.max_new_tokens)
        require(self.max_total_sequence_length > self.max_new_tokens, "max_total_sequence_length",
                f"more than max_new_tokens={self.max_new_tokens}", self.max_total_sequence_length)
        require(self.episode_idle_s > 0, "episode_idle_s", "> 0 seconds", self.episode_idle_s)


@dataclass
class _Episode:
    """One sample's trajectory in progress: its episode (whose chat is what the template has
    rendered so far, less the generation prompt), ground truth and token count."""

    state: Episode
    truth: Mapping
    tokens: int = 0  # an upper bound of the sample's sequence length
    touched: float = field(default_factory=time.monotonic)  # when a step last advanced it


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
        self._orphaned = 0  # idle episodes closed since take_metrics
        self._pool = EnvironmentPool(self.environment, self.config.environment.step_timeout_s)

    def step(self, message_log_batch: Sequence[Sequence[Mapping]], metadata: Sequence[Mapping]) -> EnvironmentReturn:
        """Advance each sample's episode by the model's last message (see the module docstring)."""
        if len(message_log_batch) != len(metadata):
            raise ValueError(f"step: {len(message_log_batch)} message logs but {len(metadata)} metadata entries")
        texts = [_last_model_message(log, i) for i, log in enumerate(message_log_batch)]
        infos = [_episode_info(m, i) for i, m in enumerate(metadata)]
        self._close_idle()
        keys = [info.get(EPISODE) or uuid.uuid4().hex for info in infos]
        starting = [(key, info) for key, info in zip(keys, infos) if info.get(EPISODE) is None]
        self._start(starting)
        for key, _ in starting:
            self._reset(self._episodes[key])
        episodes = [self._episodes.get(key) for key in keys]
        calls = [self._send_calls(e, text) if e is not None else None for e, text in zip(episodes, texts)]
        observations, returned, ended = [], [], []
        for i, (key, episode, text, call, info) in enumerate(zip(keys, episodes, texts, calls, infos)):
            if episode is None:
                episode = _Episode(self._episode([], {}), {})
                episode.state.fail(f"episode {key} is not held by this environment (its actor restarted, "
                                   "or it was closed after episode_idle_s)")
                following = None
            else:
                episode.touched = time.monotonic()
                try:
                    following = self._advance(episode, text, call)
                except Exception as error:  # this sample's text or environment; the batch goes on
                    episode.state.fail(_describe(error))
                    following = None
            observations.append({"role": "tool", "content": ""} if following is None else following)
            returned.append({EPISODE: key})
            if following is None:
                self._episodes.pop(key, None)
                ended.append((i, episode))
        rewards = torch.zeros(len(texts), len(self.reward_keys))
        if ended:
            for _, episode in ended:
                episode.state.close()
                self._endings[episode.state.ending] += 1
            scored = self._score([e.state.trajectory() for _, e in ended], [self._model_tokens(e) for _, e in ended],
                                 [e.truth for _, e in ended])
            rewards[[i for i, _ in ended]] = scored
        terminated = torch.zeros(len(texts))
        terminated[[i for i, _ in ended]] = 1.0
        return EnvironmentReturn(
            observations=observations,
            metadata=returned,
            next_stop_strings=[None] * len(texts),
            rewards={key: rewards[:, k].clone() for k, key in enumerate(self.reward_keys)},
            terminateds=terminated,
            answers=None,
        )

    def take_metrics(self) -> dict[str, float]:
        """The rewards' metrics, ``multi_turn/ended_<why>_frac`` over the episodes ended and
        ``multi_turn/orphaned`` (idle episodes closed) since the last call, and
        ``multi_turn/open_episodes`` now."""
        self._close_idle()
        out = super().take_metrics()
        endings, self._endings = self._endings, Counter()
        total = sum(endings.values())
        if total:
            out.update({f"multi_turn/ended_{why}_frac": endings[why] / total for why in ENDINGS})
        out["multi_turn/open_episodes"] = float(len(self._episodes))
        out["multi_turn/orphaned"], self._orphaned = float(self._orphaned), 0
        return out

    def shutdown(self) -> None:
        for episode in self._episodes.values():
            episode.state.close()
        self._episodes.clear()
        self._pool.close()
        super().shutdown()

    def _close_idle(self) -> None:
        """Close the episodes no step touched for ``episode_idle_s`` (NeMo-RL stopped them)."""
        cutoff = time.monotonic() - self.config.episode_idle_s
        for key in [k for k, e in self._episodes.items() if e.touched < cutoff]:
            self._episodes.pop(key).state.close()
            self._orphaned += 1

    # ---- one episode ---------------------------------------------------------------------

    def _start(self, starting: list[tuple[str, Mapping]]) -> None:
        """Hold an episode for each ``(key, info)`` of ``starting``, its environment's reset sent to
        a host of the pool; an error (the chat template's, the environment's, no worker) fails
        that episode only."""
        opening = []
        for key, info in starting:
            truth, chat = info["ground_truth"], [dict(m) for m in info["messages"]]
            episode = self._episodes[key] = _Episode(self._episode(chat, truth), truth)
            try:
                episode.tokens = len(encode_prompt(self._tokenizer, chat))
            except Exception as error:
                episode.state.fail(_describe(error))
            else:
                opening.append(episode)
        try:
            hosts = self._pool.hosts(len(opening))
        except Exception as error:  # no worker started
            for episode in opening:
                episode.state.fail(_describe(error))
            return
        for episode, host in zip(opening, hosts):
            episode.state.host = host
            try:
                host.send("reset", episode.truth["environment_config"])
            except Exception as error:
                episode.state.fail(_describe(error))

    def _episode(self, chat: list[dict], truth: Mapping) -> Episode:
        """An episode from the prompt ``chat`` through ``truth``'s later turns; its host comes later."""
        environment = self.config.environment
        return Episode(self.environment, None, chat, truth.get("later_turns") or [], environment.max_steps_per_turn,
                       self.config.max_steps)

    def _reset(self, episode: _Episode) -> None:
        """Read the answer to the episode's reset."""
        if episode.state.ending is not None:  # failed at its start
            return
        try:
            note = episode.state.host.receive()
        except Exception as e:
            episode.state.fail(_describe(e))
            return
        if note:
            episode.state.fail(f"environment {self.environment!r}: reset returned an opening note, which NeMo-RL "
                                "cannot show (its prompt is built before the episode starts)")

    def _send_calls(self, e: _Episode, text: str) -> list[Call] | CallRefused | None:
        """The calls of the model's message ``text``, sent to be stepped."""
        if e.state.ending is not None:  # failed at its start
            return None
        try:
            return e.state.send_calls(text)
        except Exception as error:  # this sample's text or environment; the batch goes on
            e.state.fail(_describe(error))
            return None

    def _advance(self, e: _Episode, text: str, calls: list[Call] | CallRefused | None) -> dict | None:
        """The observation message that follows the model's message ``text`` and the step of its
        ``calls`` (sent), or None when the episode ends here (its ``ending`` says why)."""
        if e.state.ending is not None:  # failed at its start or sending its calls
            return None
        e.tokens += self.config.max_new_tokens  # the most it can be: NeMo-RL hands over text only
        new = e.state.advance(text, calls)
        if new is None:
            return None
        try:
            following = continuation_text(self._tokenizer, e.state.chat, text + self._tokenizer.eos_token, text, new)
        except TemplateMismatch as error:
            e.state.fail(str(error))
            return None
        e.tokens += len(self._tokenizer(following, add_special_tokens=False)["input_ids"])
        if e.tokens + self.config.max_new_tokens > self.config.max_total_sequence_length:
            e.state.end("token_budget")
            return None
        e.state.extend(text, new)
        return {"role": new[-1]["role"], "content": following}

    def _model_tokens(self, e: _Episode) -> int:
        """The model's tokens in the trajectory, re-tokenized (the rewards' ``num_tokens``)."""
        texts = [t for turn in e.state.messages for t in turn]
        ids = self._tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        return sum(len(i) + 1 for i in ids)


__getattr__ = actor_class_attribute(MultiTurnEnvironment, __name__, ACTOR_CLASS)


def _last_model_message(message_log: Sequence[Mapping], row: int) -> str:
    if not (isinstance(message_log, Sequence) and message_log and isinstance(message_log[-1], Mapping)
            and message_log[-1].get("role") == "assistant"):
        roles = [m.get("role") for m in message_log] if isinstance(message_log, Sequence) else message_log
        raise ValueError(f"message_log_batch[{row}]: expected the model's message last (roles: {roles})")
    return str(message_log[-1].get("content", ""))


def _episode_info(metadata: Any, row: int) -> Mapping:
    if isinstance(metadata, Mapping) and isinstance(metadata.get(EPISODE), str):
        return metadata  # a later step: the episode holds the rest
    if not (isinstance(metadata, Mapping) and isinstance(metadata.get("ground_truth"), Mapping)
            and isinstance(metadata.get("messages"), list)):
        raise ValueError(f"metadata[{row}]: expected {{'ground_truth', 'messages'}} as multi_turn_prompt_processor "
                         f"builds it, got {type(metadata).__name__}"
                         + (f" with keys {sorted(metadata)}" if isinstance(metadata, Mapping) else ""))
    if "environment_config" not in metadata["ground_truth"]:
        raise ValueError(f"metadata[{row}].ground_truth: no environment_config; write the data with "
                         "write_response_jsonl of a multi-turn family (multi_turn, bfcl_multi_turn)")
    messages = metadata["messages"]
    if not messages or not all(isinstance(m, Mapping) and isinstance(m.get("role"), str)
                               and isinstance(m.get("content"), str) for m in messages):
        raise ValueError(f"metadata[{row}].messages: expected the prompt's chat, a non-empty list of "
                         f"{{'role', 'content'}} strings, got {messages!r:.200}")
    return metadata


def _describe(error: Exception) -> str:
    """An error as an episode's ``failure``: an environment's says what failed itself."""
    return str(error) if isinstance(error, EnvironmentFailed) else f"{type(error).__name__}: {error}"
