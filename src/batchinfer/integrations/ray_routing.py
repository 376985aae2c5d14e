"""Prefix-affinity routing on Ray Serve: the key of a generation request's prompt start, and
the request router that sends requests sharing it to the same replica (whose prefix cache
already holds it), unless that replica is busier than the least busy one by more than
`imbalance` requests. `ray_serve` wires it in for `--ray-routing prefix`."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from batchinfer.integrations.ray_cluster import require_ray

require_ray()
from ray.serve.request_router import (  # noqa: E402
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")


def prefix_key(path: str, body: bytes, prefix_chars: int) -> str | None:
    """The hash of a generation request's prompt start, or None (not one, or unreadable)."""
    if path not in GENERATION_PATHS:
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    text = _prompt_text(data)
    if not text:
        return None
    return hashlib.blake2b(text[:prefix_chars].encode("utf-8", "replace"),
                           digest_size=8).hexdigest()


def _prompt_text(data: dict[str, Any]) -> str:
    messages = data.get("messages")
    if isinstance(messages, list):
        parts = []
        for message in messages:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content
                                  if isinstance(p, dict) and isinstance(p.get("text"), str))
            parts.append(f"{message.get('role', '')}:{content if isinstance(content, str) else ''}")
        return "\n".join(parts)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0] if not isinstance(prompt[0], int) else prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt)
    return ""


class PrefixAffinityRouter(RequestRouter):
    """Ray Serve request router: the replica a request's prefix key hashes to first, unless
    it is busier than the least busy by more than `imbalance`; then (and for requests without
    a key) power of two choices. No FIFO mixin: with it, a replica chosen for one request goes
    to the oldest waiting one, which would shuffle prefixes between replicas under load."""

    def initialize_state(self, imbalance: int = 64, **kwargs: Any) -> None:
        self.imbalance = imbalance

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        import random

        pair = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        key = pending_request.kwargs.get("prefix_key") if pending_request is not None else None
        if key is None or len(candidate_replicas) == 1:
            return [pair]
        affine = max(candidate_replicas, key=lambda r: _rendezvous(key, r.replica_id.unique_id))
        loads = [self.replica_queue_len_cache.get(r.replica_id) for r in candidate_replicas]
        known = [n for n in loads if n is not None]
        affine_load = self.replica_queue_len_cache.get(affine.replica_id)
        if affine_load is not None and known and affine_load > min(known) + self.imbalance:
            return [pair]
        return [[affine], pair]


def _rendezvous(key: str, replica: str) -> int:
    digest = hashlib.blake2b(f"{key}/{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
