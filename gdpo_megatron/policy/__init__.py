"""The policy: a megatron-core GPT model, its token logprobs, the GDPO loss, the train step."""
