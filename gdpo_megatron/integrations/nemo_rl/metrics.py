"""This project's per-reward diagnostics in NeMo-RL's logs, for its synchronous GRPO loop.

NeMo-RL's ``grpo_train`` never reads an estimator's ``last_metrics`` (only
``async_grpo_train`` does) and never calls an environment's metrics hook, but it hands the
``logger`` it is given every metric it logs. :class:`DiagnosticsLogger` wraps that logger:

* the step's ``train`` metrics (the loop's last ``log_metrics(metrics, step, prefix="train")``
  of a step, after the advantages) get the GDPO estimator's diagnostics of that step;
* every ``train`` and ``validation`` call gets what the metric sources (e.g. the reward
  environment's :meth:`~gdpo_megatron.integrations.nemo_rl.RewardStageEnvironment.take_metrics`)
  collected since the previous call, so rollouts scored during generation land in the
  step's ``train`` metrics and those scored during validation in ``validation``.

Keys the loop logs itself win over added ones; everything else passes through unchanged.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

from gdpo_megatron.integrations.nemo_rl.estimator import GDPOMegatronEstimator, last_built_estimator


class DiagnosticsLogger:
    """NeMo-RL's ``Logger`` plus this project's diagnostics; pass it to ``grpo_train``.

    ``estimator``: the GDPO estimator whose diagnostics to add (default: the one the factory
    patched by :func:`~gdpo_megatron.integrations.nemo_rl.install` built last).
    ``metric_sources``: callables returning a flat metrics dict each time they are called.
    """

    def __init__(
        self,
        logger: Any,
        estimator: GDPOMegatronEstimator | None = None,
        metric_sources: Iterable[Callable[[], dict]] = (),
    ):
        self._logger = logger
        self._estimator = estimator
        self._sources = list(metric_sources)
        self._logged_result = None  # the estimator result already logged

    def log_metrics(
        self,
        metrics: dict[str, Any],
        step: int,
        prefix: str | None = "",
        step_metric: str | None = None,
        step_finished: bool = False,
    ) -> None:
        added: dict[str, Any] = {}
        if prefix in ("train", "validation"):
            for source in self._sources:
                added.update(source())
        if prefix == "train":
            added.update(self._unlogged_estimator_metrics())
        fresh = {k: v for k, v in added.items() if k not in metrics}
        self._logger.log_metrics({**metrics, **fresh} if fresh else metrics, step, prefix, step_metric, step_finished)

    def __getattr__(self, name: str) -> Any:  # log_histogram, log_batched_dict_as_jsonl, ...
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._logger, name)

    def _unlogged_estimator_metrics(self) -> dict[str, float]:
        estimator = self._estimator or last_built_estimator()
        if estimator is None or estimator.last_result is None or estimator.last_result is self._logged_result:
            return {}
        self._logged_result = estimator.last_result
        return dict(estimator.last_metrics)
