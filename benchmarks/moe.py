"""Mixture-of-experts decode step: experts grouped by expert against a per-token loop.

    .venv/bin/python benchmarks/moe.py                       # float32, then q4 experts
    .venv/bin/python benchmarks/moe.py --weights none --experts 128 --threads 1

Builds a random Qwen3-MoE from transformers' config class (`--layers` layers of `--experts`
SwiGLU experts of `--moe-intermediate`, `--top-k` per token, hidden `--hidden`; nothing is
downloaded), loads it as the engine does (kernels `auto` for `--weights`, measured or cached),
and runs one decode step of `--seqs` sequences over `--context`-token contexts through the
`ModelRunner`. Then, on the inputs each MoE block saw in that step:

- **reads**: forward hooks on every expert's down projection count its products per block
  per step in the grouped path (`qwen3_moe.MoE`: each chosen expert runs once, over all its
  rows), against the per-token loop's (one per (token, expert) pair);
- **time**: the blocks' grouped forward and the per-token loop (`per_token` below: the same
  experts, routed the same way, one row at a time), alternating, `--repeats` times each:
  median milliseconds per step, for the MoE blocks alone and for the whole decode step (the
  runner's step with every block's forward swapped for the loop).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3MoeConfig

from batchinfer import LLM
from batchinfer.core.cpu import cpu_model
from batchinfer.core.outputs import ScheduledSequence, SchedulerOutput
from batchinfer.core.sampling_params import SamplingParams
from batchinfer.models.qwen3_moe import MoE


def make_model(folder: Path, args: argparse.Namespace) -> Path:
    config = Qwen3MoeConfig(
        vocab_size=2048, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.moe_intermediate, num_experts=args.experts,
        num_experts_per_tok=args.top_k, norm_topk_prob=True, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 128),
        head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.05) if param.dim() > 1 else param.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="t1").save_pretrained(folder)
    return folder


def per_token(moe: MoE, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The same block token by token: every (token, expert) pair runs the expert on one row."""
    weights, experts = moe.gate(x)
    for token in range(x.shape[0]):
        for weight, expert in zip(weights[token], experts[token].tolist(), strict=True):
            mlp = moe.experts[expert]
            residual[token] += weight * mlp.down_proj(mlp.hidden(x[token : token + 1]))[0]
    return residual


def decode_step(seqs: int, context: int, block_size: int) -> tuple[SchedulerOutput,
                                                                     SchedulerOutput]:
    """(the prefill that writes the contexts, the decode step after it)."""
    per_seq = -(-(context + 1) // block_size)
    params = SamplingParams(max_tokens=1, temperature=0)
    prefill, decode = [], []
    for i in range(seqs):
        table = list(range(i * per_seq, (i + 1) * per_seq))
        tokens = [(7 * i + j) % 2000 + 2 for j in range(context)]
        prefill.append(ScheduledSequence(f"s{i}", tokens, 0, table, True, params, context))
        decode.append(ScheduledSequence(f"s{i}", [(11 * i) % 2000 + 2], context, table, True,
                                        params, context))
    return SchedulerOutput(prefill), SchedulerOutput(decode)


def median_ms(run: Callable[[], object], repeats: int) -> float:
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        run()
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def bench(form: str, folder: Path, args: argparse.Namespace) -> None:
    llm = LLM(str(folder), dtype="float32", quantization=form, kv_cache_memory="512M",
              block_size=16, enable_prefix_caching=False, num_threads=torch.get_num_threads())
    runner = llm.engine.worker.runner
    blocks = [layer.mlp for layer in llm.engine.worker.model.layers]
    assert all(isinstance(b, MoE) for b in blocks)
    prefill, step = decode_step(args.seqs, args.context, 16)
    inputs: dict[int, torch.Tensor] = {}
    calls: Counter[tuple[int, int]] = Counter()
    for index, block in enumerate(blocks):
        block.register_forward_pre_hook(
            lambda module, args_, i=index: inputs.__setitem__(i, args_[0].clone()))
        for expert, mlp in enumerate(block.experts):
            mlp.down_proj.register_forward_pre_hook(
                lambda module, args_, key=(index, expert): calls.update([key]))
    with torch.inference_mode():
        runner.execute(prefill)
        calls.clear()
        runner.execute(step)
        grouped_calls, most = sum(calls.values()), max(calls.values())
        hidden = inputs[0].shape[1]

        def grouped_blocks() -> None:
            for i, block in enumerate(blocks):
                block(inputs[i], torch.zeros(args.seqs, hidden))

        def looped_blocks() -> None:
            for i, block in enumerate(blocks):
                per_token(block, inputs[i], torch.zeros(args.seqs, hidden))

        def whole_step(loop: bool) -> Callable[[], object]:
            def run() -> object:
                if loop:  # every block's forward swapped for the loop, for this step only
                    for block in blocks:
                        block.forward = lambda x, r, b=block: per_token(b, x, r)
                try:
                    return runner.execute(step)
                finally:
                    for block in blocks:
                        block.__dict__.pop("forward", None)
            return run

        times: dict[str, list[float]] = {k: [] for k in ("blocks", "loop", "step", "step loop")}
        for _ in range(args.rounds):
            times["blocks"].append(median_ms(grouped_blocks, args.repeats))
            times["loop"].append(median_ms(looped_blocks, args.repeats))
            times["step"].append(median_ms(whole_step(False), args.repeats))
            times["step loop"].append(median_ms(whole_step(True), args.repeats))
    ms = {k: statistics.median(v) for k, v in times.items()}
    pairs = args.seqs * args.top_k * len(blocks)
    print(f"{form:8}{grouped_calls:>9}{most:>6}{pairs:>10}"
          f"{ms['blocks']:>11.2f}{ms['loop']:>10.2f}{ms['loop'] / ms['blocks']:>8.1f}x"
          f"{ms['step']:>10.2f}{ms['step loop']:>10.2f}{ms['step loop'] / ms['step']:>8.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="none,q4", help="--quantization forms")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--moe-intermediate", type=int, default=256)
    parser.add_argument("--seqs", type=int, default=32, help="sequences in the decode step")
    parser.add_argument("--context", type=int, default=64, help="tokens in each context")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per median")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: "
                        "torch's); on a loaded machine 1 keeps OpenMP from waiting on threads "
                        "the scheduler took away")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.layers} layers of {args.experts} experts ({args.hidden} -> "
          f"{args.moe_intermediate}), {args.top_k} per token; a decode step of {args.seqs} "
          f"sequences at {args.context} tokens; medians of {args.rounds} rounds of "
          f"{args.repeats}")
    print(f"{'weights':8}{'products':>9}{'max':>6}{'per-token':>10}{'MoE ms':>11}"
          f"{'loop ms':>10}{'ratio':>9}{'step ms':>10}{'loop ms':>10}{'ratio':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_model(Path(tmp) / "moe", args)
        for form in args.weights.split(","):
            bench(form, folder, args)
    print("products: expert products in the grouped step (all layers); max: the most any "
          "expert ran in one layer's block; per-token: the loop's products (one per pair)")


if __name__ == "__main__":
    main()
