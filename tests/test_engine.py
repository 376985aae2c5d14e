"""LLM.generate on tiny random models: exact against Hugging Face, invariant under batching."""

from __future__ import annotations

import random

import pytest
import torch

from batchinfer import LLM, SamplingParams
from tests.tiny_models import make_tiny_llama

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama"), arch="llama")


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), dtype="float32", kv_cache_memory=64 << 20)


def random_prompts(n: int, vocab: int, seed: int = 0, low: int = 3, high: int = 100):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(low, high))] for _ in range(n)]


def hf_greedy(model_dir, prompts, max_new_tokens):
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: always max_new_tokens
    config = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0
    )
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            results.append(out[0, len(prompt) :].tolist())
    return results


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_equals_hugging_face_generate(tmp_path, arch):
    model_dir = make_tiny_llama(tmp_path, arch=arch)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=32 << 20)
    prompts = random_prompts(4, llm.engine.processor.vocab_size, seed=1, high=40)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert ours == hf_greedy(model_dir, prompts, GREEDY.max_tokens)


def test_same_output_alone_batched_chunked_and_preempted(llama_dir, llm):
    prompts = random_prompts(31, llm.engine.processor.vocab_size, seed=2)
    alone = llm.generate([prompts[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert batched[0] == alone
    chunked = LLM(str(llama_dir), dtype="float32", max_num_batched_tokens=16)
    assert [
        o.outputs[0].token_ids for o in chunked.generate(prompts, GREEDY, use_tqdm=False)
    ] == batched
    # 12 blocks of 16 tokens cannot hold 31 prompts of up to 100 tokens at once.
    tight = LLM(str(llama_dir), dtype="float32", kv_cache_memory=small_cache_bytes(llm, 12))
    preempted = tight.generate(prompts, GREEDY, use_tqdm=False)
    assert tight.engine.core.scheduler.num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in preempted] == batched
    for form in ("static", "dynamic"):
        other = LLM(str(llama_dir), dtype="float32", batching=form, max_batch_size=8)
        assert [
            o.outputs[0].token_ids for o in other.generate(prompts, GREEDY, use_tqdm=False)
        ] == batched, form


def test_every_attention_backend_gives_the_same_tokens(llama_dir, llm):
    prompts = random_prompts(6, llm.engine.processor.vocab_size, seed=6)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    for backend in ("sdpa", "gather"):
        other = LLM(str(llama_dir), dtype="float32", attention_backend=backend,
                    kv_cache_memory=64 << 20, max_num_batched_tokens=64)
        got = [o.outputs[0].token_ids for o in other.generate(prompts, GREEDY, use_tqdm=False)]
        assert got == want, backend
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(str(llama_dir), attention_backend="flash")


def small_cache_bytes(llm, num_blocks: int) -> int:
    from batchinfer.runner.kv_cache import bytes_per_block

    return num_blocks * bytes_per_block(llm.engine.worker.spec, 16, torch.float32)


def test_seeded_sampling_is_independent_of_the_batch(llm):
    prompts = random_prompts(9, llm.engine.processor.vocab_size, seed=3)
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    alone = llm.generate([prompts[4]], params, use_tqdm=False)[0].outputs[0].token_ids
    unseeded = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    mixed = llm.generate(prompts, [unseeded] * 4 + [params] + [unseeded] * 4, use_tqdm=False)
    assert mixed[4].outputs[0].token_ids == alone
    other_seed = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=8, ignore_eos=True)
    assert llm.generate([prompts[4]], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_results_keep_input_order_and_shape(llm):
    prompts = random_prompts(5, llm.engine.processor.vocab_size, seed=4)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (5, 1, 9, 3, 7)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 1, 9, 3, 7]
    assert [o.prompt_token_ids for o in outs] == prompts
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert outs[2].metrics.first_token_s >= outs[2].metrics.arrival_s


def test_n_logprobs_and_stop_strings(llm):
    text_prompt = "hello world"
    base = llm.generate(
        text_prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert base.text == llm.tokenizer.decode(base.token_ids, skip_special_tokens=True)
    # Stop on a piece of the greedy text: the output is cut right before it.
    start = next(i for i in range(len(base.text) // 2, len(base.text)) if base.text[i].strip())
    stop = base.text[start : start + 3]
    cut = llm.generate(
        text_prompt,
        SamplingParams(max_tokens=12, temperature=0, stop=[stop], ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert cut.outputs[0].text == base.text[: base.text.find(stop)]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    params = SamplingParams(
        n=2, max_tokens=8, temperature=1.0, seed=11, logprobs=3, ignore_eos=True
    )
    first = llm.generate(text_prompt, params, use_tqdm=False)[0]
    again = llm.generate(text_prompt, params, use_tqdm=False)[0]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert first.outputs[0].token_ids != first.outputs[1].token_ids
    for completion in first.outputs:
        assert len(completion.logprobs) == len(completion.token_ids) == 8
        for token_id, lp in zip(completion.token_ids, completion.logprobs, strict=True):
            assert lp.token_id == token_id and len(lp.top) == 3
            assert [x[1] for x in lp.top] == sorted((x[1] for x in lp.top), reverse=True)
        total = sum(lp.logprob for lp in completion.logprobs)
        assert completion.cumulative_logprob == pytest.approx(total)


def test_chat_prompts_use_the_template(llm):
    messages = [{"role": "user", "content": "hi"}]
    out = llm.chat(messages, SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0]
    expected = llm.tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True
    )
    if hasattr(expected, "keys"):  # a BatchEncoding in recent transformers
        expected = expected["input_ids"]
    assert out.prompt_token_ids == list(expected)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_are_refused_and_nothing_is_left_queued(llm):
    too_long = [5] * (llm.engine.max_model_len + 1)
    for prompt, match in (
        ("", "empty"),
        ([], "empty"),
        (too_long, "max_model_len"),
        ([10**9], "token ids"),
    ):
        with pytest.raises(ValueError, match=match):
            llm.generate([[5, 6], prompt], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)


def test_engine_options_are_validated(llama_dir):
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(str(llama_dir), max_num_seqs=0)
    with pytest.raises(ValueError, match="batching"):
        LLM(str(llama_dir), batching="sometimes")
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(str(llama_dir), max_num_seq=3)
    with pytest.raises(ValueError, match="no such file"):
        LLM("/nonexistent/model")
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(str(llama_dir), dtype="float32", kv_cache_memory=1024)


def test_prefix_caching_gives_the_same_tokens_shared_preempted_and_n(llama_dir, llm):
    """A shared 70-token prefix: every backend of the real runner reads the shared blocks
    exactly as if each request had computed them, alone, chunked, under preemption and with
    n > 1, against the same engine with prefix caching off."""
    rng = random.Random(11)
    vocab = llm.engine.processor.vocab_size
    prefix = [rng.randrange(3, vocab) for _ in range(70)]
    prompts = [prefix + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 30))]
               for _ in range(12)]
    off = LLM(str(llama_dir), dtype="float32", kv_cache_memory=64 << 20,
              enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in off.generate(prompts, GREEDY, use_tqdm=False)]
    for knobs in ({}, {"max_num_batched_tokens": 24},
                  {"kv_cache_memory": small_cache_bytes(llm, 14)},
                  {"attention_backend": "sdpa"}, {"attention_backend": "gather"}):
        on = LLM(str(llama_dir), dtype="float32", **{"kv_cache_memory": 64 << 20, **knobs})
        first = on.generate(prompts[:1], GREEDY, use_tqdm=False)  # fills the cache
        rest = on.generate(prompts[1:], GREEDY, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in first + rest]
        assert got == want, knobs
        assert on.engine.core.scheduler.prefix_cache_hits >= 11 * 64, knobs
    n_params = SamplingParams(n=3, max_tokens=GREEDY.max_tokens, temperature=0,
                              ignore_eos=True)
    on = LLM(str(llama_dir), dtype="float32", kv_cache_memory=64 << 20)
    (out,) = on.generate([prompts[0]], n_params, use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [want[0]] * 3
    # The two copies take every full block of the prompt but the last token's from the first.
    assert on.engine.core.scheduler.prefix_cache_hits == 2 * ((len(prompts[0]) - 1) // 16 * 16)


@pytest.mark.parametrize("knobs", [
    {"preemption_mode": "swap"},
    {"preemption_mode": "swap", "attention_backend": "sdpa", "max_swap_blocks_per_step": 1},
    {"preemption_mode": "auto"},
])
def test_swap_preemption_gives_exactly_the_tokens_of_an_unpreempted_run(llama_dir, llm, knobs):
    """The real runner: requests swapped out to host memory and back (whole, or their leading
    blocks within a cap of 1 per step and the rest recomputed) produce the tokens they produce
    when never preempted. `auto` measures its costs at start-up."""
    prompts = random_prompts(31, llm.engine.processor.vocab_size, seed=2)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    tight = LLM(str(llama_dir), dtype="float32", kv_cache_memory=small_cache_bytes(llm, 12),
                swap_space=8 << 20, **knobs)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, GREEDY, use_tqdm=False)]
    scheduler = tight.engine.core.scheduler
    assert got == want
    assert scheduler.swapped_out_blocks == scheduler.swapped_in_blocks
    assert scheduler.swap_pool.num_free == scheduler.swap_pool.num_blocks
    stats = tight.engine.core.stats()
    if knobs["preemption_mode"] == "swap":
        assert scheduler.preemptions_by_mode["swap"] > 0 and stats.swap_time_s > 0
    if "max_swap_blocks_per_step" in knobs:
        assert scheduler.recomputed_tokens > 0  # past the cap
    if knobs["preemption_mode"] == "auto":
        costs = tight.engine.worker.preemption_costs
        assert costs is not None and costs.prefill_s_per_token > 0 and costs.swap_s_per_block > 0
        assert scheduler.num_preemptions_total > 0


def test_swap_space_too_small_for_a_block_names_the_knob(llama_dir):
    with pytest.raises(ValueError, match="swap_space"):
        LLM(str(llama_dir), dtype="float32", preemption_mode="swap", swap_space=1024)


def test_fp8_kv_cache_holds_four_times_the_tokens_and_serves(llama_dir):
    """Same `kv_cache_memory`: an FP8 cache holds 4x the tokens of a float32 one; generation
    runs on it (every backend that takes FP8), and `calculate_kv_scales` sets per-layer scales
    from the first step (the calibrated run agrees with float32 at least as often as the
    uncalibrated one on this model; tokens agree exactly only as far as FP8 rounding allows,
    measured on the embedded model in benchmarks/kv_fp8.py)."""
    memory = 4 << 20
    fp32 = LLM(str(llama_dir), dtype="float32", kv_cache_memory=memory)
    prompts = random_prompts(6, fp32.engine.processor.vocab_size, seed=21, high=60)
    want = [o.outputs[0].token_ids for o in fp32.generate(prompts, GREEDY, use_tqdm=False)]
    for kv_dtype in ("fp8_e4m3", "fp8_e5m2"):
        for backend in ("gather", "sdpa"):
            llm = LLM(str(llama_dir), dtype="float32", kv_cache_memory=memory,
                      kv_cache_dtype=kv_dtype, attention_backend=backend,
                      calculate_kv_scales=True)
            assert llm.engine.worker.num_blocks == 4 * fp32.engine.worker.num_blocks
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
            assert [len(g) for g in got] == [len(w) for w in want]
            assert all(g[0] == w[0] for g, w in zip(got, want, strict=True))  # first token:
            # from the prompt's own K/V at model precision
            scales = llm.engine.worker.runner.attention.kv_scales
            assert all(0 < k < 1 and 0 < v < 1 for k, v in scales), scales
    with pytest.raises(ValueError, match="calculate_kv_scales"):
        LLM(str(llama_dir), calculate_kv_scales=True)
