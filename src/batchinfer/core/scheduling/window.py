"""Sliding windows in the paged KV cache: which blocks a request still needs, and the most it
holds at once.

Where every layer of the model attends over a window of `window` tokens (Mistral, Phi-3, Qwen2
with `use_sliding_window` on all its layers), a query at position `p` reads the keys of
positions `p - window + 1 .. p` only. A step that computes a request's tokens from position
`c` on therefore reads nothing before `c - window + 1`, nor does any later step: the blocks
wholly before it are dropped (`BlockManager.drop_blocks_before`) when the request is next
scheduled, and a request holds at most the window behind its chunk's first query plus the
chunk (`max_held_blocks`), however long it grows. Admission and the watermarks count those
blocks, not the whole context. Where some layer reads the whole context (Gemma's global
layers, Qwen2's first `max_window_layers`), every block stays: the cache has one block table
for all layers (docs/architecture.md, "Sliding windows").
"""

from __future__ import annotations

from dataclasses import dataclass

from batchinfer.core.block_manager import cdiv


@dataclass(frozen=True, slots=True)
class KVWindow:
    """The window every layer attends over (`window` tokens; None: some layer reads the whole
    context, and no block is dropped), with the cache's `block_size` and the longest chunk a
    step computes (`max_chunk_tokens`, the step's token budget)."""

    window: int | None
    block_size: int
    max_chunk_tokens: int

    def first_block(self, num_computed_tokens: int) -> int:
        """The first block any query from position `num_computed_tokens` on reads: the blocks
        before it end before `num_computed_tokens - window + 1`."""
        if self.window is None:
            return 0
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    @property
    def max_held_blocks(self) -> int | None:
        """The most blocks a request holds in a step: those from its chunk's first query's
        window to its chunk's last token (None without a window: its whole context)."""
        if self.window is None:
            return None
        return cdiv(self.window - 1 + self.max_chunk_tokens, self.block_size) + 1

    def blocks_held(self, num_tokens: int) -> int:
        """The most blocks a request of `num_tokens` known tokens holds at once."""
        total = cdiv(num_tokens, self.block_size)
        bound = self.max_held_blocks
        return total if bound is None else min(total, bound)
