"""A torch-free stand-in for the model runner, with a simulated paged KV cache.

Tokens are written into slots through each sequence's block table and read back through it, so
a scheduler that hands out a wrong or freed block produces different tokens, not just a failed
bookkeeping check. The "model" is a hash of the whole context read from the cache. Swapped
blocks are copied to a simulated host pool and back, so a swap-in from the wrong host block, or
into the wrong device block, changes tokens too.
"""

from __future__ import annotations

from batchinfer.core import ModelRunnerOutput, SchedulerOutput

VOCAB = 1000


def next_token(context: list[int]) -> int:
    h = 17
    for t in context:
        h = (h * 31 + t) % 1_000_003
    return h % VOCAB


class FakeRunner:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
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
        for seq in scheduler_output.sequences:
            start = seq.num_computed_tokens
            for i, token in enumerate(seq.token_ids):
                self.slots[self._slot(seq.block_table, start + i)] = token
            if not seq.sample:
                sampled.append(None)
                continue
            end = start + len(seq.token_ids)
            context = [self.slots[self._slot(seq.block_table, p)] for p in range(end)]
            sampled.append(next_token(context))
        return ModelRunnerOutput(sampled_token_ids=sampled)


def reference_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    """What an exact engine must produce for `prompt`, computed without any cache."""
    context = list(prompt)
    out = []
    for _ in range(max_tokens):
        token = next_token(context)
        out.append(token)
        context.append(token)
    return out
