"""`Worker.from_config` on CPU, and the dummy step it profiles on CUDA (run here on CPU: the
step must be valid for the model whatever the knobs)."""

from __future__ import annotations

import pytest
import torch

from batchinfer import native
from batchinfer.core.config import EngineConfig
from batchinfer.models import hardware
from batchinfer.models.loader import locate_checkpoint
from batchinfer.runner.worker import Worker, _resolve_dtype, dummy_step, model_max_len
from tests.tiny_models import make_tiny_llama


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> Worker:
    folder = make_tiny_llama(tmp_path_factory.mktemp("worker"))  # 512 positions
    config = EngineConfig.from_kwargs(model=str(folder), dtype="float32",
                                      kv_cache_memory=16 << 20, max_num_seqs=8)
    return Worker.from_config(config)


def test_worker_sizes_the_cache_from_the_budget(worker: Worker) -> None:
    # 2 layers x K and V x 16 tokens x 2 KV heads x 16 dims x 4 bytes = 8 KiB per block.
    assert worker.num_blocks == (16 << 20) // (8 << 10)
    assert worker.max_model_len == 512  # the model's limit, below the cache's capacity
    assert worker.activation_bytes is None  # profiled on CUDA only


@pytest.mark.parametrize(("num_tokens", "max_num_seqs"), [(2048, 8), (2048, 1), (300, 64), (7, 3)])
def test_dummy_step_runs_within_the_model(worker: Worker, num_tokens: int, max_num_seqs: int):
    max_len = model_max_len(worker.spec)
    step = dummy_step(num_tokens, max_num_seqs, 16, max_len)
    sequences = step.sequences
    assert 1 <= len(sequences) <= max_num_seqs
    assert all(s.num_computed_tokens + s.num_tokens <= max_len for s in sequences)
    assert sum(s.num_tokens for s in sequences) == min(num_tokens, len(sequences) * (max_len - 1))
    # The longest chunk reads a cached context (the later-chunk path), not just its own K/V.
    assert sequences[0].num_computed_tokens > 0
    blocks = [b for s in sequences for b in s.block_table]
    assert len(blocks) == len(set(blocks)) <= worker.num_blocks
    output = worker.runner.execute(step)
    assert len(output.sampled_token_ids) == len(sequences)
    assert all(t is not None for t in output.sampled_token_ids)
    assert output.logprobs is not None and all(len(lp.top) == 20 for lp in output.logprobs)


@pytest.mark.skipif(native.library() is None, reason="the native kernels cannot be built here")
def test_auto_dtype_is_float32_where_quantized_weights_run_natively(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """On a CPU with fast bfloat16, `dtype auto` is bfloat16 for float weights but float32 for
    quantized ones (their native kernels take float32 activations): a quantization asked
    for, or `auto` on a checkpoint stored quantized (the embedded Q4_1 GGUF)."""
    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: True)
    folder = str(make_tiny_llama(tmp_path))
    cpu = torch.device("cpu")

    def dtype(**knobs: object) -> torch.dtype:
        config = EngineConfig(**knobs)
        return _resolve_dtype(config, cpu, locate_checkpoint(config.model).stored)

    assert dtype(model=folder) == torch.bfloat16  # float weights, auto: kept float
    assert dtype(model=folder, quantization="none") == torch.bfloat16
    for form in ("q4", "q8", "int8"):
        assert dtype(model=folder, quantization=form) == torch.float32
    assert dtype(model="default") == torch.float32  # stored as Q4_1: kept q4
    assert dtype(model="default", quantization="none") == torch.bfloat16
    assert dtype(model="default", dtype="bfloat16") == torch.bfloat16  # asked for
