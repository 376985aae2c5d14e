"""Speculative decoding on a tiny random model: the tokens are the model's own.

Greedy outputs (and seeded ones, where the proposals are deterministic) equal those of plain
decoding for every proposer, on the portable SDPA backend and the default CPU one, under
preemption by recompute and by swap and with prefix caching; the acceptance rule keeps the
target's distribution (checked directly on the rule, chi-square over many seeds); the native
decode step runs verification rows (one sequence's successive positions) as the torch model
does.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from batchinfer import LLM, SamplingParams, native
from batchinfer.core.outputs import ScheduledSequence, SchedulerOutput
from batchinfer.models.loader import load_model
from batchinfer.runner.input_batch import prepare_inputs
from batchinfer.runner.model_runner import ModelRunner
from batchinfer.runner.native_decode import NativeDecoder
from batchinfer.runner.sampler import Sampler
from batchinfer.runner.speculative.verify import Proposal, accept, rows_of
from tests.tiny_models import make_tiny_llama

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
ENGINE = {"dtype": "float32", "kv_cache_memory": 16 << 20}
NGRAM = {"speculative_method": "ngram", "speculative_depth": 3, "prompt_lookup_min": 1}
SELF_Q4 = {"speculative_method": "draft", "speculative_model": "self-q4", "speculative_depth": 3}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(make_tiny_llama(tmp_path_factory.mktemp("spec")))


@pytest.fixture(scope="module")
def plain(model_dir) -> LLM:
    return LLM(model_dir, **ENGINE)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a span of their own (something for prompt lookup to find), some
    sharing a prefix with the first (something for the prefix cache)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        span = [rng.randrange(3, 300) for _ in range(rng.randint(4, 12))]
        body = [rng.randrange(3, 300) for _ in range(rng.randint(3, 40))] + span + span[:3]
        out.append(out[0][:20] + body if i % 3 == 1 else body)
    return out


def tokens(llm: LLM, batch: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]


def spec_stats(llm: LLM):
    return llm.engine.core.scheduler.speculation.stats


@pytest.mark.parametrize("backend", ["sdpa", "auto"])
@pytest.mark.parametrize("method", ["ngram", "self-q4", "draft-path"])
def test_greedy_outputs_equal_plain_decoding(model_dir, plain, backend, method):
    knobs = {"ngram": NGRAM, "self-q4": SELF_Q4,
             "draft-path": {**SELF_Q4, "speculative_model": model_dir}}[method]
    batch = prompts(10, seed=1)
    want = tokens(plain, batch)
    spec = LLM(model_dir, **ENGINE, attention_backend=backend, **knobs)
    assert tokens(spec, batch) == want
    stats = spec_stats(spec)
    assert stats.num_accepted_tokens > 0
    if method == "draft-path":  # the model itself drafts: everything is accepted
        assert stats.num_accepted_tokens == stats.num_draft_tokens


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("knobs", [NGRAM, SELF_Q4], ids=["ngram", "self-q4"])
def test_greedy_outputs_equal_under_preemption_and_prefix_caching(model_dir, plain, mode,
                                                                  knobs):
    batch = prompts(16, seed=2)
    want = tokens(plain, batch)
    # 14 blocks of 16 tokens (half each for the draft model's cache) for 16 prompts of up to
    # ~90 tokens: requests are preempted, some prompts share their first block.
    draft = knobs is SELF_Q4
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers x K,V x tokens x kv heads x head dim x 4
    tight = LLM(model_dir, dtype="float32", max_num_batched_tokens=48, preemption_mode=mode,
                kv_cache_memory=14 * block_bytes * (2 if draft else 1), **knobs)
    assert tokens(tight, batch) == want
    core = tight.engine.core.scheduler
    assert core.num_preemptions_total > 0 and core.prefix_cache_hits > 0
    assert spec_stats(tight).num_accepted_tokens > 0


def test_auto_depth_outputs_equal_plain_decoding(model_dir, plain):
    batch = prompts(6, seed=3)
    spec = LLM(model_dir, **ENGINE, speculative_method="draft", speculative_model=model_dir)
    assert tokens(spec, batch) == tokens(plain, batch)
    assert spec.engine.worker.step_costs is not None


def test_seeded_sampling_with_prompt_lookup_draws_what_plain_decoding_draws(model_dir, plain):
    """One-hot proposals are verified by drawing the target's token as plain decoding would:
    the same tokens, sampled or greedy, with the same logprobs and n > 1."""
    batch = prompts(6, seed=4)
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=7, n=2,
                            logprobs=2, ignore_eos=True)
    spec = LLM(model_dir, **ENGINE, **NGRAM)
    ours = spec.generate(batch, params, use_tqdm=False)
    theirs = plain.generate(batch, params, use_tqdm=False)
    for a, b in zip(ours, theirs, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.token_ids == y.token_ids
            assert [e.token_id for e in x.logprobs] == x.token_ids
            for e, f in zip(x.logprobs, y.logprobs, strict=True):
                assert e.logprob == pytest.approx(f.logprob, abs=1e-4)
                assert [t for t, _ in e.top] == [t for t, _ in f.top]
    assert spec_stats(spec).num_accepted_tokens > 0


def test_seeded_sampling_with_a_draft_model_reproduces(model_dir):
    batch = prompts(4, seed=5)
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True)
    runs = [tokens(LLM(model_dir, **ENGINE, **SELF_Q4), batch, params) for _ in range(2)]
    assert runs[0] == runs[1]


def test_stop_strings_end_where_plain_decoding_ends(model_dir, plain):
    batch = prompts(8, seed=6)
    text = [o.outputs[0].text for o in plain.generate(batch, GREEDY, use_tqdm=False)]
    spec = LLM(model_dir, **ENGINE, **{**SELF_Q4, "speculative_model": model_dir})
    for prompt, full in zip(batch, text, strict=True):
        stop = full[len(full) // 2 : len(full) // 2 + 2]
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
        (want,) = plain.generate([prompt], params, use_tqdm=False)
        (got,) = spec.generate([prompt], params, use_tqdm=False)
        assert got.outputs[0].text == want.outputs[0].text
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].finish_reason == want.outputs[0].finish_reason == "stop"


def test_penalties_and_grammars_beside_proposals(model_dir, plain):
    """Penalties see each verification row's history (the proposals before it); a
    grammar-constrained request proposes nothing and decodes as it would alone."""
    from batchinfer.core.structured_output import StructuredOutput

    batch = prompts(4, seed=7)
    penalised = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                               repetition_penalty=1.5, frequency_penalty=2.0,
                               presence_penalty=2.0, min_tokens=20)
    constrained = SamplingParams(max_tokens=12, temperature=0,
                                 structured_output=StructuredOutput(regex="[a-z ]+"))
    spec = LLM(model_dir, **ENGINE, **{**SELF_Q4, "speculative_model": model_dir})
    want = tokens(plain, batch, penalised)
    assert want != tokens(plain, batch)  # the penalties change the tokens
    assert tokens(spec, batch, penalised) == want
    mixed = [*batch, batch[0]]
    params = [GREEDY] * len(batch) + [constrained]
    ours = spec.generate(mixed, params, use_tqdm=False)
    theirs = plain.generate(mixed, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]
    assert ours[-1].outputs[0].token_ids and all(c.isalpha() or c == " "
                                                 for c in ours[-1].outputs[0].text)


def test_verification_rows_are_the_next_tokens_after_the_proposals_before_them():
    history = [3, 1, 4, 1, 5, 9]
    seq = ScheduledSequence("r", [9], 5, [0, 1], True, GREEDY, 3, all_token_ids=history,
                            sample_index=3)
    rows = rows_of(seq, [2, 6, 5])
    assert [r.token_ids for r in rows] == [[9], [2], [6], [5]]
    assert [r.num_computed_tokens for r in rows] == [5, 6, 7, 8]
    assert [r.sample_index for r in rows] == [3, 4, 5, 6]
    assert [r.all_token_ids for r in rows] == [history, [*history, 2], [*history, 2, 6],
                                               [*history, 2, 6, 5]]
    assert all(r.sample and r.block_table == [0, 1] for r in rows)


# ----------------------------------------------------------------- the acceptance rule
def _chi_square_p(counts: list[int], probs: list[float]) -> float:
    """The p-value of the counts under the distribution (chi-square, len - 1 degrees)."""
    total = sum(counts)
    stat = sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True))
    dof = len(counts) - 1
    # Wilson-Hilferty: chi2 / dof is nearly normal after a cube root.
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("deterministic", [False, True], ids=["draft-q", "one-hot"])
def test_accepted_tokens_follow_the_target_distribution(deterministic):
    """Two proposed positions with their own target (p) and draft (q) distributions: the
    first emitted token follows p0, and given an accepted first token, the second follows
    p1, whatever q proposes (chi-square over 4000 seeded draws: deterministic)."""
    vocab, draws = 6, 4000
    g = torch.Generator().manual_seed(0)
    p_logits = torch.randn(3, vocab, generator=g) * 1.5
    q = torch.softmax(torch.randn(2, vocab, generator=g) * 1.5, dim=-1)
    p = torch.softmax(p_logits, dim=-1)
    sampler = Sampler(torch.device("cpu"), 0, [])
    if deterministic:
        proposals = [Proposal([int(q[0].argmax()), int(q[1].argmax())])] * draws
    else:
        drawn_q = torch.multinomial(q, draws, replacement=True,
                                    generator=torch.Generator().manual_seed(1))  # [2, draws]
        proposals = [Proposal(drawn_q[:, i].tolist(), q) for i in range(draws)]
    rows = [row for seed in range(draws) for row in rows_of(ScheduledSequence(
        "r", [5], 10, [0], True, SamplingParams(temperature=1.0, seed=seed, max_tokens=3), 10),
        [0, 0])]
    logits = p_logits.repeat(draws, 1)
    _, drawn, _ = sampler.pick(logits, rows)
    first, second = [0] * vocab, [0] * vocab
    num_accepted_first = 0
    for i, proposal in enumerate(proposals):
        num_accepted, last = accept(sampler, logits, rows, [3 * i, 3 * i + 1, 3 * i + 2],
                                    proposal, drawn)
        emitted = [*proposal.token_ids[:num_accepted], last]
        first[emitted[0]] += 1
        if num_accepted >= 1:
            num_accepted_first += 1
            second[emitted[1]] += 1
    assert _chi_square_p(first, p[0].tolist()) > 1e-3
    assert _chi_square_p(second, p[1].tolist()) > 1e-3
    # ...and proposals are accepted as often as the rule says: sum(min(p, q)) (one-hot:
    # p(proposal)).
    expected = float(p[0, int(q[0].argmax())]) if deterministic else float(
        torch.minimum(p[0], q[0]).sum())
    assert num_accepted_first / draws == pytest.approx(expected, abs=0.03)


def test_the_rule_rejects_what_the_target_cannot_produce():
    """A proposal the target gives probability 0 (outside its top-k) is never accepted."""
    sampler = Sampler(torch.device("cpu"), 0, [])
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [3.0, 2.0, 1.0, 0.0]])
    q = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    for seed in range(200):
        params = SamplingParams(temperature=1.0, top_k=2, seed=seed, max_tokens=2)
        rows = rows_of(ScheduledSequence("r", [5], 4, [0], True, params, 4), [3])
        work = logits.clone()
        _, drawn, _ = sampler.pick(work, rows)
        num_accepted, last = accept(sampler, work, rows, [0, 1], Proposal([3], q), drawn)
        assert num_accepted == 0 and last in (0, 1)


# ----------------------------------------------------------------- native verification rows
@pytest.mark.skipif(native.library() is None, reason="the native kernels cannot be built here")
@pytest.mark.parametrize("quantization", ["none", "q4"])
def test_native_decode_steps_run_verification_rows_as_the_torch_model(tmp_path, quantization):
    """Five successive positions of one sequence (and another sequence) in one native step,
    each row attending to the rows before it: the torch model's logits and cache."""
    loaded = load_model(str(make_tiny_llama(tmp_path)), torch.float32, torch.device("cpu"))
    kernels = "dense" if quantization == "none" else "q4_native"
    loaded.model.choose_linear_kernels(quantization, kernels, torch.device("cpu"),
                                       torch.float32, None, allow_packed=False,
                                       native_decode=True)
    runner = ModelRunner(loaded.model, loaded.spec, 64, 16, "cpu", torch.float32, [2], 0)
    decoder, why = NativeDecoder.build(loaded.model, runner.attention)
    assert decoder is not None, why
    params = SamplingParams(max_tokens=8, temperature=0)
    rng = random.Random(0)
    contexts = {"a": [rng.randrange(300) for _ in range(140)],
                "b": [rng.randrange(300) for _ in range(33)]}
    tables = {"a": list(range(0, 16)), "b": list(range(16, 32))}
    with torch.inference_mode():
        runner.execute(SchedulerOutput([
            ScheduledSequence(rid, tokens, 0, tables[rid], True, params, len(tokens))
            for rid, tokens in contexts.items()]))
        last = ScheduledSequence("a", [7], 140, tables["a"], True, params, 140)
        rows = [*rows_of(last, [11, 13, 17, 19]),
                ScheduledSequence("b", [23], 33, tables["b"], True, params, 33)]
        inputs = prepare_inputs(rows, 16, torch.device("cpu"))
        assert decoder.accepts(inputs)
        got = decoder.logits(inputs, shared_rows=True)[inputs.logits_indices].clone()
        native_cache = runner.attention.kv_cache.clone()
        want = runner._torch_logits(inputs)
    tolerance = 1e-5 if quantization == "none" else 1e-3
    assert float((got - want).abs().max() / want.abs().max()) < tolerance
    cache = runner.attention.kv_cache  # relative to its largest value, as the logits
    assert float((native_cache - cache).abs().max() / cache.abs().max()) < tolerance
