"""Sampler: greedy, filters, penalties, min_tokens, seeded reproducibility, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from batchinfer.core.outputs import ScheduledSequence
from batchinfer.core.sampling_params import SamplingParams
from batchinfer.runner.sampler import Sampler, apply_penalties

CPU = torch.device("cpu")
EOS = 3


def _seq(
    params: SamplingParams,
    all_token_ids: list[int] | None = None,
    num_prompt_tokens: int = 1,
    sample_index: int = 0,
) -> ScheduledSequence:
    return ScheduledSequence(
        request_id="r",
        token_ids=[0],
        num_computed_tokens=0,
        block_table=[0],
        sample=True,
        sampling_params=params,
        num_prompt_tokens=num_prompt_tokens,
        all_token_ids=all_token_ids if all_token_ids is not None else [0],
        sample_index=sample_index,
    )


def _sampler(seed: int = 0) -> Sampler:
    return Sampler(CPU, seed=seed, eos_token_ids=[EOS])


def _counts(tokens: list[int], vocab_size: int) -> list[int]:
    return [tokens.count(t) for t in range(vocab_size)]


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    expected = logits.argmax(-1).tolist()
    out = _sampler()(logits.clone(), [_seq(SamplingParams(temperature=0.0))] * 6)
    assert out.token_ids == expected and out.logprobs is None


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=2.0, top_k=1, top_p=0.5),
        SamplingParams(temperature=1.0, min_p=1.0),
    ],
)
def test_degenerate_filters_are_greedy(params: SamplingParams) -> None:
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1))
    expected = logits.argmax(-1).tolist()
    assert _sampler()(logits.clone(), [_seq(params)] * 64).token_ids == expected


def _draw(params: SamplingParams, probs: list[float], num_draws: int) -> list[int]:
    """Tokens of `num_draws` rows with the same logits `log(probs)`, in one batched call."""
    logits = torch.tensor(probs).log().repeat(num_draws, 1)
    return _sampler(seed=123)(logits, [_seq(params)] * num_draws).token_ids


def _chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True))


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_random_sampling_follows_softmax(temperature: float) -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    counts = _counts(_draw(SamplingParams(temperature=temperature), probs, 20000), 4)
    tempered = [p ** (1 / temperature) for p in probs]
    expected = [p / sum(tempered) for p in tempered]
    # df = 3: P(chi2 > 16.3) = 0.001 for a correct sampler; a wrong temperature is far above.
    assert _chi_square(counts, expected) < 16.3, counts


def test_top_k_top_p_min_p_restrict_support() -> None:
    probs = [0.4, 0.3, 0.2, 0.1]
    top_k = _counts(_draw(SamplingParams(top_k=2), probs, 4000), 4)
    assert top_k[2] == top_k[3] == 0 and min(top_k[:2]) > 0
    # Mass before token 2 is 0.7 >= 0.5: tokens 0 and 1 stay, renormalised to 4:3.
    top_p = _counts(_draw(SamplingParams(top_p=0.5), probs, 7000), 4)
    assert top_p[2] == top_p[3] == 0
    assert _chi_square(top_p[:2], [4 / 7, 3 / 7]) < 10.8
    # min_p 0.4: threshold 0.16 drops token 3 only.
    min_p = _counts(_draw(SamplingParams(min_p=0.4), probs, 9000), 4)
    assert min_p[3] == 0 and _chi_square(min_p[:3], [4 / 9, 3 / 9, 2 / 9]) < 13.8


def test_penalties_match_hand_computation() -> None:
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    # prompt [0, 1], output [2, 2, 3]; token 4 never seen.
    seq = _seq(params, all_token_ids=[0, 1, 2, 2, 3], num_prompt_tokens=2)
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0], [2.0, -1.0, 0.5, -0.5, 1.0]])
    apply_penalties(logits, [seq, _seq(SamplingParams())])
    expected = [
        2.0 / 2,  # prompt only: repetition divides a positive logit, no frequency/presence
        -1.0 * 2,  # prompt only: repetition multiplies a negative logit
        0.5 / 2 - 0.5 * 2 - 0.25,  # output twice
        -0.5 * 2 - 0.5 * 1 - 0.25,  # output once
        1.0,  # unseen
    ]
    torch.testing.assert_close(logits[0], torch.tensor(expected))
    torch.testing.assert_close(logits[1], torch.tensor([2.0, -1.0, 0.5, -0.5, 1.0]))


def test_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.5, 0.0]])
    seq = _seq(SamplingParams(temperature=0.0, frequency_penalty=1.0), [0, 1], 1, sample_index=1)
    assert _sampler()(logits, [seq]).token_ids == [2]


def test_min_tokens_masks_eos_and_stop_tokens() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 5.0, 4.0]]).repeat(4, 1)
    greedy = dict(temperature=0.0, min_tokens=2, stop_token_ids=[4])
    sequences = [
        _seq(SamplingParams(**greedy), sample_index=0),  # EOS and stop token 4 masked
        _seq(SamplingParams(**greedy), sample_index=1),  # still short of min_tokens
        _seq(SamplingParams(**greedy), sample_index=2),  # reached: EOS allowed again
        _seq(SamplingParams(**greedy, ignore_eos=True), sample_index=0),  # EOS is no stop
    ]
    assert _sampler()(logits, sequences).token_ids == [2, 2, EOS, EOS]


def test_seeded_rows_ignore_batch_and_row_position() -> None:
    vocab = torch.randn(1000, generator=torch.Generator().manual_seed(5))
    seeded = SamplingParams(temperature=1.0, seed=42)

    def run(batch: list[SamplingParams], row: int, sampler_seed: int, first: int = 0) -> list[int]:
        tokens = []
        sampler = Sampler(CPU, seed=sampler_seed, eos_token_ids=[EOS])
        for index in range(first, 8):
            sequences = [_seq(p, sample_index=index) for p in batch]
            logits = vocab.repeat(len(batch), 1) + torch.randn(len(batch), 1000)
            logits[row] = vocab
            tokens.append(sampler(logits, sequences).token_ids[row])
        return tokens

    alone = run([seeded], 0, sampler_seed=0)
    other = SamplingParams(temperature=0.7, top_k=50)
    crowded = run([other, SamplingParams(seed=7), seeded, other], 2, sampler_seed=9)
    assert alone == crowded
    assert len(set(alone)) > 1  # each sample_index draws fresh noise
    # Resuming at sample_index 5 (as after a preemption) replays the same draws.
    assert run([other, seeded], 1, sampler_seed=3, first=5) == alone[5:]
    assert run([seeded], 0, sampler_seed=0) == alone
    assert run([SamplingParams(temperature=1.0, seed=43)], 0, sampler_seed=0) != alone


def test_logprobs_are_raw_sorted_and_ranked() -> None:
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(3))
    raw = torch.log_softmax(logits, dim=-1)
    sequences = [
        _seq(SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=1.5), [7, 8], 2),
        _seq(SamplingParams(temperature=0.0)),
        _seq(SamplingParams(temperature=1.0, logprobs=0)),
    ]
    out = _sampler()(logits.clone(), sequences)
    assert out.logprobs is not None and out.logprobs[1] is None
    first, third = out.logprobs[0], out.logprobs[2]
    assert first is not None and third is not None
    assert [t for t, _ in first.top] == raw[0].argsort(descending=True)[:5].tolist()
    values = [lp for _, lp in first.top]
    assert values == sorted(values, reverse=True)
    for token, lp in first.top:
        assert math.isclose(lp, raw[0, token].item(), abs_tol=1e-6)
    for row, entry in ((0, first), (2, third)):
        assert entry.token_id == out.token_ids[row]
        assert math.isclose(entry.logprob, raw[row, entry.token_id].item(), abs_tol=1e-6)
        assert entry.rank == int((raw[row] > raw[row, entry.token_id]).sum()) + 1
    assert third.top == []
