"""Paged attention over shuffled, non-contiguous blocks equals dense causal attention.

Every attention backend runs the same mixed step (prefill chunks, decodes, one chunk after a
cached prefix) over a cache full of garbage wherever a sequence must not look; its prefixes
are written by the backend itself in an earlier step, as in the engine. The helpers here
(`make_case`, `run_backend`) also serve `test_attention_backends.py`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from batchinfer.core.outputs import ScheduledSequence
from batchinfer.core.sampling_params import SamplingParams
from batchinfer.runner.attention import AttentionBackend, select_attention_backend
from batchinfer.runner.backends.cpu_sparse import supports_cpu_sparse
from batchinfer.runner.backends.paged_rows import DecodeGroup, DecodeGrouping, group_decodes
from batchinfer.runner.input_batch import prepare_inputs
from batchinfer.runner.kv_cache import bytes_per_block, num_kv_blocks

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16
BLOCK_SIZE = 8
NUM_BLOCKS = 80
CPU = torch.device("cpu")
BACKENDS = ("sdpa", "gather", "cpu_sparse")

# (num_computed_tokens, num_new_tokens): 3 prefill chunks (the second one follows a cached
# 19-token prefix) and 5 decodes, contexts crossing block boundaries and far apart in length.
SHAPES = [(0, 20), (5, 1), (19, 17), (15, 1), (0, 1), (0, 5), (7, 1), (120, 1)]


@dataclass
class Spec:
    num_layers: int = 2
    num_kv_heads: int = NUM_KV_HEADS
    head_dim: int = HEAD_DIM


@dataclass
class Case:
    """A step's sequences and, per sequence, q/k/v of its whole context `[ctx, heads, d]`."""

    sequences: list[ScheduledSequence]
    queries: list[torch.Tensor]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    block_size: int
    num_blocks: int


def make_case(
    shapes: list[tuple[int, int]],
    seed: int,
    dtype: torch.dtype,
    num_heads: int = NUM_HEADS,
    num_kv_heads: int = NUM_KV_HEADS,
    head_dim: int = HEAD_DIM,
    block_size: int = BLOCK_SIZE,
) -> Case:
    """Sequences of `shapes` over shuffled blocks of a pool with spare blocks; random q/k/v."""
    rng = random.Random(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in shapes) + 8
    free = list(range(num_blocks))
    rng.shuffle(free)
    generator = torch.Generator().manual_seed(seed)
    case = Case([], [], [], [], block_size, num_blocks)
    for i, (num_computed, num_new) in enumerate(shapes):
        context_len = num_computed + num_new
        num_table_blocks = -(-context_len // block_size)
        table, free = free[:num_table_blocks], free[num_table_blocks:]
        case.sequences.append(
            ScheduledSequence(
                request_id=f"r{i}",
                token_ids=[1] * num_new,
                num_computed_tokens=num_computed,
                block_table=table,
                sample=True,
                sampling_params=SamplingParams(),
                num_prompt_tokens=context_len,
            )
        )
        for out, heads in ((case.queries, num_heads), (case.keys, num_kv_heads),
                           (case.values, num_kv_heads)):
            out.append(torch.randn(context_len, heads, head_dim, generator=generator).to(dtype))
    return case


def _step(
    backend: AttentionBackend,
    case: Case,
    sequences: list[ScheduledSequence],
    layer: int,
    device: torch.device,
) -> list[torch.Tensor]:
    """Run one step of `sequences` (all sampling) through `backend`; outputs per sequence."""
    inputs = prepare_inputs(sequences, case.block_size, device)
    order = inputs.sampled_seq_indices  # every sequence samples: its batch order
    if sorted(order) != list(range(len(sequences))):
        raise AssertionError("every sequence of a test step must sample")
    spans = []
    for i in order:
        first = sequences[i].num_computed_tokens
        spans.append(slice(first, first + sequences[i].num_tokens))
    # Sequence `order[r]` is the r-th of the batch (`case` lists are indexed by request id).
    ids = [int(sequences[i].request_id[1:]) for i in order]
    q, k, v = (
        torch.cat([rows[s][span] for s, span in zip(ids, spans, strict=True)]).to(device)
        for rows in (case.queries, case.keys, case.values)
    )
    expected_positions = torch.cat([torch.arange(span.start, span.stop) for span in spans])
    torch.testing.assert_close(inputs.positions.cpu(), expected_positions)
    backend.build(inputs.attention)
    out = backend(layer, q, k, v)
    assert out.dtype == q.dtype and out.shape == q.shape
    out = out.cpu()
    starts = inputs.attention.query_starts
    by_sequence: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
    for rank, i in enumerate(order):
        by_sequence[i] = out[starts[rank] : starts[rank + 1]]
    return by_sequence


def run_backend(
    name: str, case: Case, kv_dtype: torch.dtype, layer: int = 1, device: torch.device = CPU
) -> list[torch.Tensor]:
    """Attention output `[num_tokens, heads, d]` (on the CPU) per sequence of `case`.

    The cache starts as garbage (`normal_`); a first step prefills every cached prefix through
    the backend itself (writing its K/V), then the case's step runs.
    """
    head_dim, num_kv_heads = case.keys[0].shape[-1], case.keys[0].shape[1]
    backend = select_attention_backend(device, kv_dtype, name)
    backend.allocate_kv_cache(Spec(2, num_kv_heads, head_dim), case.num_blocks, case.block_size)
    if backend.kv_cache.dtype.itemsize == 1:  # FP8: garbage bytes, none of them NaN
        backend.kv_cache.view(torch.uint8).random_(0, 0x70)
    else:
        backend.kv_cache.normal_()
    prefixes = [
        ScheduledSequence(s.request_id, [1] * s.num_computed_tokens, 0, s.block_table, True,
                          SamplingParams(), s.num_computed_tokens)
        for s in case.sequences
        if s.num_computed_tokens > 0
    ]
    with torch.inference_mode():
        if prefixes:
            _step(backend, case, prefixes, layer, device)
        return _step(backend, case, case.sequences, layer, device)


def _dense(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first: int) -> torch.Tensor:
    """Float64 causal attention of queries at positions first.. over keys/values `[ctx, kv, d]`."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.double().repeat_interleave(group, dim=1)  # [ctx, heads, d]
    values = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * q.shape[-1] ** -0.5
    query_pos = torch.arange(q.shape[0])[:, None] + first
    scores = scores.masked_fill(torch.arange(keys.shape[0]) > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def backend_dtype_cases() -> list[tuple[str, torch.dtype]]:
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    return [(b, d) for b in BACKENDS for d in dtypes if b != "cpu_sparse" or supports_cpu_sparse(CPU, d)]


@pytest.mark.parametrize(("backend", "dtype"), backend_dtype_cases())
def test_paged_attention_equals_dense(backend: str, dtype: torch.dtype) -> None:
    case = make_case(SHAPES, seed=0, dtype=dtype)
    outputs = run_backend(backend, case, dtype)
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    for seq, out, queries, keys, values in zip(
        case.sequences, outputs, case.queries, case.keys, case.values, strict=True
    ):
        first, context_len = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_tokens
        expected = _dense(queries[first:], keys[:context_len], values[:context_len], first)
        torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0)


def test_inputs_layout() -> None:
    sequences = make_case(SHAPES, seed=2, dtype=torch.float32).sequences
    inputs = prepare_inputs(sequences, BLOCK_SIZE, CPU)
    metadata = inputs.attention
    # Decode rows first, by context length: contexts 1, 6, 8, 16, 121
    assert inputs.positions[:5].tolist() == [0, 5, 7, 15, 120]
    owners = [4, 1, 6, 3, 7] + [0] * 20 + [2] * 17 + [5] * 5
    slots = metadata.slot_mapping.tolist()
    for slot, pos, i in zip(slots, inputs.positions.tolist(), owners, strict=True):
        table = sequences[i].block_table
        assert slot == table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    batch_order = [4, 1, 6, 3, 7, 0, 2, 5]
    assert metadata.num_decodes == 5
    assert metadata.query_starts == [0, 1, 2, 3, 4, 5, 25, 42, 47]
    assert metadata.num_computed_tokens == [SHAPES[i][0] for i in batch_order]
    assert metadata.context_lens == [1, 6, 8, 16, 121, 20, 36, 5]
    assert metadata.context_lens_tensor.tolist() == metadata.context_lens
    assert metadata.block_starts_tensor.tolist() == metadata.block_starts
    for rank, i in enumerate(batch_order):
        assert metadata.block_table(rank).tolist() == sequences[i].block_table
    # A decode group pads tables by repeating each one's last block: contexts 8 and 16 (1 and 2
    # blocks) padded to 3 blocks.
    starts = metadata.block_starts_tensor
    group = DecodeGroup(2, 4, 3, metadata.context_lens_tensor[2:4], torch.arange(3 * BLOCK_SIZE),
                        metadata.block_ids, starts[2:4, None], starts[3:5, None] - 1)
    table_6, table_3 = sequences[6].block_table, sequences[3].block_table
    assert group.block_tables().tolist() == [table_6 * 3, table_3 + table_3[1:]]
    # Logits rows: the last token of every sampled sequence, reported in scheduler order.
    assert inputs.sampled_seq_indices == batch_order
    last_rows = {4: 0, 1: 1, 6: 2, 3: 3, 7: 4, 0: 24, 2: 41, 5: 46}
    assert inputs.logits_indices.tolist() == [last_rows[i] for i in inputs.sampled_seq_indices]


def test_decode_groups_cut_padding_and_size() -> None:
    limits = DecodeGrouping(max_padding_ratio=1.5, max_padding_blocks=32, max_group_tokens=1 << 20)
    # The 121-token context is not padded together with the 1..16-token ones (59 padding
    # blocks), a 40-token one is (15 padding blocks, within `max_padding_blocks`).
    assert group_decodes([1, 6, 8, 16, 121], BLOCK_SIZE, limits) == [(0, 4), (4, 5)]
    assert group_decodes([1, 6, 8, 16, 40], BLOCK_SIZE, limits) == [(0, 5)]
    # 10 contexts of 40 blocks: groups of at most 3 by size.
    small = DecodeGrouping(1.5, 32, 120 * BLOCK_SIZE)
    assert group_decodes([320] * 10, BLOCK_SIZE, small) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert group_decodes([], BLOCK_SIZE, small) == []


def test_num_kv_blocks_from_budget() -> None:
    per_block = bytes_per_block(Spec(), 16, torch.bfloat16)
    assert per_block == 2 * 2 * 16 * NUM_KV_HEADS * HEAD_DIM * 2
    assert num_kv_blocks(Spec(), 16, torch.bfloat16, 10 * per_block + 1) == 10
    assert num_kv_blocks(Spec(), 16, torch.float32, 10 * per_block + 1) == 5
    assert num_kv_blocks(Spec(), 16, torch.float32, 10) == 0
