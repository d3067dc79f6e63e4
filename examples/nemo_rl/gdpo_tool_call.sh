#!/bin/bash
# GDPO on the tool-calling task in NeMo-RL on one 8-GPU node, with gdpo-megatron's estimator,
# reward environment and diagnostics (examples/nemo_rl/gdpo_tool_call_1B.yaml).
#
#   NEMO_RL_DIR=/path/to/RL DATA=/data/toolrl/train.jsonl bash examples/nemo_rl/gdpo_tool_call.sh [key=value ...]
#
# NEMO_RL_DIR: a NeMo-RL checkout (the interfaces were read at commit
# 7ea279abfbeb698b092856d0dab61e7cf39bc909) with its uv environment; DATA: prompts in the
# format of examples/data/tool.jsonl. Arguments are NeMo-RL config overrides.
set -euo pipefail

HERE=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
: "${NEMO_RL_DIR:?set NEMO_RL_DIR to a NeMo-RL checkout}"
: "${DATA:?set DATA to a tool-calling JSONL (the format of examples/data/tool.jsonl)}"

cd "$NEMO_RL_DIR"
# Without dependencies: NeMo-RL's environment already has what the plug-in imports (torch,
# transformers, pyyaml, math-verify) and must keep its own torch and megatron-core.
uv pip install --no-deps -e "$HERE/../.."
uv run python "$HERE/run_gdpo_tool_call.py" --data "$DATA" \
    cluster.gpus_per_node=8 \
    cluster.num_nodes=1 \
    "$@"
