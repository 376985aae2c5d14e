"""Rotary position embeddings: the per-frequency speeds a config asks for, the cos/sin
tables, and one step's rotation of q and k.

Scalings (`rope_scaling` / `rope_parameters`), with transformers' arithmetic:
- `linear`: positions slowed by `factor`;
- `llama3`: slow pairs slowed by `factor`, fast ones kept, a smooth band between;
- `yarn`: the same idea by rotations per original context (`beta_fast` / `beta_slow`), and
  cos/sin scaled by an attention factor (`0.1 ln(factor) + 1`, or `mscale` / `mscale_all_dim`,
  or `attention_factor` as given);
- `dynamic` (NTK): the base stretched to `theta ((factor L / max_position_embeddings) -
  (factor - 1)) ^ (d / (d - 2))` for a context of `L` tokens past `max_position_embeddings`,
  unchanged within it;
- `longrope` (Phi-3): one divisor per frequency, `short_factor` for contexts within
  `original_max_position_embeddings`, `long_factor` beyond, and cos/sin scaled by an attention
  factor.

Hugging Face picks LongRoPE's set, and dynamic NTK's base, by the length of each forward pass,
so a sequence crossing the boundary is rotated with both (and its cached keys keep the old
rotation); here both are chosen once for the context the model serves (`rope_tables`'s
`max_context`, as llama.cpp chooses them by its context size), so every key keeps one rotation:
within the original context both are exactly Hugging Face's.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from batchinfer.native import elementwise


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_context: int = 0
) -> torch.Tensor:
    """`[head_dim // 2]` float32 rotation speeds, with the config's scaling applied for a model
    serving sequences of up to `max_context` tokens (LongRoPE's long factors and dynamic NTK's
    stretched base past their original context; other scalings do not depend on it)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
    if scaling is None:
        return 1.0 / (theta ** (exponents / head_dim))
    rope_type = scaling["rope_type"]
    if rope_type == "dynamic" and max_context > scaling["max_position_embeddings"]:
        factor, original = float(scaling["factor"]), scaling["max_position_embeddings"]
        theta *= (factor * max_context / original - (factor - 1)) ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / (theta ** (exponents / head_dim))
    if rope_type == "dynamic":
        return inv_freq
    if rope_type == "longrope":
        long_context = max_context > scaling["original_max_position_embeddings"]
        factors = scaling["long_factor" if long_context else "short_factor"]
        return inv_freq / torch.tensor(factors, dtype=torch.float32, device="cpu")
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "yarn":
        return _yarn(inv_freq, head_dim, theta, factor, scaling)
    # Llama 3: slow (long-wavelength) pairs are slowed by `factor`, fast ones kept, and the
    # band between interpolated smoothly (same arithmetic as transformers).
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / scaling["low_freq_factor"]
    high_freq_wavelen = old_context_len / scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - scaling["low_freq_factor"]) / (
        scaling["high_freq_factor"] - scaling["low_freq_factor"]
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(inv_freq: torch.Tensor, head_dim: int, theta: float, factor: float,
          scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: pairs that turn more than `beta_fast` times over the original context keep their
    speed, those that turn fewer than `beta_slow` times are slowed by `factor`, a linear ramp
    between (by pair index)."""
    original = scaling["original_max_position_embeddings"]

    def pair_of(rotations: float) -> float:  # the (fractional) pair turning `rotations` times
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_of(scaling.get("beta_fast") or 32), pair_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pairs = torch.arange(head_dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((pairs - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def _yarn_scale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: `attention_factor` where the config gives one;
    LongRoPE: `sqrt(1 + ln(s) / ln(original))` for the extension ratio `s` (`factor`, or the
    model's `max_position_embeddings` over `original_max_position_embeddings`), 1 when
    `s <= 1`; YaRN: `0.1 ln(factor) + 1` (or its `mscale` / `mscale_all_dim` ratio); else 1."""
    if scaling is None or scaling["rope_type"] not in ("longrope", "yarn"):
        return 1.0
    rope_type = scaling["rope_type"]
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    if rope_type == "yarn":
        factor, mscale, all_dims = (scaling["factor"], scaling.get("mscale"),
                                    scaling.get("mscale_all_dim"))
        if mscale and all_dims:
            return _yarn_scale(factor, mscale) / _yarn_scale(factor, all_dims)
        return _yarn_scale(factor)
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_tables(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, num_positions: int,
    max_context: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) float32 `[num_positions, head_dim // 2]` on the CPU, for a model serving
    sequences of up to `max_context` tokens (see `rope_inverse_frequencies`)."""
    inv_freq = rope_inverse_frequencies(head_dim, theta, scaling, max_context)
    positions = torch.arange(num_positions, device="cpu").float()
    angles = torch.outer(positions, inv_freq)  # [num_positions, head_dim // 2]
    multiplier = rope_attention_factor(scaling)
    return angles.cos() * multiplier, angles.sin() * multiplier


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (x[i], x[i + d/2]) pair of every head by its position's angle.

    x: [num_tokens, heads, head_dim]; cos, sin: [num_tokens, 1, head_dim // 2]. Equal to HF's
    `x * cos + rotate_half(x) * sin` with half-size tables. Returns a new contiguous tensor.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Rotary:
    """One step's RoPE: every token's angles, by its position, for all layers.

    On float32 CPU activations the heads rotate in place in one native pass that reads the
    tables by position (`native/elementwise.py`); elsewhere each token's `cos`/`sin` rows are
    gathered once a step and `apply_rope` makes new rotated heads.
    """

    def __init__(self, cos_table: torch.Tensor, sin_table: torch.Tensor,
                 positions: torch.Tensor, dtype: torch.dtype) -> None:
        self.lib = elementwise.library_for_dtype(dtype, positions.device)
        if self.lib is not None and positions.numel():
            low, high = (int(p) for p in positions.aminmax())
            if low < 0 or high >= cos_table.shape[0]:  # the table lookup below would raise
                raise IndexError(f"positions must lie in [0, {cos_table.shape[0]}), "
                                 f"got {low}..{high}")
        if self.lib is not None:
            self.positions = positions.contiguous()
            self.cos, self.sin = cos_table, sin_table
        else:  # [n, 1, head_dim // 2]
            self.cos = cos_table[positions].unsqueeze(1).to(dtype)
            self.sin = sin_table[positions].unsqueeze(1).to(dtype)

    def rotated(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """The first `heads` heads of `x` `[n, all_heads, head_dim]` (heads side by side in a
        row, as a view of the fused projection has them) rotated: in place and returned as a
        view where native, else as a new tensor (`x` unchanged)."""
        if self.lib is not None:
            elementwise.rotate_(self.lib, x, heads, self.positions, self.cos, self.sin)
            return x[:, :heads]
        return apply_rope(x[:, :heads], self.cos, self.sin)
