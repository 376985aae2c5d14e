"""Paged attention over shuffled, non-contiguous blocks equals dense causal attention."""

from __future__ import annotations

import random

import pytest
import torch

from batchinfer.core.outputs import ScheduledSequence
from batchinfer.core.sampling_params import SamplingParams
from batchinfer.runner.attention import PagedAttention
from batchinfer.runner.input_batch import prepare_inputs
from batchinfer.runner.kv_cache import allocate_kv_cache, bytes_per_block, num_kv_blocks

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16
BLOCK_SIZE = 8
NUM_BLOCKS = 80
CPU = torch.device("cpu")

# (num_computed_tokens, num_new_tokens): 3 prefill chunks (the second one follows a cached
# 19-token prefix) and 5 decodes, contexts crossing block boundaries and far apart in length.
SHAPES = [(0, 20), (5, 1), (19, 17), (15, 1), (0, 1), (0, 5), (7, 1), (120, 1)]


class _Spec:
    num_layers = 2
    num_kv_heads = NUM_KV_HEADS
    head_dim = HEAD_DIM


def _make_batch(seed: int) -> list[ScheduledSequence]:
    rng = random.Random(seed)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    sequences = []
    for i, (num_computed, num_new) in enumerate(SHAPES):
        num_blocks = -(-(num_computed + num_new) // BLOCK_SIZE)
        table, free = free[:num_blocks], free[num_blocks:]
        sequences.append(
            ScheduledSequence(
                request_id=f"r{i}",
                token_ids=[1] * num_new,
                num_computed_tokens=num_computed,
                block_table=table,
                sample=True,
                sampling_params=SamplingParams(),
                num_prompt_tokens=num_computed + num_new,
            )
        )
    return sequences


def _dense(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first: int) -> torch.Tensor:
    """Float64 causal attention of queries at positions first.. over keys/values `[ctx, kv, d]`."""
    group = NUM_HEADS // NUM_KV_HEADS
    keys = keys.double().repeat_interleave(group, dim=1)  # [ctx, heads, d]
    values = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * HEAD_DIM**-0.5
    query_pos = torch.arange(q.shape[0])[:, None] + first
    scores = scores.masked_fill(torch.arange(keys.shape[0]) > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def _run_case(dtype: torch.dtype, group_decodes: bool, seed: int = 0) -> None:
    torch.manual_seed(seed)
    sequences = _make_batch(seed)
    cache = allocate_kv_cache(_Spec, NUM_BLOCKS, BLOCK_SIZE, dtype, CPU)
    cache.normal_()  # stale garbage everywhere a sequence must not look
    layer = 1
    # Full-context K/V per sequence; write the already-computed prefix into its blocks.
    contexts = []
    for seq in sequences:
        context_len = seq.num_computed_tokens + seq.num_tokens
        keys = torch.randn(context_len, NUM_KV_HEADS, HEAD_DIM).to(dtype)
        values = torch.randn(context_len, NUM_KV_HEADS, HEAD_DIM).to(dtype)
        for pos in range(seq.num_computed_tokens):
            block, offset = divmod(pos, BLOCK_SIZE)
            cache[layer, 0, seq.block_table[block], offset] = keys[pos]
            cache[layer, 1, seq.block_table[block], offset] = values[pos]
        queries = torch.randn(seq.num_tokens, NUM_HEADS, HEAD_DIM).to(dtype)
        contexts.append((queries, keys, values))

    inputs = prepare_inputs(sequences, BLOCK_SIZE, CPU, group_decodes=group_decodes)
    # Lay this step's q/k/v out in the runner's batch order, read back by position.
    order = _batch_order(sequences, inputs.positions.tolist(), group_decodes)
    q = torch.cat([contexts[i][0][j : j + 1] for i, j in order])
    k = torch.cat([contexts[i][1][sequences[i].num_computed_tokens + j][None] for i, j in order])
    v = torch.cat([contexts[i][2][sequences[i].num_computed_tokens + j][None] for i, j in order])
    out = PagedAttention(cache, inputs.attention)(layer, q, k, v)

    assert out.dtype == dtype and out.shape == q.shape
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    for row, (i, j) in enumerate(order):
        queries, keys, values = contexts[i]
        first = sequences[i].num_computed_tokens
        expected = _dense(
            queries[j : j + 1], keys[: first + j + 1], values[: first + j + 1], first + j
        )
        torch.testing.assert_close(out[row : row + 1].double(), expected, atol=atol, rtol=0)


def _batch_order(
    sequences: list[ScheduledSequence], positions: list[int], group_decodes: bool
) -> list[tuple[int, int]]:
    """(sequence index, token index in its chunk) of each batch row."""
    decode_ids = [i for i, s in enumerate(sequences) if group_decodes and s.num_tokens == 1]
    other_ids = [i for i in range(len(sequences)) if i not in decode_ids]
    order = []
    # Decodes come first sorted by context length; the others keep scheduler order.
    for i in sorted(decode_ids, key=lambda i: sequences[i].num_computed_tokens + 1):
        order.append((i, 0))
    for i in other_ids:
        order.extend((i, j) for j in range(sequences[i].num_tokens))
    expected_positions = [sequences[i].num_computed_tokens + j for i, j in order]
    if expected_positions != positions:
        raise AssertionError("batch layout changed; update the test")
    return order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_paged_attention_equals_dense(dtype: torch.dtype) -> None:
    _run_case(dtype, group_decodes=True)


def test_per_sequence_path_equals_dense() -> None:
    sequences = _make_batch(1)
    inputs = prepare_inputs(sequences, BLOCK_SIZE, CPU, group_decodes=False)
    assert inputs.attention.decode_groups == [] and len(inputs.attention.prefills) == 8
    _run_case(torch.float32, group_decodes=False, seed=1)


def test_inputs_layout() -> None:
    sequences = _make_batch(2)
    inputs = prepare_inputs(sequences, BLOCK_SIZE, CPU)
    # Decode rows first, by context length: contexts 1, 6, 8, 16, 121
    assert inputs.positions[:5].tolist() == [0, 5, 7, 15, 120]
    slots = inputs.attention.slot_mapping.tolist()
    positions = inputs.positions.tolist()
    owners = [4, 1, 6, 3, 7] + [0] * 20 + [2] * 17 + [5] * 5
    for slot, pos, i in zip(slots, positions, owners, strict=True):
        table = sequences[i].block_table
        assert slot == table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    # The 121-token context is not padded together with the 1..16-token ones.
    groups = inputs.attention.decode_groups
    assert [(g.start, g.end) for g in groups] == [(0, 4), (4, 5)]
    assert groups[0].block_tables.shape == (4, 2)
    # Logits rows: the last token of every sampled sequence, reported in scheduler order.
    assert sorted(inputs.sampled_seq_indices) == list(range(8))
    last_rows = {4: 0, 1: 1, 6: 2, 3: 3, 7: 4, 0: 24, 2: 41, 5: 46}
    assert inputs.logits_indices.tolist() == [last_rows[i] for i in inputs.sampled_seq_indices]


def test_num_kv_blocks_from_budget() -> None:
    per_block = bytes_per_block(_Spec, 16, torch.bfloat16)
    assert per_block == 2 * 2 * 16 * NUM_KV_HEADS * HEAD_DIM * 2
    assert num_kv_blocks(_Spec, 16, torch.bfloat16, 10 * per_block + 1) == 10
    assert num_kv_blocks(_Spec, 16, torch.float32, 10 * per_block + 1) == 5
    assert num_kv_blocks(_Spec, 16, torch.float32, 10) == 0
