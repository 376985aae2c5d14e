"""Batched token sampling from the float32 logits of the rows that sample this step.

Order of operations (vLLM's): the grammar mask of constrained rows first (structured outputs:
disallowed tokens -inf, `structured.GrammarMask`); logprobs are taken from those logits (log_softmax
before any bias, penalty or temperature, as vLLM returns by default); then `logit_bias` (added,
all rows at once), repetition penalty (HF: over prompt + output tokens, divide positive logits,
multiply negative ones), frequency / presence penalties (OpenAI: over output tokens only; a
masked token stays masked), `min_tokens` (EOS and stop tokens masked while the output is
shorter, except in a constrained row where its grammar allows nothing else); greedy rows (temperature below 1e-5, `SamplingParams.greedy`) take the argmax of that;
random rows then divide by temperature and apply min_p, top_k, top_p, and draw by inverse CDF: one
uniform number per row, located in the row's cumulative probabilities.

Numerics: penalised logits are clamped to float32's finite range (a repetition penalty of 1e-40
divides a logit to inf); random rows subtract their largest logit before the temperature divides
them, so no entry exceeds 0 and the softmax never meets inf - inf; a row whose probabilities still
do not sum to a finite positive mass (the model's own logits were NaN) is a `RuntimeError` naming
the request, which the engine core fails alone; reported logprobs are floored at -9999 (vLLM's
floor: JSON has no -inf). (The exponential race `argmax(probs / Exponential(1))` needs a random
number per vocabulary entry, and drawing those costs a sizeable part of a CPU decode step;
figures in docs/architecture.md, "Measured figures behind design choices".)

Every step is one tensor op over all rows that need it; Python loops only build index lists and
draw the uniforms of seeded rows. A seeded row's uniform comes from a generator seeded with
`(seed, sample_index)`, so its tokens do not depend on its batch neighbours, its row, or a
preemption; unseeded rows share the sampler's generator (seeded once from the engine's seed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from batchinfer.core.outputs import ScheduledSequence, TokenLogprobs
from batchinfer.core.sampling_params import SamplingParams
from batchinfer.runner.structured import GrammarMask

_MASK64 = (1 << 64) - 1
_FLOAT32_MAX = torch.finfo(torch.float32).max
LOGPROB_FLOOR = -9999.0


@dataclass(slots=True)
class SamplerOutput:
    """Sampled tokens aligned with the input rows; `logprobs` None when no row asked for any."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None


class Sampler:
    """Samples one token per row; holds the generator of unseeded rows and the EOS ids."""

    def __init__(self, device: torch.device, seed: int, eos_token_ids: Sequence[int]) -> None:
        self.device = device
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        # Re-seeded for every seeded row; one object avoids building a generator per row.
        self._row_generator = torch.Generator(device=device)

    def __call__(
        self,
        logits: torch.Tensor,
        sequences: list[ScheduledSequence],
        grammar_mask: GrammarMask | None = None,
    ) -> SamplerOutput:
        """Sample a token for each row of `logits` `[n, vocab]` (float32, modified in place).

        Row i belongs to `sequences[i]`; penalties read its `all_token_ids` and
        `num_prompt_tokens`, `min_tokens` its `sample_index` (= output tokens so far);
        `grammar_mask` holds the allowed tokens of the constrained rows.
        """
        raw_logprobs = self.process(logits, sequences, grammar_mask)
        token_ids, token_list, _ = self.pick(logits, sequences)
        return SamplerOutput(token_list, self.logprobs(raw_logprobs, token_ids, sequences))

    def process(
        self,
        logits: torch.Tensor,
        sequences: list[ScheduledSequence],
        grammar_mask: GrammarMask | None = None,
    ) -> torch.Tensor | None:
        """Everything before the draw, in place: the grammar mask, then (after the reported
        logprobs are taken: returned, one row per row that asks for logprobs, else None)
        logit bias, penalties and min_tokens."""
        if grammar_mask is not None:
            grammar_mask.apply(logits)
        params = [s.sampling_params for s in sequences]
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = (
            torch.log_softmax(logits[logprob_rows], dim=-1) if logprob_rows else None
        )
        apply_logit_bias(logits, params)
        apply_penalties(logits, sequences)
        self._apply_min_tokens(logits, sequences)
        return raw_logprobs

    def pick(self, logits: torch.Tensor, sequences: list[ScheduledSequence],
             stream: int = 0, keep_probs: bool = False
             ) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
        """One token per row of processed `logits`, as a tensor and a list: the argmax of
        greedy rows, a draw from the filtered distribution of random ones (`stream` selects an
        independent random stream of seeded rows); with `keep_probs`, that distribution too
        (`[num_random_rows, vocab]`, in row order; None without random rows). `RuntimeError`
        names the requests whose row has no finite mass."""
        params = [s.sampling_params for s in sequences]
        token_ids = logits.argmax(dim=-1)
        vocab_size = logits.shape[1]
        # argmax picks a NaN where a row holds one: such a row is marked `vocab` like a random
        # row that cannot be drawn from.
        token_ids.masked_fill_(logits.gather(1, token_ids[:, None])[:, 0].isnan(), vocab_size)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        kept = None
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            probs = filtered_probs(logits[rows], [params[i] for i in random_rows])
            kept = probs.clone() if keep_probs else None
            token_ids[rows] = self.draw(probs, [sequences[i] for i in random_rows], stream)
        return token_ids, check_drawn(token_ids, vocab_size, sequences), kept

    def logprobs(self, raw_logprobs: torch.Tensor | None, token_ids: torch.Tensor,
                 sequences: list[ScheduledSequence]) -> list[TokenLogprobs | None] | None:
        """The reported logprobs of `token_ids` (one per row), for the rows that asked
        (`raw_logprobs` from `process`); None when none did."""
        if raw_logprobs is None:
            return None
        params = [s.sampling_params for s in sequences]
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        logprobs: list[TokenLogprobs | None] = [None] * len(sequences)
        requested = [params[i].logprobs or 0 for i in logprob_rows]
        chosen = token_ids[torch.tensor(logprob_rows, device=token_ids.device)]
        for i, entry in zip(logprob_rows, _gather_logprobs(raw_logprobs, chosen, requested),
                            strict=True):
            logprobs[i] = entry
        return logprobs

    def uniforms(self, sequences: list[ScheduledSequence], device: torch.device,
                 stream: int = 0) -> torch.Tensor:
        """One uniform number in [0, 1) per row `[n, 1]`: a seeded row's from `(seed,
        sample_index, stream)`, the others' from the sampler's generator."""
        n = len(sequences)
        uniforms = torch.empty(n, 1, device=device)
        unseeded = [r for r, s in enumerate(sequences) if s.sampling_params.seed is None]
        if len(unseeded) == n:
            uniforms.uniform_(generator=self.generator)
        elif unseeded:
            uniforms[torch.tensor(unseeded, device=device)] = torch.empty(
                len(unseeded), 1, device=device
            ).uniform_(generator=self.generator)
        for r, seq in enumerate(sequences):
            seed = seq.sampling_params.seed
            if seed is not None:
                self._row_generator.manual_seed(row_seed(seed, seq.sample_index, stream))
                uniforms[r].uniform_(generator=self._row_generator)
        return uniforms

    def _apply_min_tokens(self, logits: torch.Tensor, sequences: list[ScheduledSequence]) -> None:
        """Mask EOS (unless `ignore_eos`) and `stop_token_ids` of rows short of `min_tokens`;
        a constrained row whose grammar allows only those tokens keeps them."""
        rows: list[int] = []
        cols: list[int] = []
        vocab_size = logits.shape[1]
        for i, seq in enumerate(sequences):
            p = seq.sampling_params
            if seq.sample_index >= p.min_tokens:
                continue
            stops = p.stop_token_ids if p.ignore_eos else p.stop_token_ids + self.eos_token_ids
            stops = [t for t in stops if t < vocab_size]
            rows.extend([i] * len(stops))
            cols.extend(stops)
        if not rows:
            return
        index = (torch.tensor(rows, device=logits.device),
                 torch.tensor(cols, device=logits.device))
        constrained = sorted({r for r in rows
                              if sequences[r].sampling_params.structured_output is not None})
        kept = logits[index] if constrained else None
        logits[index] = float("-inf")
        if kept is None:
            return
        constrained_rows = torch.tensor(constrained, device=logits.device)
        dead = constrained_rows[logits[constrained_rows].amax(dim=-1).isneginf()]
        if len(dead):  # the grammar wants to end here: it wins over min_tokens
            restore = torch.isin(index[0], dead)
            logits[index[0][restore], index[1][restore]] = kept[restore]

    def draw(self, probs: torch.Tensor, sequences: list[ScheduledSequence],
             stream: int = 0) -> torch.Tensor:
        """One token per row of `probs` `[n, vocab]` (unnormalized is fine), by inverse CDF
        (`probs` is overwritten); `stream` as in `pick`."""
        uniforms = self.uniforms(sequences, probs.device, stream)
        cdf = probs.cumsum_(dim=-1)  # in place: `probs` is this call's own tensor
        total = cdf[:, -1:]
        # Targets strictly below the total (u x total can round up to it): the first entry whose
        # cumulative mass exceeds the target then always has a probability above zero, since a
        # filtered entry's cumulative mass equals its predecessor's.
        below_total = torch.nextafter(total, torch.zeros_like(total))
        targets = torch.minimum(uniforms.mul_(total), below_total)
        drawn = torch.searchsorted(cdf, targets, right=True).squeeze(1)
        # A row without a finite positive mass gets the id `vocab`, which the caller refuses
        # once the ids are on the host (no extra device sync here).
        broken = ~(total[:, 0] > 0.0) | ~torch.isfinite(total[:, 0])
        return drawn.masked_fill_(broken, probs.shape[1])


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Add each row's `logit_bias` to its logits, every row in one indexed add, in place.
    Ids beyond the logits' width (the processor checks them against the vocabulary) are
    skipped."""
    if not any(p.logit_bias for p in params):
        return
    vocab_size = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    biases: list[float] = []
    for i, p in enumerate(params):
        for token_id, bias in p.logit_bias.items():
            if token_id < vocab_size:
                rows.append(i)
                cols.append(token_id)
                biases.append(bias)
    device = logits.device
    logits.index_put_((torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
                      torch.tensor(biases, dtype=logits.dtype, device=device), accumulate=True)


def apply_penalties(logits: torch.Tensor, sequences: list[ScheduledSequence]) -> None:
    """Repetition (prompt + output), then frequency and presence (output) penalties, in place."""
    rows = [i for i, s in enumerate(sequences) if s.sampling_params.needs_penalties]
    if not rows:
        return
    device = logits.device
    output_rows: list[int] = []
    output_ids: list[int] = []
    prompt_rows: list[int] = []
    prompt_ids: list[int] = []
    for r, i in enumerate(rows):
        seq = sequences[i]
        if seq.all_token_ids is None:
            raise RuntimeError(f"request {seq.request_id}: penalties need all_token_ids")
        prompt, output = (seq.all_token_ids[: seq.num_prompt_tokens],
                          seq.all_token_ids[seq.num_prompt_tokens :])
        prompt_rows.extend([r] * len(prompt))
        prompt_ids.extend(prompt)
        output_rows.extend([r] * len(output))
        output_ids.extend(output)
    params = [sequences[i].sampling_params for i in rows]
    row_index = torch.tensor(rows, device=device)
    sub = logits[row_index]  # [num_rows, vocab]
    counts = torch.zeros_like(sub)
    counts.index_put_(
        (torch.tensor(output_rows, dtype=torch.long, device=device),
         torch.tensor(output_ids, dtype=torch.long, device=device)),
        torch.ones(len(output_ids), device=device),
        accumulate=True,
    )
    seen = counts > 0
    seen[torch.tensor(prompt_rows, dtype=torch.long, device=device),
         torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True
    repetition = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
    masked = sub.isneginf()  # a grammar's ban: no penalty may lift it
    sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
    sub = sub - frequency * counts - presence * (counts > 0)
    logits[row_index] = sub.clamp_(-_FLOAT32_MAX, _FLOAT32_MAX).masked_fill_(masked,
                                                                             float("-inf"))


def check_drawn(token_ids: torch.Tensor, vocab_size: int,
                sequences: list[ScheduledSequence]) -> list[int]:
    """The tokens as a list; `RuntimeError` naming the requests whose row drew `vocab_size`
    (no finite mass)."""
    token_list = token_ids.tolist()
    broken = [sequences[i].request_id for i, t in enumerate(token_list) if t >= vocab_size]
    if broken:
        raise RuntimeError(f"non-finite logits: no token can be drawn for requests {broken}")
    return token_list


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, min_p, top_k and top_p; `logits` is a private copy."""
    device = logits.device
    vocab_size = logits.shape[1]
    # Largest logit first: every entry is then <= 0 and stays finite (or -inf) once divided.
    logits.sub_(logits.amax(dim=-1, keepdim=True))
    logits.div_(torch.tensor([p.temperature for p in params], device=device)[:, None])
    if any(p.min_p > 0.0 for p in params):
        probs = logits.softmax(dim=-1)
        min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
        threshold = min_p * probs.amax(dim=-1, keepdim=True)
        logits.masked_fill_(probs < threshold, float("-inf"))
    top_ks = [min(p.top_k, vocab_size) if p.top_k > 0 else 0 for p in params]
    if any(p.top_p < 1.0 for p in params):
        logits = _top_k_top_p(logits, top_ks, [p.top_p for p in params])
    elif any(top_ks):
        logits = _top_k(logits, top_ks)
    return logits.softmax(dim=-1)


def _top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    """Keep the `k` largest logits of each row (0 = keep all); ties with the k-th stay."""
    device = logits.device
    k = torch.tensor(top_ks, device=device)
    values = logits.topk(max(top_ks), dim=-1).values  # [n, max_k], descending
    kth = values.gather(1, (k.clamp(min=1) - 1)[:, None])
    kth.masked_fill_((k == 0)[:, None], float("-inf"))
    return logits.masked_fill_(logits < kth, float("-inf"))


def _top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Top-k then nucleus filtering in sorted order; the most likely token always stays."""
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if any(top_ks):
        k = torch.tensor([t or logits.shape[1] for t in top_ks], device=device)
        rank = torch.arange(logits.shape[1], device=device)
        sorted_logits.masked_fill_(rank >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token once the mass of the tokens before it already reaches top_p.
    mass_before = probs.cumsum(dim=-1) - probs
    # A row without top_p gets 2.0: float rounding can push its cumulative mass past 1.0.
    top_p = torch.tensor([p if p < 1.0 else 2.0 for p in top_ps], device=device)[:, None]
    dropped = mass_before >= top_p
    dropped[:, 0] = False  # a top_p that float32 rounds to 0 (1e-300) keeps the first token too
    sorted_logits.masked_fill_(dropped, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _gather_logprobs(
    logprobs: torch.Tensor, chosen: torch.Tensor, requested: list[int]
) -> list[TokenLogprobs]:
    """Sampled token's logprob and 1-based rank, plus the top-`requested[i]` of each row."""
    chosen_logprobs = logprobs.gather(1, chosen[:, None])  # [n, 1]
    ranks = ((logprobs > chosen_logprobs).sum(dim=-1) + 1).tolist()
    max_n = max(requested)
    if max_n:
        top_values, top_ids = logprobs.topk(max_n, dim=-1)
        top_values_list = top_values.clamp_(min=LOGPROB_FLOOR).tolist()
        top_ids_list = top_ids.tolist()
    chosen_list = chosen.tolist()
    chosen_lp_list = chosen_logprobs[:, 0].clamp_(min=LOGPROB_FLOOR).tolist()
    entries = []
    for r, n in enumerate(requested):
        top = list(zip(top_ids_list[r][:n], top_values_list[r][:n], strict=True)) if n else []
        entries.append(TokenLogprobs(chosen_list[r], chosen_lp_list[r], ranks[r], top))
    return entries


def row_seed(seed: int, sample_index: int, stream: int = 0) -> int:
    """Seed of one seeded draw: splitmix64 of (seed, sample_index, stream), a well-mixed 64-bit
    int (stream 0 is the token draw; speculative decoding draws its other numbers from others)."""
    z = (seed * 0x9E3779B97F4A7C15 + sample_index + 1 + (stream << 48)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)
