"""Prefix caching at admission: a waiting request's cached prefix, and whether it should wait
for a running prefill that is computing blocks it would then find cached.

The block keys of a request's tokens are computed once and kept here while they are needed:
a waiting request's (for its lookups), a running prefill's (for the requests that share its
prompt). `forget` drops a request's when it is admitted (its lookup keys) or ends (both).
"""

from __future__ import annotations

from collections.abc import Iterable

from batchinfer.core.block_manager import BlockKey, BlockManager, block_keys
from batchinfer.core.request import Request


class PrefixSharing:
    """The block keys of waiting and prefilling requests, and the rules that read them."""

    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self._lookup_keys: dict[str, list[BlockKey]] = {}  # of waiting requests
        self._prompt_keys: dict[str, list[BlockKey]] = {}  # of running prefills

    def cached_prefix(self, request: Request) -> list[int]:
        """The cached blocks of a waiting request's longest cached prefix (none unless prefix
        caching is on, none for a swapped-out request)."""
        bm = self.block_manager
        if not bm.enable_prefix_caching or request.swap_blocks:
            return []
        keys = self._lookup_keys.get(request.request_id)
        if keys is None:
            tokens = request.all_token_ids
            keys = block_keys(tokens[: len(tokens) - 1], bm.block_size)
            self._lookup_keys[request.request_id] = keys
        return bm.cached_blocks(keys)

    def prompt_keys(self, request: Request) -> list[BlockKey]:
        """The block keys of a running request's prompt (computed once)."""
        keys = self._prompt_keys.get(request.request_id)
        if keys is None:
            keys = block_keys(request.prompt_token_ids, self.block_manager.block_size)
            self._prompt_keys[request.request_id] = keys
        return keys

    def prefilling_by_first_block(self, running: Iterable[Request]
                                  ) -> dict[BlockKey, list[Request]]:
        """Running requests whose prompt prefill is under way, by their first block's key."""
        if not self.block_manager.enable_prefix_caching:
            return {}
        size = self.block_manager.block_size
        out: dict[BlockKey, list[Request]] = {}
        for r in running:
            if r.num_computed_tokens < r.num_prompt_tokens and r.num_prompt_tokens > size:
                out.setdefault(self.prompt_keys(r)[0], []).append(r)
        return out

    def admitted(self, request: Request, prefilling: dict[BlockKey, list[Request]]) -> None:
        """A waiting request starts: its lookup keys go, and its prefill (when it has more
        than a block) joins `prefilling`, so that its copies wait for it."""
        self._lookup_keys.pop(request.request_id, None)
        bm = self.block_manager
        if bm.enable_prefix_caching and request.num_prompt_tokens > bm.block_size:
            prefilling.setdefault(self.prompt_keys(request)[0], []).append(request)

    def waits_for_a_running_prefill(
        self, request: Request, cached: list[int], prefilling: dict[BlockKey, list[Request]]
    ) -> bool:
        """Whether a running request is still computing blocks this one would find cached once
        that prefill is done (the `n` sequences of one prompt, requests with one system
        prompt): it is better to wait a step or two than to compute them twice."""
        keys = self._lookup_keys.get(request.request_id)
        if not prefilling or not keys or request.num_computed_tokens:
            return False
        size = self.block_manager.block_size
        for other in prefilling.get(keys[0], ()):
            shared = 0
            for mine, theirs in zip(keys, self.prompt_keys(other), strict=False):
                if mine != theirs:
                    break
                shared += 1
            if shared > len(cached) and other.num_computed_tokens < shared * size:
                return True
        return False

    def forget(self, request_id: str) -> None:
        """The request ended: its keys go."""
        self._lookup_keys.pop(request_id, None)
        self._prompt_keys.pop(request_id, None)
