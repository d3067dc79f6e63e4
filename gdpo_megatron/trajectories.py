"""Multi-turn rollouts: each rollout a trajectory through its own environment, all of a step's
advancing together.

A task family with an environment (``Task.environment``, or the config's ``environment``
section) rolls out trajectories instead of single completions. Trajectory ``k = i * G + j``
(sample ``j`` of prompt ``i``) starts from the prompt's chat and goes, turn by turn:

1. **the model's turn**: one :meth:`~gdpo_megatron.rollout.engine.RolloutEngine.continue_sequences`
   call for every live trajectory of the step at once (the prefix cache serves the tokens of
   earlier turns), seeded by (step seed, global prompt id, ``j``, model turn), so a trajectory
   samples the same whatever else is in the batch and however the step's prompts are split
   over data-parallel ranks;
2. what the model's message means and what follows it is its
   :class:`~gdpo_megatron.environments.episode.Episode`'s decision: a **call** in the model's
   message (:func:`~gdpo_megatron.environments.calls.call_block`) is parsed as data and
   stepped in the trajectory's environment (an
   :class:`~gdpo_megatron.environments.host.EnvironmentHost` from the rollouts' pool of
   environment workers on the replica's leader rank, kept across steps until
   :meth:`TrajectoryRollouts.close`; every trajectory's step is sent before any answer is
   read, so the environments of a turn step at once); the observation (the calls' results,
   or why the message did not parse) comes back as a ``tool``-role message, and the model
   goes again;
3. a **plain answer** ends the user turn: the question's next user message
   (``later_turns``), with the environment's ``start_turn`` note, is fed in and the model goes
   again; after the last user turn the trajectory is done. So is a user turn in which the
   model sent ``environment.max_steps_per_turn`` messages (the last one's calls still run).
   A step after which the environment is ``done`` (a game that ended) ends the trajectory
   there, as an answer to the last user turn would.

Messages come as tokens under the model's chat template: what follows the model's sampled
tokens is the difference between the template's rendering of the chat with and without the
new messages (:func:`continuation_tokens`), so the tokens of earlier turns are never
re-encoded. A template that renders earlier turns differently once more messages follow
(e.g. one that drops earlier reasoning) cannot be continued: the trajectory fails.

Token budget (``rollout.max_model_len``): a model turn starts only with room for
``rollout.max_new_tokens`` after it. When the messages that would follow a model turn leave
less, the trajectory ends there, **truncated**: it keeps every model token it sampled (the last
model span is whole), the messages that did not fit are dropped, and its rewards judge the
calls it made (``finish_reason`` ``"length"``, counted in ``rollout/truncated_fraction``).

Failures: an environment that fails (:class:`~gdpo_megatron.environments.host.EnvironmentFailed`)
or a chat template that cannot be continued ends its trajectory with ``failure`` set; its
rewards are failures (counted), the step goes on.

Training: the policy batch holds each trajectory's prompt and :attr:`TrajectoryRollout.spans`;
only the model's spans are in the loss, with the logprobs they were sampled with
(:func:`gdpo_megatron.experience.policy_batch`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from gdpo_megatron.config import TrainConfig
from gdpo_megatron.data.chat import encode_prompt, render_prompt
from gdpo_megatron.data.samples import Sample
from gdpo_megatron.environments.calls import Call, CallRefused
from gdpo_megatron.environments.episode import Ending, Episode
from gdpo_megatron.environments.host import EnvironmentFailed, EnvironmentPool
from gdpo_megatron.environments.registry import configured_reference
from gdpo_megatron.environments.trajectory import Trajectory
from gdpo_megatron.rollout.engine import Completion, FinishReason, RolloutEngine, SamplingConfig
from gdpo_megatron.tasks import get_task


@dataclass(frozen=True)
class Span:
    """Tokens of a rollout after its prompt: the model's (``logprobs``, one per token, as they
    were sampled) or not (``logprobs`` None: an environment's or user's message, out of the loss)."""

    token_ids: list[int]
    logprobs: list[float] | None = None

    @property
    def is_model(self) -> bool:
        return self.logprobs is not None


@dataclass
class TrajectoryRollout:
    """One trajectory: its prompt, the tokens after it, what the rewards judge, how it ended."""

    prompt_ids: list[int]
    spans: list[Span]
    trajectory: Trajectory
    ending: Ending
    model_turns: int

    @property
    def finish_reason(self) -> FinishReason:
        return "length" if self.ending == "token_budget" else "stop"

    @property
    def model_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.spans if s.is_model)


class TemplateMismatch(ValueError):
    """The chat template renders the chat so far differently once new messages follow."""


def continuation_tokens(tokenizer, chat: list[dict], sampled: Sequence[int], finish_reason: FinishReason,
                        new_messages: list[dict]) -> tuple[str, list[int]]:
    """The model's reply text to ``chat`` (its ``sampled`` tokens as the template shows them) and
    the tokens that follow the sampled ones so that the whole sequence is the template's
    rendering of ``chat + [assistant reply] + new_messages``, ready for the model's next turn.

    The reply is the sampled tokens decoded with special tokens, less the end-of-turn token
    the model stopped on (the template writes its own). TemplateMismatch when the template's
    rendering does not extend the sequence so far."""
    reply_ids = list(sampled)
    if finish_reason == "stop" and reply_ids and reply_ids[-1] in tokenizer.all_special_ids:
        reply_ids = reply_ids[:-1]
    reply = tokenizer.decode(reply_ids, skip_special_tokens=False)
    following = continuation_text(tokenizer, chat, tokenizer.decode(list(sampled), skip_special_tokens=False), reply,
                                  new_messages)
    return reply, tokenizer(following, add_special_tokens=False)["input_ids"]


def continuation_text(tokenizer, chat: list[dict], sampled_text: str, reply: str, new_messages: list[dict]) -> str:
    """The text that follows ``sampled_text`` (the model's message to ``chat`` as the sequence
    holds it) so that the whole is the template's rendering of ``chat + [assistant reply] +
    new_messages``. TemplateMismatch when that rendering does not extend the text so far."""
    so_far = render_prompt(tokenizer, chat) + sampled_text
    after = render_prompt(tokenizer, [*chat, {"role": "assistant", "content": reply}, *new_messages])
    if not after.startswith(so_far):
        at = next((n for n, (a, b) in enumerate(zip(after, so_far)) if a != b), min(len(after), len(so_far)))
        raise TemplateMismatch(f"the chat template renders the trajectory so far differently once "
                               f"{', '.join(m['role'] for m in new_messages)} messages follow (from character "
                               f"{at}: {so_far[at:at + 40]!r} becomes {after[at:at + 40]!r})")
    return after[len(so_far):]


@dataclass
class _Trajectory:
    """A trajectory in progress (on the leader: with its episode)."""

    index: int  # k = i * G + j
    prompt: int  # i, its prompt's index in the step's samples
    key: tuple  # (global prompt id, sample index): seeds its sampling
    tokens: list[int]
    prompt_len: int = 0
    spans: list[Span] = field(default_factory=list)
    episode: Episode | None = None  # the leader's: its environment, chat and the model's messages
    model_turns: int = 0
    ending: Ending | None = None


class TrajectoryRollouts:
    """Rolls out a step's trajectories through environment ``environment`` (a reference,
    :mod:`gdpo_megatron.environments.registry`) within ``max_len`` tokens each. The leader's
    environment workers (started at its first rollout) live until :meth:`close`."""

    def __init__(self, environment: str, step_timeout_s: float, max_steps_per_turn: int, max_len: int):
        self.environment, self.step_timeout_s = environment, step_timeout_s
        self.max_steps_per_turn, self.max_len = max_steps_per_turn, max_len
        self._pool = EnvironmentPool(environment, step_timeout_s)

    def close(self) -> None:
        """End the environment workers (a later rollout starts new ones)."""
        self._pool.close()

    @classmethod
    def for_run(cls, config: TrainConfig) -> "TrajectoryRollouts | None":
        """A run's: through the config's (else the data family's) environment; None for a
        single-turn family."""
        family = get_task(config.data.family, "data.family")
        if not family.multi_turn:
            return None
        env = config.environment
        return cls(configured_reference(env, family.environment), env.step_timeout_s, env.max_steps_per_turn,
                   config.rollout.max_model_len)

    def roll_out(self, engine: RolloutEngine, samples: Sequence[Sample], group_size: int, sampling: SamplingConfig,
                 prompt_keys: Sequence[int], is_leader: bool = True,
                 share: Callable[[object], object] = lambda obj: obj,
                 on_finished: Callable[[int, TrajectoryRollout], None] | None = None) -> list[TrajectoryRollout]:
        """``group_size`` trajectories of each sample, grouped by sample; ``prompt_keys[i]`` names
        sample ``i`` within the step (its global prompt id). Every rank of an engine replica calls
        this with the same arguments; the leader (``is_leader``) runs the environments and
        ``share`` (a broadcast from it) gives the others what came back. ``on_finished(k,
        rollout)`` is called on the leader as trajectory ``k`` ends."""
        tokenizer = engine.tokenizer
        everyone = [_Trajectory(k, i, (prompt_keys[i], j), []) for k, (i, j) in
                    enumerate((i, j) for i in range(len(samples)) for j in range(group_size))]
        finish = (lambda t: self._finish(t, on_finished)) if is_leader else (lambda t: None)
        try:
            if is_leader:
                for t, host in zip(everyone, self._pool.hosts(len(everyone))):
                    sample = samples[t.prompt]
                    t.episode = Episode(self.environment, host, [dict(m) for m in sample.messages],
                                        sample.ground_truth.get("later_turns") or [], self.max_steps_per_turn)
                    host.send("reset", sample.ground_truth["environment_config"])
                for t in everyone:
                    self._start(t, tokenizer, sampling.max_new_tokens)
            starts = share([(t.tokens, t.ending) for t in everyone] if is_leader else None)
            for t, (tokens, ending) in zip(everyone, starts):
                t.tokens, t.prompt_len, t.ending = list(tokens), len(tokens), ending
                if ending is not None:
                    finish(t)
            live = [t for t in everyone if t.ending is None]
            while live:
                completions = engine.continue_sequences(
                    [t.tokens for t in live], sampling, keys=[(*t.key, t.model_turns) for t in live])
                nexts = None
                if is_leader:
                    calls = [t.episode.send_calls(c.text) for t, c in zip(live, completions)]
                    nexts = [self._advance(t, c, call, tokenizer, sampling.max_new_tokens)
                             for t, c, call in zip(live, completions, calls)]
                nexts = share(nexts)
                for t, c, following in zip(live, completions, nexts):
                    t.spans.append(Span(list(c.token_ids), list(c.logprobs)))
                    t.tokens += c.token_ids
                    t.model_turns += 1
                    if following is None:
                        t.ending = t.ending or "answered"  # the leader's _advance said why
                        finish(t)
                    else:
                        t.spans.append(Span(following))
                        t.tokens += following
                live = [t for t in live if t.ending is None]
        finally:
            for t in everyone:
                if t.episode is not None:
                    t.episode.close()
        return share([self._rollout(t) for t in everyone] if is_leader else None)

    # ---- the leader's side ---------------------------------------------------------------

    def _start(self, t: _Trajectory, tokenizer, max_new_tokens: int) -> None:
        """The prompt (with the environment's note), once the environment's reset (sent) answers."""
        episode = t.episode
        try:
            note = episode.host.receive()
        except EnvironmentFailed as e:
            episode.fail(str(e))
            note = ""
        if note:
            episode.chat[-1] = {**episode.chat[-1], "content": f"{episode.chat[-1]['content']}\n\n{note}"}
        t.tokens = encode_prompt(tokenizer, episode.chat)
        if episode.ending is None and len(t.tokens) + max_new_tokens > self.max_len:
            episode.fail(f"the prompt ({len(t.tokens)} tokens) leaves no room for rollout.max_new_tokens="
                         f"{max_new_tokens} in rollout.max_model_len={self.max_len}")
        t.ending = episode.ending

    def _advance(self, t: _Trajectory, completion: Completion, calls: list[Call] | CallRefused | None,
                 tokenizer, max_new_tokens: int) -> list[int] | None:
        """After the model's turn and the step of its ``calls`` (sent): the tokens of the
        messages that follow it, or None when the trajectory ends here (``t.ending`` says why)."""
        episode = t.episode
        new = episode.advance(completion.text, calls)
        if new is not None:
            try:
                reply, following = continuation_tokens(tokenizer, episode.chat, completion.token_ids,
                                                       completion.finish_reason, new)
            except TemplateMismatch as e:
                episode.fail(str(e))
            else:
                if len(t.tokens) + len(completion.token_ids) + len(following) + max_new_tokens <= self.max_len:
                    episode.extend(reply, new)
                    return following
                episode.end("token_budget")
        t.ending = episode.ending
        return None

    def _finish(self, t: _Trajectory, on_finished) -> None:
        t.episode.close()
        if on_finished is not None:
            on_finished(t.index, self._rollout(t))

    @staticmethod
    def _rollout(t: _Trajectory) -> TrajectoryRollout:
        return TrajectoryRollout(t.tokens[:t.prompt_len], t.spans, t.episode.trajectory(), t.ending or "answered",
                                 t.model_turns)


def trajectory_metrics(rollouts: Sequence[TrajectoryRollout],
                       reduce: Callable[[list[float]], list[float]] = lambda sums: sums) -> dict[str, float]:
    """Model turns per trajectory and how trajectories ended, over the whole step (``reduce``
    sums each value over the data-parallel replicas)."""
    endings = ("answered", "turn_limit", "token_budget", "failed")
    n, turns, non_model, *ended = reduce([
        len(rollouts), sum(r.model_turns for r in rollouts),
        sum(len(s.token_ids) for r in rollouts for s in r.spans if not s.is_model),
        *(sum(r.ending == e for r in rollouts) for e in endings)])
    n = max(n, 1.0)
    return {"rollout/model_turns_mean": turns / n, "rollout/observation_tokens_mean": non_model / n,
            **{f"rollout/ended_{e}_frac": count / n for e, count in zip(endings, ended)}}
