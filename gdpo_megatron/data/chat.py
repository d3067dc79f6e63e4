"""Turn a prompt chat into model input with the tokenizer's own chat template."""
from __future__ import annotations

from typing import Any


def render_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The prompt text: the chat rendered by the tokenizer's template, ready for the answer."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)!r} has no chat_template; "
            "set tokenizer.chat_template to a Jinja template"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of :func:`render_prompt` (the template supplies any special tokens)."""
    return tokenizer(render_prompt(tokenizer, messages), add_special_tokens=False)["input_ids"]
