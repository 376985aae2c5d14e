"""ModelRunner end to end: chunked, interleaved and whole prefills give the same results.

A tiny stand-in model follows the runner's model contract (flat batch, explicit positions,
attention through the runner's callable); a dense reference recomputes each sequence from
scratch with plain causal attention, no cache. The end-to-end tests run on every attention
backend.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchinfer.core.outputs import ScheduledSequence, SchedulerOutput, TokenLogprobs
from batchinfer.core.sampling_params import SamplingParams
from batchinfer.models import llama
from batchinfer.runner.input_batch import prepare_inputs
from batchinfer.runner.model_runner import AttentionFn, ModelRunner

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 48, 32, 4, 2, 8, 2
BLOCK_SIZE, NUM_BLOCKS = 4, 96
CPU = torch.device("cpu")
BACKENDS = ["sdpa", "gather", "cpu_sparse"]


@dataclass(frozen=True)
class ToySpec:
    num_layers: int = LAYERS
    num_heads: int = HEADS
    num_kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM
    hidden_size: int = HIDDEN
    vocab_size: int = VOCAB
    max_position_embeddings: int = 128


class ToyLM(nn.Module):
    """Embeddings + learned positions, `LAYERS` GQA attention blocks, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.spec = ToySpec()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(self.spec.max_position_embeddings, HIDDEN)
        self.qkv = nn.ModuleList(
            nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM) for _ in range(LAYERS)
        )
        self.out = nn.ModuleList(nn.Linear(HEADS * HEAD_DIM, HIDDEN) for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos(positions)  # [n, hidden]
        n = x.shape[0]
        for layer in range(LAYERS):
            qkv = self.qkv[layer](x).view(n, HEADS + 2 * KV_HEADS, HEAD_DIM)
            q, k, v = qkv[:, :HEADS], qkv[:, HEADS : HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS :]
            x = x + self.out[layer](attention(layer, q, k, v).reshape(n, HEADS * HEAD_DIM))
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()


def _dense_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of ONE whole sequence, no cache."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    return out.transpose(0, 1)


def dense_last_logits(model: Any, token_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor(token_ids)
    with torch.inference_mode():
        hidden = model(ids, torch.arange(len(ids)), _dense_attention)
        return model.compute_logits(hidden[-1:])[0]


@dataclass
class _Seq:
    """Test-side scheduler state of one request."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)


class _Driver:
    """Schedules given chunk sizes per step over a shuffled block pool, like the scheduler."""

    def __init__(self, runner: ModelRunner, seed: int) -> None:
        self.runner = runner
        self.free_blocks = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free_blocks)
        self.seqs: dict[str, _Seq] = {}

    def add(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.seqs[request_id] = _Seq(request_id, list(prompt), len(prompt), params)

    def step(self, chunks: list[tuple[str, int]]) -> None:
        scheduled = []
        for request_id, num_tokens in chunks:
            seq = self.seqs[request_id]
            end = seq.num_computed_tokens + num_tokens
            if end > len(seq.token_ids):
                raise AssertionError("test schedules tokens that do not exist")
            while len(seq.block_table) * BLOCK_SIZE < end:
                seq.block_table.append(self.free_blocks.pop())
            scheduled.append(
                ScheduledSequence(
                    request_id=request_id,
                    token_ids=seq.token_ids[seq.num_computed_tokens : end],
                    num_computed_tokens=seq.num_computed_tokens,
                    block_table=list(seq.block_table),
                    sample=end == len(seq.token_ids),
                    sampling_params=seq.params,
                    num_prompt_tokens=seq.num_prompt_tokens,
                    all_token_ids=list(seq.token_ids),
                    sample_index=len(seq.outputs),
                )
            )
        output = self.runner.execute(SchedulerOutput(scheduled))
        assert len(output.sampled_token_ids) == len(scheduled)
        for i, s in enumerate(scheduled):
            seq = self.seqs[s.request_id]
            seq.num_computed_tokens += s.num_tokens
            token = output.sampled_token_ids[i]
            assert (token is None) == (not s.sample)
            if token is not None:
                seq.token_ids.append(token)
                seq.outputs.append(token)
                entry = None if output.logprobs is None else output.logprobs[i]
                if entry is not None:
                    seq.logprobs.append(entry)

    def decode(self, request_ids: list[str], num_steps: int) -> None:
        for _ in range(num_steps):
            self.step([(r, 1) for r in request_ids])


def _model(seed: int = 0) -> ToyLM:
    torch.manual_seed(seed)
    return ToyLM().eval()


def _runner(
    model: Any,
    seed: int = 0,
    kv_dtype: torch.dtype = torch.float32,
    attention_backend: str = "auto",
) -> ModelRunner:
    return ModelRunner(
        model, model.spec, NUM_BLOCKS, BLOCK_SIZE, CPU, kv_dtype, [0], seed,
        attention_backend=attention_backend,
    )


PROMPT_A = [(7 * i + 3) % VOCAB for i in range(37)]
PROMPT_B = [(5 * i + 1) % VOCAB for i in range(20)]
PROMPT_C = [11, 12, 13, 14, 15]
GREEDY = SamplingParams(temperature=0.0, logprobs=5, max_tokens=64)


def _run_a(
    model: nn.Module, schedule: str, params: SamplingParams = GREEDY, backend: str = "auto"
) -> _Seq:
    """Request 'a' alone in one prefill, in three chunks, or chunked among b and c."""
    driver = _Driver(_runner(model, attention_backend=backend), seed=len(schedule))
    driver.add("a", PROMPT_A, params)
    if schedule == "whole":
        driver.step([("a", 37)])
        driver.decode(["a"], 5)
    elif schedule == "chunks":
        for size in (13, 16, 8):
            driver.step([("a", size)])
        driver.decode(["a"], 5)
    else:
        driver.add("b", PROMPT_B, SamplingParams(temperature=0.8, max_tokens=64))
        driver.add("c", PROMPT_C, SamplingParams(temperature=0.0, repetition_penalty=1.3))
        driver.step([("b", 20), ("a", 13)])
        driver.step([("b", 1), ("c", 5), ("a", 16)])
        driver.step([("c", 1), ("a", 8), ("b", 1)])
        driver.decode(["c", "b", "a"], 3)
        driver.step([("a", 1)])
        driver.decode(["b", "a", "c"], 1)
    return driver.seqs["a"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_equals_dense_reference(backend: str) -> None:
    model = _model()
    runner = _runner(model, attention_backend=backend)
    assert runner.attention.name == backend and runner.num_blocks == NUM_BLOCKS
    # Blocks 9, 7, ..., 0 reversed: the context is read back through a non-trivial table.
    scheduled = SchedulerOutput(
        [
            ScheduledSequence(
                "a",
                PROMPT_A,
                0,
                list(range(9, -1, -1)),
                True,
                SamplingParams(temperature=0.0),
                37,
                PROMPT_A,
            )
        ]
    )
    with torch.inference_mode():
        inputs = prepare_inputs(scheduled.sequences, runner.block_size, runner.device)
        logits = runner.compute_logits(inputs)
    assert inputs.sampled_seq_indices == [0] and logits.shape == (1, VOCAB)
    torch.testing.assert_close(logits[0], dense_last_logits(model, PROMPT_A), atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("schedule", ["chunks", "interleaved"])
def test_chunked_and_interleaved_match_whole_prefill(schedule: str, backend: str) -> None:
    model = _model()
    whole = _run_a(model, "whole", backend=backend)
    other = _run_a(model, schedule, backend=backend)
    assert len(whole.outputs) == 6
    assert other.outputs == whole.outputs
    for a, b in zip(whole.logprobs, other.logprobs, strict=True):
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        torch.testing.assert_close(
            [lp for _, lp in a.top], [lp for _, lp in b.top], atol=1e-5, rtol=0
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_generation_matches_dense_recompute(backend: str) -> None:
    model = _model(1)
    seq = _run_a(model, "interleaved", backend=backend)
    tokens = list(PROMPT_A)
    for token, entry in zip(seq.outputs, seq.logprobs, strict=True):
        logits = dense_last_logits(model, tokens)
        assert token == int(logits.argmax())
        expected = torch.log_softmax(logits, -1)[token].item()
        assert abs(entry.logprob - expected) < 1e-5
        tokens.append(token)


def test_seeded_sampling_same_alone_and_interleaved() -> None:
    model = _model(2)
    params = SamplingParams(temperature=1.5, seed=1234, max_tokens=64)
    alone = _run_a(model, "whole", params)
    crowded = _run_a(model, "interleaved", params)
    assert alone.outputs == crowded.outputs


def test_non_final_chunks_sample_nothing() -> None:
    model = _model()
    driver = _Driver(_runner(model), seed=3)
    driver.add("a", PROMPT_A, GREEDY)
    driver.step([("a", 10)])
    assert driver.seqs["a"].outputs == []
    output = driver.runner.execute(SchedulerOutput([]))
    assert output.sampled_token_ids == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_real_llama_through_runner_matches_dense(backend: str) -> None:
    spec = llama.ModelSpec(
        architecture="LlamaForCausalLM",
        num_layers=2,
        hidden_size=48,
        num_heads=6,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=VOCAB,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        tie_word_embeddings=False,
        attention_bias=False,
        max_position_embeddings=128,
    )
    torch.manual_seed(4)
    model = llama.LlamaForCausalLM(spec).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    whole = _run_a(model, "whole", backend=backend)
    interleaved = _run_a(model, "interleaved", backend=backend)
    assert interleaved.outputs == whole.outputs
    tokens = list(PROMPT_A)
    for token, entry in zip(interleaved.outputs, interleaved.logprobs, strict=True):
        logits = dense_last_logits(model, tokens)
        assert token == int(logits.argmax())
        assert abs(entry.logprob - torch.log_softmax(logits, -1)[token].item()) < 1e-4
        tokens.append(token)


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_bf16_kv_cache_with_fp32_model_stays_close(backend: str) -> None:
    model = _model()
    driver = _Driver(_runner(model, kv_dtype=torch.bfloat16, attention_backend=backend), seed=5)
    driver.add("a", PROMPT_A, SamplingParams(temperature=0.0, logprobs=5))
    for size in (13, 24):
        driver.step([("a", size)])
    driver.decode(["a"], 2)
    seq = driver.seqs["a"]
    tokens = list(PROMPT_A)
    for token, entry in zip(seq.outputs, seq.logprobs, strict=True):
        expected = torch.log_softmax(dense_last_logits(model, tokens), -1)
        assert abs(entry.logprob - expected[token].item()) < 0.05
        tokens.append(token)
