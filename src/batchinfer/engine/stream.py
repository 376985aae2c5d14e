"""`OutputStream`: the outputs of one request waiting for its reader, on the event loop.

A reader that lags behind the engine gets one merged output per read, never a growing backlog
of small ones: deltas are joined (text, token ids, logprobs per sequence), cumulative outputs
replaced by the latest. Merging joins each piece once, so it stays linear in the output.
"""

from __future__ import annotations

import asyncio

from batchinfer.engine.outputs import CompletionOutput, RequestOutput, RequestOutputKind


class OutputStream:
    """Pending outputs of one request, or the error that ended it."""

    __slots__ = ("kind", "error", "_pending", "_event")

    def __init__(self, kind: RequestOutputKind) -> None:
        self.kind = kind
        self.error: BaseException | None = None
        self._pending: list[RequestOutput] = []
        self._event = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        if self.kind != RequestOutputKind.DELTA:
            self._pending.clear()  # the latest cumulative output holds everything
        self._pending.append(output)
        self._event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._event.set()

    async def get(self) -> RequestOutput:
        """The next output (merged if several are pending); raises the stream's error once
        every output before it has been read."""
        while not self._pending and self.error is None:
            self._event.clear()
            await self._event.wait()
        if not self._pending:
            raise self.error  # type: ignore[misc]
        pending, self._pending = self._pending, []
        return pending[0] if len(pending) == 1 else merge_deltas(pending)


def merge_deltas(outputs: list[RequestOutput]) -> RequestOutput:
    """One DELTA output equal to `outputs` (consecutive deltas of one request) read in order."""
    parts: dict[int, list[CompletionOutput]] = {}
    for output in outputs:
        for completion in output.outputs:
            parts.setdefault(completion.index, []).append(completion)
    merged = []
    for index in sorted(parts):
        pieces = parts[index]
        last = pieces[-1]
        logprobs = None
        if last.logprobs is not None:
            logprobs = [entry for p in pieces for entry in (p.logprobs or ())]
        merged.append(CompletionOutput(
            index=index,
            text="".join(p.text for p in pieces),
            token_ids=[t for p in pieces for t in p.token_ids],
            cumulative_logprob=last.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=last.finish_reason,
            stop_reason=last.stop_reason,
        ))
    last_output = outputs[-1]
    return RequestOutput(
        request_id=last_output.request_id,
        prompt=last_output.prompt,
        prompt_token_ids=last_output.prompt_token_ids,
        outputs=merged,
        finished=last_output.finished,
        metrics=last_output.metrics,
        error=last_output.error,
    )
