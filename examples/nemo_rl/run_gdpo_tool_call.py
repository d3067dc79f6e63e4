"""GDPO on the tool-calling task in NeMo-RL, with gdpo-megatron's estimator, reward
environment and diagnostics. Modelled on NeMo-RL's examples/run_grpo.py (read at commit
7ea279abfbeb698b092856d0dab61e7cf39bc909); run it from a NeMo-RL checkout whose Python
environment also has gdpo-megatron installed (see gdpo_tool_call.sh):

    python run_gdpo_tool_call.py --data /data/toolrl/train.jsonl [key=value overrides]
    python run_gdpo_tool_call.py --family bfcl_multi_turn --config gdpo_bfcl_multi_turn_1B.yaml \
        --data bfcl_multi_turn_train.jsonl [key=value overrides]

Differences from run_grpo.py: gdpo-megatron's estimator factory is installed first; the
config is examples/nemo_rl/gdpo_tool_call_1B.yaml laid over NeMo-RL's gdpo_math_1B.yaml;
--data is converted to NeMo-RL's ResponseDataset format; the environment (the reward stage,
or for a multi-turn family the multi-turn environment) and its data processor are registered
under the names data.default.env_name and data.default.processor; the logger is wrapped so that the per-reward diagnostics
reach it; only the synchronous loop is run.
"""
# Before any other nemo_rl.algorithms import: grpo_sync imports the factory by name.
from gdpo_megatron.integrations import nemo_rl as gdpo_nemo_rl

gdpo_nemo_rl.install()

import argparse  # noqa: E402
import pprint  # noqa: E402
from pathlib import Path  # noqa: E402

import ray  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

import nemo_rl  # noqa: E402
from nemo_rl.algorithms.grpo import MasterConfig, grpo_train, setup, shutdown_environments  # noqa: E402
from nemo_rl.algorithms.utils import get_tokenizer  # noqa: E402
from nemo_rl.data.processors import register_processor  # noqa: E402
from nemo_rl.data.utils import setup_response_data  # noqa: E402
from nemo_rl.distributed.ray_actor_environment_registry import ACTOR_ENVIRONMENT_REGISTRY  # noqa: E402
from nemo_rl.distributed.virtual_cluster import PY_EXECUTABLES, init_ray  # noqa: E402
from nemo_rl.environments.utils import register_env  # noqa: E402
from nemo_rl.models.generation import configure_generation_config  # noqa: E402
from nemo_rl.utils.config import (load_config, merge_with_override, parse_hydra_overrides,  # noqa: E402
                                  register_omegaconf_resolvers)
from nemo_rl.utils.logger import get_next_experiment_dir  # noqa: E402

from gdpo_megatron.tasks import get_task  # noqa: E402

HERE = Path(__file__).resolve().parent
ACTOR = "gdpo_megatron.integrations.nemo_rl.environment.RewardStageEnvironmentActor"
MULTI_TURN_ACTOR = "gdpo_megatron.integrations.nemo_rl.multi_turn.MultiTurnEnvironmentActor"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="prompts of --family (examples/data/tool.jsonl for tool)")
    parser.add_argument("--family", default="tool", choices=["tool", "math", "code", "multi_turn", "bfcl_multi_turn"])
    parser.add_argument("--config", default=str(HERE / "gdpo_tool_call_1B.yaml"))
    parser.add_argument("--base-config", default=str(Path(nemo_rl.__file__).resolve().parents[1] / "examples" /
                                                     "configs" / "gdpo_math_1B.yaml"),
                        help="NeMo-RL's config this one is laid over (default: the checkout's gdpo_math_1B.yaml)")
    return parser.parse_known_args()


def main() -> None:
    args, overrides = parse_args()
    register_omegaconf_resolvers()
    config = merge_with_override(load_config(args.base_config), OmegaConf.load(args.config))
    if overrides:
        config = parse_hydra_overrides(config, overrides)
    prompts = Path(OmegaConf.select(config, "checkpointing.checkpoint_dir")) / "prompts.jsonl"
    count = gdpo_nemo_rl.write_response_jsonl(args.data, args.family, prompts)
    print(f"Wrote {count} prompts of {args.data} to {prompts}")
    config.data.train.data_path = str(prompts)
    processor_name, env_name = (OmegaConf.select(config, f"data.default.{key}") for key in ("processor", "env_name"))
    config = MasterConfig(**OmegaConf.to_container(config, resolve=True))
    pprint.pprint(config)
    config.logger["log_dir"] = get_next_experiment_dir(config.logger["log_dir"])

    multi_turn = get_task(args.family).multi_turn
    processor = gdpo_nemo_rl.multi_turn_prompt_processor if multi_turn else gdpo_nemo_rl.prompt_processor
    actor = MULTI_TURN_ACTOR if multi_turn else ACTOR
    register_processor(processor_name, processor)
    register_env(env_name, actor)
    ACTOR_ENVIRONMENT_REGISTRY[actor] = PY_EXECUTABLES.SYSTEM  # this Python, which has gdpo-megatron
    init_ray()

    tokenizer = get_tokenizer(config.policy["tokenizer"])
    config.policy["generation"] = configure_generation_config(config.policy["generation"], tokenizer)
    dataset, val_dataset, task_to_env, val_task_to_env = setup_response_data(tokenizer, config.data, config.env)
    (policy, policy_generation, _nemo_gym, _cluster, dataloader, val_dataloader, loss_fn, logger, checkpointer,
     grpo_state, master_config, _teachers, _aliases) = setup(config, tokenizer, dataset, val_dataset)

    # The estimator's diagnostics, and each environment's reward means / failures / timeouts.
    environments = {id(env): env for env in [*task_to_env.values(), *val_task_to_env.values()]}.values()
    logger = gdpo_nemo_rl.DiagnosticsLogger(
        logger, metric_sources=[lambda env=env: ray.get(env.take_metrics.remote()) for env in environments]
    )
    try:
        with checkpointer:
            grpo_train(policy, policy_generation, dataloader, val_dataloader, tokenizer, loss_fn, task_to_env,
                       val_task_to_env, logger, checkpointer, grpo_state, master_config)
    finally:
        shutdown_environments(task_to_env, val_task_to_env)
        policy_generation.shutdown()


if __name__ == "__main__":
    main()
