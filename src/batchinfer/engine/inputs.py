"""Prompt forms accepted by the engine: text, token ids, or chat messages."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# A chat is a list of {"role": ..., "content": ...} messages.
Chat = Sequence[Mapping[str, Any]]
Prompt = str | Sequence[int] | Chat


def is_token_ids(prompt: object) -> bool:
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    )


def is_chat(prompt: object) -> bool:
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str)
        and len(prompt) > 0
        and all(isinstance(m, Mapping) for m in prompt)
    )


def tokenize_prompt(tokenizer: Any, prompt: Prompt, vocab_size: int) -> tuple[str | None, list[int]]:
    """Return (prompt text or None, token ids). `ValueError` names what is wrong."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        return prompt, list(tokenizer.encode(prompt))
    if is_chat(prompt):
        return _render_chat(tokenizer, prompt)  # type: ignore[arg-type]
    if is_token_ids(prompt):
        ids: list[int] = [int(t) for t in prompt]  # type: ignore[arg-type]
        if not ids:
            raise ValueError("prompt must not be empty")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab_size}), got {bad[0]}")
        return None, ids
    raise ValueError(
        "prompt must be a string, a list of token ids or a list of chat messages, "
        f"got {type(prompt).__name__}"
    )


def _render_chat(tokenizer: Any, messages: Chat) -> tuple[str, list[int]]:
    for i, message in enumerate(messages):
        if "role" not in message or "content" not in message:
            raise ValueError(f"messages[{i}] needs 'role' and 'content'")
        if not isinstance(message["role"], str):
            raise ValueError(f"messages[{i}].role must be a string")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model has no chat template; send a plain prompt instead")
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
    )
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise ValueError("messages render to an empty prompt")
    return text, ids
