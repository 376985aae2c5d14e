"""Turn one `SchedulerOutput` into the flat token batch and attention metadata of a step.

Every scheduled sequence contributes its tokens to ONE flat batch `[num_tokens]` (prefill chunks
and decodes mixed). The batch is reordered: single-token sequences ("decodes", which include a
one-token prefill chunk) come first, sorted by context length, then the longer chunks in
scheduler order. Token order does not matter to the model outside attention (every other op is
per token and positions are explicit), and this order lets an attention backend treat the
decodes as one contiguous slice `[0, num_decodes)` that it may split into groups of similar
context length. How it groups them is the backend's choice (`runner/backends/`), not this
module's: the metadata built here is the same for every backend.

Everything is built as Python lists and turned into tensors with one `torch.tensor` call plus
one host-to-device copy, because this runs on every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchinfer.core.outputs import ScheduledSequence


@dataclass(slots=True)
class AttentionMetadata:
    """What attention needs of one step, the same for every backend; built once per step.

    Sequences are in batch order. Sequence `i` owns batch rows
    `[query_starts[i], query_starts[i + 1])`, at positions `[num_computed_tokens[i],
    context_lens[i])`; its block table (the blocks of its whole context, no more) is
    `block_ids[block_starts[i] : block_starts[i + 1]]`. The first `num_decodes` sequences have
    one query each (so row `i` is sequence `i`) and are sorted by context length. The lists are
    on the host, for decisions that must not wait for the device; the tensors are on the device.
    A sequence's blocks dropped outside the sliding window (`ScheduledSequence.
    num_dropped_blocks`) stand in its table as copies of its first block still held: only
    keys the window hides are read there.
    """

    block_size: int
    num_decodes: int
    query_starts: list[int]  # [num_seqs + 1]
    num_computed_tokens: list[int]  # [num_seqs]
    context_lens: list[int]  # [num_seqs] num_computed_tokens + query length
    block_starts: list[int]  # [num_seqs + 1]
    slot_mapping: torch.Tensor  # [num_tokens] cache slot each new k/v is written to
    block_ids: torch.Tensor  # [block_starts[-1]] every block table, concatenated
    block_starts_tensor: torch.Tensor  # [num_seqs + 1] `block_starts` on the device
    context_lens_tensor: torch.Tensor  # [num_seqs] `context_lens` on the device

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    def block_table(self, seq_index: int) -> torch.Tensor:
        """Block ids of sequence `seq_index`'s context, `[ceil(context_len / block_size)]`."""
        return self.block_ids[self.block_starts[seq_index] : self.block_starts[seq_index + 1]]


@dataclass(slots=True)
class StepInputs:
    """Model inputs of one step; rows are in batch order (see module docstring)."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attention: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] rows of the hidden states to compute logits for
    # `sampled_seq_indices[i]` is the index in `SchedulerOutput.sequences` of logits row i.
    sampled_seq_indices: list[int]


def prepare_inputs(
    sequences: list[ScheduledSequence], block_size: int, device: torch.device
) -> StepInputs:
    """Build the flat batch: token ids, positions, slots, block tables, in batch order."""
    if not sequences:
        raise ValueError("prepare_inputs needs at least one scheduled sequence")
    context_lens = [s.num_computed_tokens + s.num_tokens for s in sequences]
    decode_order = sorted(
        (i for i, s in enumerate(sequences) if s.num_tokens == 1), key=context_lens.__getitem__
    )
    order = decode_order + [i for i, s in enumerate(sequences) if s.num_tokens != 1]

    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_rows: list[int] = []
    sampled_seq_indices: list[int] = []
    block_ids: list[int] = []
    query_starts: list[int] = [0]
    block_starts: list[int] = [0]
    for i in order:
        seq = sequences[i]
        first, end = seq.num_computed_tokens, context_lens[i]
        num_blocks = -(-end // block_size)
        table = seq.block_table
        if seq.num_dropped_blocks:
            if seq.num_dropped_blocks * block_size > first or not table:
                raise RuntimeError(f"request {seq.request_id}: blocks dropped past its "
                                   f"{first} computed tokens")
            table = [table[0]] * seq.num_dropped_blocks + table
        if len(table) < num_blocks:
            raise RuntimeError(
                f"request {seq.request_id}: block table holds {len(table)} blocks, "
                f"too few for {end} tokens"
            )
        input_ids.extend(seq.token_ids)
        positions.extend(range(first, end))
        _extend_slots(slots, table, block_size, first, end)
        block_ids.extend(table[:num_blocks])
        if seq.sample:
            logits_rows.append(len(input_ids) - 1)
            sampled_seq_indices.append(i)
        query_starts.append(len(input_ids))
        block_starts.append(len(block_ids))

    ordered_context_lens = [context_lens[i] for i in order]
    # Every int64 of the step goes through one tensor and one copy to the device.
    flat = input_ids + positions + slots + logits_rows + block_ids
    flat += block_starts + ordered_context_lens
    data = torch.tensor(flat, dtype=torch.int64)
    if device.type == "cuda":
        data = data.pin_memory()
    data = data.to(device, non_blocking=True)

    num_tokens, num_sampled, num_seqs = len(input_ids), len(logits_rows), len(order)
    offset = 3 * num_tokens + num_sampled
    metadata = AttentionMetadata(
        block_size=block_size,
        num_decodes=len(decode_order),
        query_starts=query_starts,
        num_computed_tokens=[sequences[i].num_computed_tokens for i in order],
        context_lens=ordered_context_lens,
        block_starts=block_starts,
        slot_mapping=data[2 * num_tokens : 3 * num_tokens],
        block_ids=data[offset : offset + len(block_ids)],
        block_starts_tensor=data[offset + len(block_ids) : offset + len(block_ids) + num_seqs + 1],
        context_lens_tensor=data[len(data) - num_seqs :],
    )
    return StepInputs(
        input_ids=data[:num_tokens],
        positions=data[num_tokens : 2 * num_tokens],
        attention=metadata,
        logits_indices=data[3 * num_tokens : offset],
        sampled_seq_indices=sampled_seq_indices,
    )


def _extend_slots(
    slots: list[int], block_table: list[int], block_size: int, first: int, end: int
) -> None:
    """Append the cache slots of positions `[first, end)`, one `range` per block touched."""
    pos = first
    while pos < end:
        block_index, offset = divmod(pos, block_size)
        run = min(block_size - offset, end - pos)
        base = block_table[block_index] * block_size + offset
        slots.extend(range(base, base + run))
        pos += run
