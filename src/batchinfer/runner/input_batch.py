"""Turn one `SchedulerOutput` into the flat token batch and attention metadata of a step.

Every scheduled sequence contributes its tokens to ONE flat batch `[num_tokens]` (prefill chunks
and decodes mixed). The batch is reordered: single-token sequences ("decodes", which include a
one-token prefill chunk) come first, sorted by context length, then the longer chunks in
scheduler order. Token order does not matter to the model outside attention (every other op is
per token and positions are explicit), and this order lets attention treat the decodes as one
contiguous slice `[0, num_decodes)` split into a few groups of similar context length.

Everything is built as Python lists and turned into tensors with one `torch.tensor` call plus
one host-to-device copy, because this runs on every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchinfer.core.outputs import ScheduledSequence

# A decode group is cut when padding it to its longest context would cost more than this many
# times the blocks its sequences really use AND more than this many padding blocks: one more
# group costs a gather + SDPA call per layer, which only pays off past a real amount of padding.
MAX_DECODE_PADDING_RATIO = 1.5
MAX_DECODE_PADDING_BLOCKS = 32


@dataclass(slots=True)
class DecodeGroup:
    """Decodes `[start, end)` of the batch (rows of both tokens and sequences), padded together.

    `block_tables` is `[end - start, num_blocks]`; `context_lens` is `[end - start]`.
    """

    start: int
    end: int
    block_tables: torch.Tensor
    context_lens: torch.Tensor


@dataclass(slots=True)
class PrefillChunk:
    """One multi-token chunk: tokens `[start, end)` at positions `[num_computed_tokens, ...)`.

    `block_ids` covers the whole context `[0, num_computed_tokens + end - start)`.
    """

    start: int
    end: int
    num_computed_tokens: int
    block_ids: torch.Tensor

    @property
    def context_len(self) -> int:
        return self.num_computed_tokens + self.end - self.start


@dataclass(slots=True)
class AttentionMetadata:
    """What paged attention needs for one step; built once, shared by every layer."""

    block_size: int
    slot_mapping: torch.Tensor  # [num_tokens] cache slot each new k/v is written to
    num_decode_tokens: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]


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
    sequences: list[ScheduledSequence],
    block_size: int,
    device: torch.device,
    group_decodes: bool = True,
    max_decode_group_tokens: int | None = None,
) -> StepInputs:
    """Build the flat batch: token ids, positions, slots, decode groups, prefill chunks.

    `group_decodes=False` sends every sequence down the per-chunk path (one attention call per
    sequence); it exists to measure and cross-check the grouped decode path.
    `max_decode_group_tokens` caps a decode group's padded size (members x longest context);
    None: no cap.
    """
    if not sequences:
        raise ValueError("prepare_inputs needs at least one scheduled sequence")
    context_lens = [s.num_computed_tokens + s.num_tokens for s in sequences]
    is_decode = [group_decodes and s.num_tokens == 1 for s in sequences]
    decode_order = sorted(
        (i for i, d in enumerate(is_decode) if d), key=context_lens.__getitem__
    )
    prefill_order = [i for i, d in enumerate(is_decode) if not d]
    order = decode_order + prefill_order

    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_rows: list[int] = []
    sampled_seq_indices: list[int] = []
    starts: list[int] = []
    for i in order:
        seq = sequences[i]
        start = len(input_ids)
        starts.append(start)
        first, end = seq.num_computed_tokens, context_lens[i]
        if len(seq.block_table) * block_size < end:
            raise RuntimeError(
                f"request {seq.request_id}: block table holds {len(seq.block_table)} blocks, "
                f"too few for {end} tokens"
            )
        input_ids.extend(seq.token_ids)
        positions.extend(range(first, end))
        _extend_slots(slots, seq.block_table, block_size, first, end)
        if seq.sample:
            logits_rows.append(start + seq.num_tokens - 1)
            sampled_seq_indices.append(i)

    num_decodes = len(decode_order)
    groups = _decode_groups(
        [context_lens[i] for i in decode_order], block_size, max_decode_group_tokens
    )
    num_group_blocks = [-(-context_lens[decode_order[end - 1]] // block_size) for _, end in groups]
    # Every int64 of the step goes through one tensor and one copy to the device.
    flat: list[int] = input_ids + positions + slots + logits_rows
    for (g_start, g_end), num_blocks in zip(groups, num_group_blocks, strict=True):
        for i in decode_order[g_start:g_end]:
            flat.extend(sequences[i].block_table[:num_blocks])
            flat.extend([0] * (num_blocks - len(sequences[i].block_table)))  # padding, masked
        flat.extend(context_lens[i] for i in decode_order[g_start:g_end])
    for i in prefill_order:
        flat.extend(sequences[i].block_table[: -(-context_lens[i] // block_size)])
    data = torch.tensor(flat, dtype=torch.int64)
    if device.type == "cuda":
        data = data.pin_memory()
    data = data.to(device, non_blocking=True)

    num_tokens = len(input_ids)
    offset = 3 * num_tokens + len(logits_rows)
    decode_groups = []
    for (g_start, g_end), num_blocks in zip(groups, num_group_blocks, strict=True):
        n = g_end - g_start
        tables = data[offset : offset + n * num_blocks].view(n, num_blocks)
        offset += n * num_blocks
        decode_groups.append(DecodeGroup(g_start, g_end, tables, data[offset : offset + n]))
        offset += n
    prefills = []
    for rank, i in enumerate(prefill_order, start=num_decodes):
        num_blocks = -(-context_lens[i] // block_size)
        seq = sequences[i]
        start = starts[rank]
        block_ids = data[offset : offset + num_blocks]
        offset += num_blocks
        prefills.append(
            PrefillChunk(start, start + seq.num_tokens, seq.num_computed_tokens, block_ids)
        )
    metadata = AttentionMetadata(
        block_size=block_size,
        slot_mapping=data[2 * num_tokens : 3 * num_tokens],
        num_decode_tokens=num_decodes,
        decode_groups=decode_groups,
        prefills=prefills,
    )
    return StepInputs(
        input_ids=data[:num_tokens],
        positions=data[num_tokens : 2 * num_tokens],
        attention=metadata,
        logits_indices=data[3 * num_tokens : 3 * num_tokens + len(logits_rows)],
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


def _decode_groups(
    sorted_context_lens: list[int], block_size: int, max_group_tokens: int | None = None
) -> list[tuple[int, int]]:
    """Split decodes (sorted by context length) into `[start, end)` groups of similar length.

    A group grows while padding all of its members to the newest (longest) one stays within
    `MAX_DECODE_PADDING_RATIO` of the blocks they really use (or within
    `MAX_DECODE_PADDING_BLOCKS`), so one very long context does not make every short one gather
    (and attend over) its length; and while its padded size (members x longest context) stays
    within `max_group_tokens` (the attention backend's choice: see
    `attention.max_decode_group_tokens`).
    """
    max_group_blocks = None if max_group_tokens is None else max_group_tokens // block_size
    groups: list[tuple[int, int]] = []
    start, used_blocks = 0, 0
    for i, context_len in enumerate(sorted_context_lens):
        num_blocks = -(-context_len // block_size)
        padded = (i - start + 1) * num_blocks
        used = used_blocks + num_blocks
        too_padded = (
            padded > MAX_DECODE_PADDING_RATIO * used and padded - used > MAX_DECODE_PADDING_BLOCKS
        )
        too_big = max_group_blocks is not None and padded > max_group_blocks
        if i > start and (too_padded or too_big):
            groups.append((start, i))
            start, used_blocks = i, 0
        used_blocks += num_blocks
    if sorted_context_lens:
        groups.append((start, len(sorted_context_lens)))
    return groups
