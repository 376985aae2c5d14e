"""Incremental detokenization that never emits broken UTF-8, and stop-string matching.

Host work per sequence grows linearly with its output: each token decodes a window of a few
tokens, stop strings are searched in the new text plus a short tail, and text is handed out as
deltas (`take_delta`) without rebuilding what was already sent.
"""

from __future__ import annotations

from typing import Any

# Tokens of context decoded in front of the new ones, so that a token whose text depends on its
# left neighbour (leading spaces, byte-level merges) decodes as it does inside the full text.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, one step at a time.

    Decodes a small window `[prefix_offset:]` and emits only what extends the window's previous
    text; a trailing U+FFFD (an incomplete multi-byte character) is held until the next token
    completes it. While the sequence runs, the last `len(longest stop string) - 1` characters
    are held back (they could still become a stop string), so a stop string is never shown.

    Text lives in two parts: `_settled` (pieces no stop string can change any more) and
    `_tail` (the last `holdback` characters, which one still could). A stop string can only
    start inside the tail plus the new text, so the search and the cut never touch `_settled`;
    `take_delta` hands out the settled pieces not handed out yet.
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
        self.stop_string: str | None = None
        self.num_read = 0  # tokens of the last `add_tokens` read (all, unless a stop string)
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._settled: list[str] = []
        self._num_taken = 0  # settled pieces already handed out by `take_delta`
        self._tail = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string if one now appears (text is cut there, and
        `num_read` says how many of `new_token_ids` were read, the one completing it last)."""
        self.num_read = 0
        for token_id in new_token_ids:
            self.num_read += 1
            self.token_ids.append(token_id)
            if self.prefix_offset > 4 * _CONTEXT_TOKENS:
                self._trim()
            prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            new_text = self._decode(self.token_ids[self.prefix_offset :])
            if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
                continue
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            tail = self._tail + delta
            if self.stop and self._find_stop(tail, len(self._tail)):
                return self.stop_string
            self._settle(tail, self._holdback)
        return None

    def _settle(self, tail: str, keep: int) -> None:
        """Move all but the last `keep` characters of `tail` to the settled pieces."""
        cut = max(0, len(tail) - keep)
        if cut:
            self._settled.append(tail[:cut])
        self._tail = tail[cut:]

    def _trim(self) -> None:
        # Tokens before the decode window are never read again: drop them so the list stays
        # short (a long run of undecodable bytes still keeps its whole window).
        del self.token_ids[: self.prefix_offset]
        self.read_offset -= self.prefix_offset
        self.prefix_offset = 0

    def flush(self) -> None:
        """At the end, emit what was held back waiting for more bytes (as U+FFFD), so the final
        text equals decoding all output tokens at once."""
        if self.stop_string is not None:
            return
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text):
            self._tail += new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset = len(self.token_ids)

    def _find_stop(self, tail: str, old_len: int) -> bool:
        """Search `tail` (old tail + new text) for the earliest stop string that ends in the
        new text; if found, cut the text there (settling all of it) and return True."""
        search_from = max(0, old_len - self._holdback)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = tail.find(s, search_from)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self._settle(tail[: i + len(s)] if self.include_stop_str else tail[:i], keep=0)
        self.stop_string = s
        return True

    def take_delta(self, finished: bool) -> str:
        """The text that became visible since the last call: everything once `finished`, else
        all but the held-back tail."""
        if finished:
            self._settle(self._tail, keep=0)
        pieces = self._settled[self._num_taken :]
        self._num_taken = len(self._settled)
        return "".join(pieces)

    def text(self, finished: bool) -> str:
        """The whole visible text (for cumulative outputs; costs a join of everything)."""
        if finished:
            self._settle(self._tail, keep=0)
        return "".join(self._settled)
