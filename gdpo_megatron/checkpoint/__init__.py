"""Distributed training checkpoints, and Hugging Face <-> Megatron weight conversion.

* :mod:`.layout`: where each weight lives in either format (pure tensor functions);
* :mod:`.weight_stream`: full Hugging Face tensors streamed from TP/PP shards (weight sync);
* :mod:`.hf_config` / :mod:`.hf_io`: ``config.json`` and safetensors import / export;
* :mod:`.manager`: ``step_<N>`` checkpoints with megatron-core ``dist_checkpointing``;
* :mod:`.convert_cli`: the ``gdpo-convert`` command.
"""
