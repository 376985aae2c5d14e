"""Sampler numerics: no parameters the API accepts yield an id outside [0, vocab) or a NaN logprob,
tiny temperatures are greedy, and a row's neighbours in the batch never change its token."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchinfer.core.sampling_params import MIN_SAMPLING_TEMPERATURE, SamplingParams
from batchinfer.runner.sampler import LOGPROB_FLOOR, Sampler
from tests.test_sampler import EOS, _seq

CPU = torch.device("cpu")
VOCAB = 64

# Temperatures around the greedy threshold and the float32 limits (1e-300 is 0.0 in float32,
# 1e-40 a subnormal), besides ordinary ones.
temperatures = st.one_of(
    st.sampled_from([0.0, 1e-300, 1e-45, 1e-40, 1e-38, 1e-9, 9.99e-6, 1e-5, 1.1e-5, 1e-3, 2.0]),
    st.floats(min_value=0.0, max_value=2.0),
)
sampling_params = st.builds(
    SamplingParams,
    temperature=temperatures,
    top_p=st.one_of(st.just(1.0), st.sampled_from([1e-300, 1e-9]),
                    st.floats(min_value=1e-9, max_value=1.0)),
    top_k=st.one_of(st.just(-1), st.integers(min_value=1, max_value=VOCAB + 5)),
    min_p=st.one_of(st.just(0.0), st.floats(min_value=0.0, max_value=1.0)),
    presence_penalty=st.floats(min_value=-2.0, max_value=2.0),
    frequency_penalty=st.floats(min_value=-2.0, max_value=2.0),
    repetition_penalty=st.one_of(
        st.just(1.0), st.sampled_from([1e-300, 1e-40, 1e-9, 1e9, 1e300]),
        st.floats(min_value=1e-3, max_value=10.0)),
    seed=st.one_of(st.none(), st.integers(min_value=-(2**63), max_value=2**63 - 1)),
    logprobs=st.one_of(st.none(), st.integers(min_value=0, max_value=20)),
    min_tokens=st.integers(min_value=0, max_value=3),
    max_tokens=st.just(16),
    ignore_eos=st.booleans(),
    stop_token_ids=st.lists(st.integers(min_value=0, max_value=VOCAB - 1), max_size=3),
)
# Logits as a model may give them: ordinary, huge, all tied, or one spike.
logit_rows = st.tuples(
    st.sampled_from(["normal", "huge", "tied", "spike"]),
    st.floats(min_value=1e-3, max_value=1e30),
    st.integers(min_value=0, max_value=2**31 - 1),
)


def _logits(kind: str, scale: float, seed: int) -> torch.Tensor:
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed))
    if kind == "huge":
        return row * scale
    if kind == "tied":
        return torch.full((VOCAB,), scale)
    if kind == "spike":
        row[seed % VOCAB] = scale
    return row


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(sampling_params, logit_rows, st.integers(0, 4),
                          st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)),
                min_size=1, max_size=6),
       st.integers(min_value=0, max_value=2**32))
def test_no_accepted_parameters_yield_an_unknown_token_or_a_nan_logprob(rows, sampler_seed):
    logits = torch.stack([_logits(*row) for _, row, _, _ in rows])
    sequences = [_seq(params, all_token_ids=history, num_prompt_tokens=1, sample_index=index)
                 for params, _, index, history in rows]
    out = Sampler(CPU, seed=sampler_seed, eos_token_ids=[EOS])(logits, sequences)
    assert all(0 <= t < VOCAB for t in out.token_ids)
    for (params, *_), token, entry in zip(rows, out.token_ids, out.logprobs or [None] * len(rows),
                                          strict=True):
        if params.logprobs is None:
            assert entry is None
            continue
        assert entry is not None and entry.token_id == token
        values = [entry.logprob] + [lp for _, lp in entry.top]
        assert all(math.isfinite(v) and LOGPROB_FLOOR <= v <= 0.0 for v in values)
        assert len(entry.top) == params.logprobs


@pytest.mark.parametrize("temperature", [1e-300, 1e-40, 1e-9, 9.99e-6])
def test_temperatures_below_the_threshold_are_greedy(temperature):
    assert SamplingParams(temperature=temperature).greedy
    assert not SamplingParams(temperature=MIN_SAMPLING_TEMPERATURE).greedy
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    expected = logits.argmax(-1).tolist()
    params = SamplingParams(temperature=temperature, logprobs=1)
    out = Sampler(CPU, seed=0, eos_token_ids=[EOS])(logits.clone(), [_seq(params)] * 4)
    assert out.token_ids == expected


def test_a_row_s_token_does_not_depend_on_hostile_neighbours():
    """A seeded row and a greedy row sample the same tokens alone and beside rows whose
    parameters sit at the limits of what is accepted."""
    base = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2))
    seeded = _seq(SamplingParams(temperature=0.8, top_p=0.9, seed=11, logprobs=2))
    greedy = _seq(SamplingParams(temperature=0.0, logprobs=0))
    hostile = [
        _seq(SamplingParams(temperature=1e-300, logprobs=20)),
        _seq(SamplingParams(temperature=2.0, repetition_penalty=1e-40), all_token_ids=[1, 2, 3]),
        _seq(SamplingParams(temperature=1.5, top_k=1, min_p=1.0, frequency_penalty=-2.0),
             all_token_ids=[5, 5, 5], num_prompt_tokens=1),
    ]
    alone = Sampler(CPU, seed=0, eos_token_ids=[EOS])(base.clone(), [seeded, greedy])
    crowd_logits = torch.cat([base[:1], torch.randn(3, VOCAB) * 1e30, base[1:]])
    crowd = Sampler(CPU, seed=5, eos_token_ids=[EOS])(crowd_logits,
                                                      [seeded, *hostile, greedy])
    assert alone.token_ids == [crowd.token_ids[0], crowd.token_ids[4]]
    assert alone.logprobs is not None and crowd.logprobs is not None
    assert alone.logprobs[0] == crowd.logprobs[0] and alone.logprobs[1] == crowd.logprobs[4]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_nan_logits_fail_the_step_naming_the_request(temperature):
    """NaN logits (a broken model) are a `RuntimeError` naming the request, which the engine
    core then fails alone; they never become a token id past the vocabulary."""
    logits = torch.randn(2, VOCAB)
    logits[1, 7] = float("nan")
    params = SamplingParams(temperature=temperature)
    sequences = [_seq(params), _seq(params)]
    sequences[1].request_id = "broken"
    with pytest.raises(RuntimeError, match="broken"):
        Sampler(CPU, seed=0, eos_token_ids=[EOS])(logits, sequences)
