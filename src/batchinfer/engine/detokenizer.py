"""Incremental detokenization that never emits broken UTF-8, and stop-string matching."""

from __future__ import annotations

from typing import Any

# Tokens of context decoded in front of the new ones, so that a token whose text depends on its
# left neighbour (leading spaces, byte-level merges) decodes as it does inside the full text.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, one step at a time.

    Decodes a small window `[prefix_offset:]` and emits only what extends the window's previous
    text; a trailing U+FFFD (an incomplete multi-byte character) is held until the next token
    completes it. Stop strings are searched in the new tail only; `text` is what may be shown:
    while the request runs, a suffix that could still become a stop string is held back.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.stop = stop
        self.include_stop_str = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.full_text = ""
        self.stop_string: str | None = None
        self._holdback = max((len(s) for s in stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string if one now appears (text is cut there)."""
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            new_text = self._decode(self.token_ids[self.prefix_offset :])
            if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
                continue
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            search_from = max(0, len(self.full_text) - self._holdback)
            self.full_text += delta
            if self._find_stop(search_from):
                return self.stop_string
        return None

    def flush(self) -> None:
        """At the end, emit what was held back waiting for more bytes (as U+FFFD), so the final
        text equals decoding all output tokens at once."""
        if self.stop_string is not None:
            return
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text):
            self.full_text += new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset = len(self.token_ids)

    def _find_stop(self, search_from: int) -> bool:
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.full_text.find(s, search_from)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.full_text = self.full_text[: i + len(s)] if self.include_stop_str else self.full_text[:i]
        self.stop_string = s
        return True

    def visible_text(self, finished: bool) -> str:
        """Text safe to show now: everything once finished, else minus a possible stop prefix."""
        if finished or not self.stop:
            return self.full_text
        return self.full_text[: max(0, len(self.full_text) - self._holdback)]
