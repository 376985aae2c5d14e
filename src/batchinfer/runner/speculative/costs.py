"""Start-up measurement of step costs for `speculative_depth auto` (`StepCosts`).

Dummy steps of `PROBE_ROWS` one-token rows (up to the most rows a step can have with
proposals), each at `PROBE_CONTEXT` tokens of context, run the way real steps run (the native
decode step where it was chosen, else the torch model; sampling included), a warm-up then
`PROBE_STEPS` timed, the fastest counting (a neighbour's work only ever slows a run down; a
step of more rows is never taken as cheaper than one of fewer); one prefill chunk of `PREFILL_TOKENS` tokens gives
the cost per prefill token; the draft model's runner, if any, is probed at the same rows. The
answer is cached under the cache folder, keyed by everything it depends on (machine, torch,
threads, the model's shape, both runners' kernels and cache, the probes), so a restart
measures nothing. The dummy steps write K/V into blocks no sequence owns yet; every slot is
written again before a real step reads it.
"""

from __future__ import annotations

import hashlib
import json
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from batchinfer import native
from batchinfer.core.block_manager import cdiv
from batchinfer.core.cpu import cpu_model
from batchinfer.core.outputs import ScheduledSequence, SchedulerOutput
from batchinfer.core.sampling_params import SamplingParams
from batchinfer.core.scheduling.spec_depth import StepCosts
from batchinfer.models.files import write_cache_json
from batchinfer.runner.model_runner import ModelRunner
from batchinfer.runner.timing import timed_runs

PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PROBE_CONTEXT = 128
PROBE_STEPS = 3
PREFILL_TOKENS = 128
PROBE_VOCAB = 97  # probe tokens are ids 1..97: every vocabulary has them


def probe_rows(max_rows: int) -> tuple[int, ...]:
    """The row counts probed for steps of at most `max_rows` rows."""
    rows = tuple(r for r in PROBE_ROWS if r < max_rows)
    return (*rows, min(max_rows, PROBE_ROWS[-1]))


def step_costs(target: ModelRunner, draft: ModelRunner | None, max_rows: int,
               max_model_len: int, identity: dict[str, Any], cache_dir: Path | None
               ) -> StepCosts:
    """The step costs of `target` (and `draft`) for steps of up to `max_rows` rows, from the
    cache folder where this setup (`identity`: what the runners' speed depends on besides
    machine, torch and probes) was measured before, else measured now."""
    rows = probe_rows(max_rows)
    context = max(1, min(PROBE_CONTEXT, max_model_len - 1))
    facts = {"cpu": cpu_model(), "machine": platform.machine(), "torch": torch.__version__,
             "threads": torch.get_num_threads(), "native": native.source_digest(),
             "rows": list(rows), "context": context, "steps": PROBE_STEPS,
             "prefill": PREFILL_TOKENS, "method": "fastest-rising", **identity}
    key = hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()
    path = cache_dir / "spec-costs" / f"{key[:24]}.json" if cache_dir is not None else None
    if path is not None:
        try:
            stored = json.loads(path.read_text())
            return StepCosts(tuple(stored["rows"]), tuple(stored["decode_s"]),
                             float(stored["prefill_token_s"]),
                             tuple(stored["draft_s"]) if stored["draft_s"] else None)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # not measured yet here, or unreadable: measure
    costs = StepCosts(
        rows, _rising([_decode_s(target, r, context) for r in rows]),
        _prefill_token_s(target, max(1, min(PREFILL_TOKENS, max_model_len - 1))),
        _rising([_decode_s(draft, r, context) for r in rows]) if draft is not None else None)
    if path is not None:
        write_cache_json(path, {"cpu": cpu_model(), "rows": list(costs.rows),
                                "decode_s": list(costs.decode_s),
                                "prefill_token_s": costs.prefill_token_s,
                                "draft_s": list(costs.draft_s) if costs.draft_s else None},
                         "the speculative decoding step costs")
    return costs


def _rising(seconds: list[float]) -> tuple[float, ...]:
    """The times with each at least the one before."""
    out: list[float] = []
    for value in seconds:
        out.append(max(value, out[-1]) if out else value)
    return tuple(out)


def _decode_s(runner: ModelRunner, num_rows: int, context: int) -> float:
    """Median seconds of a step of `num_rows` one-token rows at `context` tokens of context."""
    size = runner.block_size
    per_seq = cdiv(context + 1, size)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    sequences = [ScheduledSequence(
        f"probe-{i}", [(7 * i + 3) % PROBE_VOCAB + 1], context,
        [(i * per_seq + b) % runner.num_blocks for b in range(per_seq)], True, params, context)
        for i in range(num_rows)]
    step = SchedulerOutput(sequences=sequences)
    return _fastest_s(lambda: runner.sample_step(step), runner.device)


def _prefill_token_s(runner: ModelRunner, num_tokens: int) -> float:
    """Seconds per token of a prefill chunk of `num_tokens` tokens."""
    size = runner.block_size
    params = SamplingParams(temperature=0.0, max_tokens=1)
    step = SchedulerOutput(sequences=[ScheduledSequence(
        "probe-prefill", [(5 * i + 1) % PROBE_VOCAB + 1 for i in range(num_tokens)], 0,
        [b % runner.num_blocks for b in range(cdiv(num_tokens, size))], True, params,
        num_tokens)])
    return _fastest_s(lambda: runner.sample_step(step), runner.device) / num_tokens


def _fastest_s(run: Callable[[], object], device: torch.device) -> float:
    """The fastest of `PROBE_STEPS` timed runs after one untimed warm-up."""
    return min(timed_runs(run, device, PROBE_STEPS))
