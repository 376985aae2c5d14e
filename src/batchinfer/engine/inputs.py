"""Prompt forms accepted by the engine: text, token ids, or chat messages.

Chat content is text, never markup: a message that contains the text of a special token
(`<|im_end|>\n<|im_start|>system`) is tokenized as that text, so a user cannot forge a turn of
another role; only the chat template's own markers become special tokens.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from batchinfer.engine.tools import render_tool_messages, template_takes_tools

# Stands for message i's content while the template renders (no template alters it).
_CONTENT_MARK = "\x1eBATCHINFER_CONTENT_{}\x1e"
_CONTENT_MARK_RE = re.compile("\x1eBATCHINFER_CONTENT_([0-9]+)\x1e")

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


def tokenize_prompt(
    tokenizer: Any,
    prompt: Prompt,
    vocab_size: int,
    special_tokens_in_chat: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[str | None, list[int]]:
    """Return (prompt text or None, token ids). `ValueError` names what is wrong.

    `special_tokens_in_chat=True` parses special-token text inside chat content as the special
    tokens (the template's markers always are): only for callers who trust their users.
    `tools` (OpenAI's function tools) go to a chat's template, or into the fallback system
    prompt where the template does not take them (`engine/tools.py`)."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        return prompt, list(tokenizer.encode(prompt))
    if is_chat(prompt):
        return _render_chat(tokenizer, prompt, special_tokens_in_chat,  # type: ignore[arg-type]
                            tools)
    if tools:
        raise ValueError("tools need a chat (a list of messages), not a plain prompt")
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


def _render_chat(
    tokenizer: Any,
    messages: Chat,
    special_tokens_in_content: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[str, list[int]]:
    for i, message in enumerate(messages):
        if "role" not in message or "content" not in message:
            raise ValueError(f"messages[{i}] needs 'role' and 'content'")
        if not isinstance(message["role"], str):
            raise ValueError(f"messages[{i}].role must be a string")
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        raise ValueError("this model has no chat template; send a plain prompt instead")
    takes_tools = template_takes_tools(template)
    messages = render_tool_messages(messages, tools, takes_tools)
    options = {"tools": [dict(t) for t in tools]} if tools and takes_tools else {}
    text = _apply_template(tokenizer, messages, options)
    if special_tokens_in_content or not _holds_special_text(tokenizer, messages):
        ids = list(tokenizer.encode(text, add_special_tokens=False))
    else:
        ids = _encode_content_as_text(tokenizer, messages, options)
    if not ids:
        raise ValueError("messages render to an empty prompt")
    return text, ids


def _apply_template(
    tokenizer: Any, messages: list[dict[str, Any]], options: Mapping[str, Any]
) -> str:
    text: str = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                              **options)
    return text


def _holds_special_text(tokenizer: Any, messages: Chat) -> bool:
    specials = _special_texts(tokenizer)
    return any(
        isinstance(m["content"], str) and any(s in m["content"] for s in specials)
        for m in messages
    )


def _special_texts(tokenizer: Any) -> set[str]:
    texts = set(getattr(tokenizer, "all_special_tokens", ()))
    for token in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(token, "special", False):
            texts.add(token.content)
    return {t for t in texts if t}


def _encode_content_as_text(
    tokenizer: Any, messages: Chat, options: Mapping[str, Any] | None = None
) -> list[int]:
    """Render with a mark in place of each content, then tokenize the template's own text with
    special tokens and each content as plain text, in order."""
    marked = [dict(m, content=_CONTENT_MARK.format(i)) if isinstance(m["content"], str)
              else dict(m) for i, m in enumerate(messages)]
    pieces = _CONTENT_MARK_RE.split(_apply_template(tokenizer, marked, options or {}))
    ids: list[int] = []
    for k, piece in enumerate(pieces):
        if k % 2 == 0:  # template text
            ids.extend(tokenizer.encode(piece, add_special_tokens=False))
        else:  # a message's content
            content = messages[int(piece)]["content"]
            ids.extend(tokenizer.encode(content, add_special_tokens=False,
                                        split_special_tokens=True))
    return ids
