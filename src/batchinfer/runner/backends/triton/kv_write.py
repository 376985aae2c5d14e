"""The KV write of a step: every new token's K and V row stored at its cache slot, in one
kernel launch for both (FP8 caches: divided by the layer's scales and clamped to the type's
range first, as `BackendBase.quantize` does).

Narrow types are rounded here to nearest-even with integer arithmetic on the float32 bits, and
the bits stored: the same values as torch's `.to(dtype)` on every device, Triton's interpreter
included (whose own float8 / bfloat16 casts do not carry a rounding into the exponent).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# How a float32 becomes a cache element (`_WRITE`'s KIND), and the integer type that holds it.
PLAIN, BF16, E4M3, E5M2 = 0, 1, 2, 3
_KINDS = {torch.bfloat16: (BF16, torch.int16), torch.float8_e4m3fn: (E4M3, torch.uint8),
          torch.float8_e5m2: (E5M2, torch.uint8)}


@triton.jit
def _float8_bits(x, MANTISSA: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr,
                 SUBNORMAL_STEPS: tl.constexpr):
    """float32 `x` (finite, within range) as float8 bits with `MANTISSA` mantissa bits and
    exponent bias `BIAS`, rounded to nearest even; below the smallest normal (whose float32
    bits are `MIN_NORMAL_BITS`) a subnormal, `SUBNORMAL_STEPS` steps per unit."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    drop: tl.constexpr = 23 - MANTISSA
    normal = (magnitude + ((1 << (drop - 1)) - 1) + ((magnitude >> drop) & 1)) >> drop
    normal = normal - ((127 - BIAS) << MANTISSA)  # the exponent rebiased
    scaled = tl.minimum(tl.abs(x), 1.0) * SUBNORMAL_STEPS  # (only used below 1: no overflow)
    whole = tl.floor(scaled)
    rest = scaled - whole
    up = (rest > 0.5) | ((rest == 0.5) & ((whole.to(tl.int32) & 1) == 1))
    subnormal = (whole.to(tl.int32) + up.to(tl.int32)).to(tl.uint32)
    return (tl.where(magnitude < MIN_NORMAL_BITS, subnormal, normal) | sign).to(tl.uint8)


@triton.jit
def _rounded_bits(x, KIND: tl.constexpr):
    """`x` (float32) as the bits of a bfloat16, float8 e4m3fn or e5m2, rounded to nearest
    even; `x` is finite and (float8) within the type's range."""
    if KIND == 1:  # bfloat16: the top half, rounded by the bottom half
        bits = x.to(tl.uint32, bitcast=True)
        out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)
    elif KIND == 2:  # e4m3fn: smallest normal 2^-6, subnormals multiples of 2^-9
        out = _float8_bits(x, 3, 7, 0x3C800000, 512.0)
    else:  # e5m2: smallest normal 2^-14, subnormals multiples of 2^-16
        out = _float8_bits(x, 2, 15, 0x38800000, 65536.0)
    return out


@triton.jit
def _write_kv(k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
              k_token_stride, v_token_stride, k_inv_scale, v_inv_scale, limit,
              ROW: tl.constexpr, ROW_P: tl.constexpr, QUANTIZED: tl.constexpr,
              KIND: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    cols = tl.arange(0, ROW_P)
    inside = cols < ROW
    k = tl.load(k_ptr + token * k_token_stride + cols, mask=inside, other=0.0)
    v = tl.load(v_ptr + token * v_token_stride + cols, mask=inside, other=0.0)
    if QUANTIZED:
        k = tl.clamp(k.to(tl.float32) * k_inv_scale, -limit, limit)
        v = tl.clamp(v.to(tl.float32) * v_inv_scale, -limit, limit)
    if KIND == 0:
        k_out = k.to(key_cache_ptr.dtype.element_ty)
        v_out = v.to(value_cache_ptr.dtype.element_ty)
    else:
        k_out = _rounded_bits(k.to(tl.float32), KIND)
        v_out = _rounded_bits(v.to(tl.float32), KIND)
    tl.store(key_cache_ptr + slot * ROW + cols, k_out, mask=inside)
    tl.store(value_cache_ptr + slot * ROW + cols, v_out, mask=inside)


def write_kv(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slots: torch.Tensor,
             scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """Store `k`, `v` (`[tokens, kv_heads, head_dim]`, rows of heads side by side) at `slots`
    of `key_cache`, `value_cache` (`[blocks, block_size, kv_heads, head_dim]`, contiguous)."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    k, v = (x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()
            for x in (k, v))
    row = k.shape[1] * k.shape[2]
    dtype = key_cache.dtype
    quantized = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    limit = torch.finfo(dtype).max if quantized else 0.0
    kind, bits = _KINDS.get(dtype, (PLAIN, dtype))
    _write_kv[(num_tokens,)](
        k, v, key_cache.view(bits), value_cache.view(bits), slots, k.stride(0), v.stride(0),
        1.0 / scales[0], 1.0 / scales[1], limit,
        ROW=row, ROW_P=triton.next_power_of_2(row), QUANTIZED=quantized, KIND=kind)
