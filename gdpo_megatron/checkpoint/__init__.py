"""Distributed training checkpoints, and Hugging Face <-> Megatron weight conversion.

* :mod:`.layout`: where each weight lives in either format (pure tensor functions);
* :mod:`.weight_stream`: full Hugging Face tensors streamed from TP/PP shards (weight sync);
* :mod:`.hf_config` / :mod:`.hf_io`: ``config.json`` and safetensors import / export;
* :mod:`.hf_files`: a Hugging Face directory's safetensors files, found and checked from their headers;
* :mod:`.trained_with`: how an export was prompted and sampled in training (``gdpo_training.json``);
* :mod:`.manager`: ``step_<N>`` checkpoints with megatron-core ``dist_checkpointing``;
* :mod:`.state`: a checkpoint root's complete steps and their ``trainer_state.json`` (no megatron-core).

``gdpo-convert`` is :mod:`gdpo_megatron.commands.convert`.
"""
