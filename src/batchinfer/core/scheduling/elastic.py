"""Elastic max_tokens: under pressure, batch-class requests that did not choose `max_tokens`
get a lower output cap, so that long batch outputs give back their room to waiting requests.

Pressure is KV usage above `kv_soft_watermark` with requests waiting. The cap is
`elastic_min_tokens`, never below what the request has produced + 1 nor below its
`min_tokens`, and only where it lowers the request's output limit. A cap, once set, stays.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchinfer.core.request import Request


@dataclass(frozen=True, slots=True)
class ElasticCaps:
    """The rule's knobs: `elastic_max_tokens`, `kv_soft_watermark`, `elastic_min_tokens`."""

    enabled: bool
    kv_soft_watermark: float | None
    elastic_min_tokens: int

    def under_pressure(self, num_waiting: int, kv_cache_usage: float) -> bool:
        """Whether caps apply in this step: the rule is on, requests wait, usage is past the
        soft watermark."""
        soft = self.kv_soft_watermark
        return (self.enabled and soft is not None and num_waiting > 0
                and kv_cache_usage > soft)

    def cap_for(self, request: Request, output_limit: int) -> int | None:
        """The cap to set on a running request under pressure (None: it keeps its limit), given
        the most output tokens it may produce now (`output_limit`)."""
        if (not request.elastic or request.priority_class != "batch"
                or request.max_tokens_cap is not None):
            return None
        cap = max(self.elastic_min_tokens, request.num_output_tokens + 1,
                  request.sampling_params.min_tokens)
        return cap if cap < output_limit else None
