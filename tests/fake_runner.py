"""A torch-free stand-in for the model runner, with a simulated paged KV cache.

Tokens are written into slots through each sequence's block table and read back through it, so
a scheduler that hands out a wrong or freed block produces different tokens, not just a failed
bookkeeping check. The "model" is a hash of the whole context read from the cache. Swapped
blocks are copied to a simulated host pool and back, so a swap-in from the wrong host block, or
into the wrong device block, changes tokens too.

Speculative decoding: a sequence's proposed tokens (the scheduler's, or for the draft method
the fake draft's: the right next token, except where `draft_misses` says otherwise) are written
into their slots like the chunk's, and verified greedily: accepted while each is the token the
context before it gives. Rejected tokens stay in their slots, so a scheduler that counted one
as computed reads it back and produces different tokens.
"""

from __future__ import annotations

from collections.abc import Callable

from batchinfer.core import ModelRunnerOutput, SchedulerOutput

VOCAB = 1000


def next_token(context: list[int]) -> int:
    h = 17
    for t in context:
        h = (h * 31 + t) % 1_000_003
    return h % VOCAB


class FakeRunner:
    """`model`: the next token of a context (default: `next_token`, a hash of it)."""

    def __init__(self, block_size: int, model: Callable[[list[int]], int] = next_token) -> None:
        self.block_size = block_size
        self.model = model
        self.slots: dict[int, int] = {}
        self.host: dict[int, list[int | None]] = {}  # host block -> its slots' tokens
        self.num_steps = 0

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def swap_blocks(
        self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]
    ) -> None:
        size = self.block_size
        for device, host in swap_out:
            self.host[host] = [self.slots.get(device * size + i) for i in range(size)]
        for host, device in swap_in:
            for i, token in enumerate(self.host.pop(host)):
                if token is None:
                    self.slots.pop(device * size + i, None)
                else:
                    self.slots[device * size + i] = token

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        sampled: list[int | None] = []
        accepted: list[list[int]] = []
        for seq in scheduler_output.sequences:
            start = seq.num_computed_tokens
            self._write(seq.block_table, start, seq.token_ids)
            accepted.append([])
            if not seq.sample:
                sampled.append(None)
                continue
            end = start + len(seq.token_ids)
            context = [self.slots[self._slot(seq.block_table, p)] for p in range(end)]
            drafts = seq.spec_token_ids
            if drafts is None:
                drafts = self._draft(context, seq.num_spec_tokens)
            if len(drafts) != seq.num_spec_tokens:
                raise RuntimeError(f"{seq.request_id}: {len(drafts)} proposals, "
                                   f"{seq.num_spec_tokens} scheduled")
            self._write(seq.block_table, end, drafts)
            for draft in drafts:
                token = self.model(context)
                if token != draft:
                    break
                accepted[-1].append(draft)
                context.append(self.slots[self._slot(seq.block_table, len(context))])
            sampled.append(self.model(context))
        return ModelRunnerOutput(sampled_token_ids=sampled, accepted_token_ids=accepted)

    def _write(self, table: list[int], start: int, tokens: list[int]) -> None:
        for i, token in enumerate(tokens):
            self.slots[self._slot(table, start + i)] = token

    def _draft(self, context: list[int], k: int) -> list[int]:
        """The fake draft model: the true continuation, with a miss where `draft_misses`."""
        context, drafts = list(context), []
        for _ in range(k):
            token = self.model(context)
            if draft_misses(context):
                token = (token + 1) % VOCAB
            drafts.append(token)
            context.append(token)
        return drafts


def draft_misses(context: list[int]) -> bool:
    """Where the fake draft proposes a wrong token: about one position in four."""
    return (len(context) * 7 + context[-1]) % 4 == 0


def reference_tokens(prompt: list[int], max_tokens: int,
                     model: Callable[[list[int]], int] = next_token) -> list[int]:
    """What an exact engine must produce for `prompt`, computed without any cache."""
    context = list(prompt)
    out = []
    for _ in range(max_tokens):
        token = model(context)
        out.append(token)
        context.append(token)
    return out
