"""Weights moved into huge pages keep their values, ties and roles, in one mapping."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from batchinfer.native.memory import (
    HUGE_PAGE_BYTES,
    huge_page_buffer,
    huge_pages_supported,
    move_to_huge_pages,
)

pytestmark = pytest.mark.skipif(not huge_pages_supported(), reason="no MADV_HUGEPAGE here")


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(512, 64)  # 128 KiB: moved
        self.proj = nn.Linear(64, 1024, bias=True)  # weight 256 KiB moved, bias 4 KiB stays
        self.head = nn.Linear(64, 512, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("table", torch.randn(300, 128))  # 150 KiB: moved


def test_moved_tensors_keep_values_and_ties_in_one_mapping():
    torch.manual_seed(0)
    model = Tied()
    before = {name: t.detach().clone() for name, t in model.state_dict().items()}
    small = model.proj.bias.data_ptr()
    x = torch.randn(3, 64)
    expected = model.head(model.proj(x)[:, :64])

    moved = move_to_huge_pages(model)

    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert model.head.weight is model.embed.weight
    assert model.proj.bias.data_ptr() == small  # under MIN_MOVED_BYTES: left in place
    big = [model.embed.weight, model.proj.weight, model.table]
    starts = sorted(t.data_ptr() for t in big)
    sizes = sum(t.numel() * t.element_size() for t in big)
    assert moved >= sizes and starts[-1] - starts[0] < moved  # one mapping, end to end
    assert all(p % 64 == 0 for p in starts)
    assert torch.equal(model.head(model.proj(x)[:, :64]), expected)
    assert isinstance(model.proj.weight, nn.Parameter)  # moved in place, not replaced


def test_huge_page_buffer_is_zeroed_and_marked_for_huge_pages():
    buffer = huge_page_buffer(3 * HUGE_PAGE_BYTES + 5)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 3 * HUGE_PAGE_BYTES + 5
    assert int(buffer.count_nonzero()) == 0
    # The mapping that holds it carries MADV_HUGEPAGE ("hg" among its VmFlags in smaps).
    address, flags, inside = buffer.data_ptr(), None, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif line.startswith("VmFlags:") and inside:
            flags = line.split()[1:]
            break
    assert flags is not None and "hg" in flags


def test_moved_native_forms_compute_the_same_from_one_mapping():
    from batchinfer import native
    from batchinfer.models.linear_kernels import WeightForms
    from batchinfer.native.linear import NativeLinear, move_forms_to_huge_pages

    if native.library() is None:
        pytest.skip("the native kernels are not built here")
    torch.manual_seed(0)
    q4 = WeightForms(torch.randn(64, 96), torch.randn(64)).kernel("q4_native")
    q8 = WeightForms(torch.randn(32, 64), None).kernel("q8_native")
    dense = torch.randn(16, 64)
    f32 = NativeLinear(native.library(), native.F32, 16, 64, (dense,), None)
    x96, x64 = torch.randn(5, 96), torch.randn(5, 64)
    expected = [q4(x96), q8(x64), f32(x64)]
    old = [t.data_ptr() for form in (q4, q8) for t in form.tensors]

    moved = move_forms_to_huge_pages([q4, q8, f32, q4])

    assert moved >= sum(t.numel() * t.element_size() for form in (q4, q8) for t in form.tensors)
    new = [t.data_ptr() for form in (q4, q8) for t in form.tensors]
    assert not set(new) & set(old) and max(new) - min(new) < moved  # one mapping
    assert q4.struct.weight == q4.tensors[0].data_ptr()
    assert q4.struct.offset == q4.tensors[2].data_ptr()
    assert f32.struct.weight == dense.data_ptr()  # float32 forms read the model's weight
    for got, want in zip([q4(x96), q8(x64), f32(x64)], expected, strict=True):
        assert torch.equal(got, want)
