"""Speculative decoding's Prometheus metrics, with vLLM's names (`batchinfer_` prefix)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from batchinfer.core.outputs import SpecDecodeStats


class SpecDecodeMetrics:
    """Counters of proposals made and accepted (in all and by position in the proposal) and
    the depth of the last step, fed by each step's cumulative `SpecDecodeStats`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.num_drafts = Counter(
            "batchinfer_spec_decode_num_drafts", "Proposals verified (one per sequence and "
            "step that proposed tokens)", registry=r)
        self.num_draft_tokens = Counter(
            "batchinfer_spec_decode_num_draft_tokens", "Tokens proposed", registry=r)
        self.num_accepted_tokens = Counter(
            "batchinfer_spec_decode_num_accepted_tokens", "Proposed tokens accepted",
            registry=r)
        self.accepted_per_pos = Counter(
            "batchinfer_spec_decode_num_accepted_tokens_per_pos", "Proposed tokens accepted, "
            "by position in the proposal (0: the first)", ["position"], registry=r)
        self.depth = Gauge(
            "batchinfer_spec_decode_depth", "Tokens proposed per sequence that could "
            "propose, in the last step (speculative_depth auto chooses it from the load)",
            registry=r)
        self._seen: dict[object, int] = {}

    def record(self, stats: SpecDecodeStats) -> None:
        """Add what the cumulative `stats` gained since the last call; set the depth."""
        self._add(self.num_drafts, "drafts", stats.num_drafts)
        self._add(self.num_draft_tokens, "draft_tokens", stats.num_draft_tokens)
        self._add(self.num_accepted_tokens, "accepted", stats.num_accepted_tokens)
        for position, total in enumerate(stats.accepted_per_position):
            self._add(self.accepted_per_pos.labels(str(position)), position, total)
        self.depth.set(stats.depth)

    def _add(self, counter: Counter, key: object, total: int) -> None:
        seen = self._seen.get(key, 0)
        if total > seen:
            counter.inc(total - seen)
            self._seen[key] = total
