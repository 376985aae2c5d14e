"""Prompt lookup (`speculative_method ngram`): propose what followed an earlier occurrence of the
sequence's last few tokens.

For n from `max_n` down to `min_n`, the last n tokens of prompt + output are looked up in the
tokens before them; the latest earlier occurrence found proposes the (up to) k tokens that
followed it. Copying spans of the prompt (extraction, quoting, editing code) or repeating
itself, a model's next tokens are often exactly those.

The search runs in C: the tokens are packed as 32-bit integers and `bytes.rfind` finds the
pattern (a hit at an offset that is not a multiple of 4 straddles two tokens and is skipped),
so a step's lookups cost microseconds per sequence even over long contexts.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_ITEM = array("i").itemsize


def propose(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens proposed after `token_ids` ([] when no suffix of `min_n`..`max_n`
    tokens occurs earlier, or nothing follows the occurrence)."""
    num_tokens = len(token_ids)
    if k < 1 or num_tokens <= min_n:
        return []
    packed = array("i", token_ids).tobytes()
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        start = _latest_earlier(packed, num_tokens, n)
        if start is not None:
            follow = start + n
            return list(token_ids[follow : follow + k])
    return []


def _latest_earlier(packed: bytes, num_tokens: int, n: int) -> int | None:
    """Token index of the latest occurrence of the last `n` tokens that ends before the last
    token (so it is not the suffix itself), or None."""
    pattern = packed[(num_tokens - n) * _ITEM :]
    end = (num_tokens - 1) * _ITEM
    while True:
        at = packed.rfind(pattern, 0, end)
        if at < 0:
            return None
        if at % _ITEM == 0:
            return at // _ITEM
        end = at + len(pattern) - 1  # a straddling hit: look before it
