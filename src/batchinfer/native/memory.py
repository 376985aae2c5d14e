"""Weights in transparent huge pages, where the CPU kernels stream them every step.

A decode step of a few sequences reads every weight once from memory, front to back. In 4 KiB
pages the hardware prefetchers stop at each page boundary and every page costs a TLB entry;
in 2 MiB pages a weight streams as one run. Linux backs private anonymous memory with huge
pages where it is asked to (`madvise(MADV_HUGEPAGE)`, which the common `transparent_hugepage`
setting `madvise` requires), so the module's tensors are copied into one such mapping, in the
order the model reads them. Elsewhere (no `MADV_HUGEPAGE`, another OS) nothing moves.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from collections.abc import Iterable, Sequence

import torch
from torch import nn

HUGE_PAGE_BYTES = 2 << 20
# Tensors smaller than this stay where they are (norm weights, biases): they live in cache.
MIN_MOVED_BYTES = 64 << 10
ALIGN_BYTES = 64  # each tensor starts on a cache line


def huge_pages_supported() -> bool:
    """Whether this platform takes `madvise(MADV_HUGEPAGE)` on anonymous memory."""
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE")


def huge_page_buffer(num_bytes: int) -> torch.Tensor:
    """A zeroed uint8 CPU tensor of `num_bytes` in a private anonymous mapping marked for
    huge pages (the tensor keeps the mapping alive); `RuntimeError` where unsupported."""
    if not huge_pages_supported():
        raise RuntimeError("huge pages are not available on this platform")
    size = -(-max(num_bytes, 1) // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=torch.uint8)[:num_bytes]


def huge_page_copies(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    """Copies of `tensors` end to end in one huge-page mapping, in the order given, each
    starting on a cache line; and the mapping's bytes in use."""
    sizes = [-(-t.numel() * t.element_size() // ALIGN_BYTES) * ALIGN_BYTES for t in tensors]
    buffer = huge_page_buffer(sum(sizes))
    copies, offset = [], 0
    for tensor, size in zip(tensors, sizes, strict=True):
        nbytes = tensor.numel() * tensor.element_size()
        copy = buffer[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape)
        copies.append(copy.copy_(tensor.detach()))
        offset += size
    return copies, offset


def move_to_huge_pages(module: nn.Module) -> int:
    """Copy `module`'s large CPU parameters and buffers (contiguous, at least MIN_MOVED_BYTES)
    into one huge-page mapping, in registration order, and point them there (tied parameters
    stay tied: each tensor moves once). Call before anything keeps a view or a pointer of the
    old storage. Returns the bytes moved (0 where huge pages are unsupported)."""
    tensors = list(_movable(module))
    if not tensors or not huge_pages_supported():
        return 0
    copies, moved = huge_page_copies(tensors)
    for tensor, copy in zip(tensors, copies, strict=True):
        tensor.data = copy
    return_freed_memory()
    return moved


def return_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's `malloc_trim`; elsewhere
    nothing): tensors that moved into a mapping free their old storage, which the heap would
    otherwise keep resident."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _movable(module: nn.Module) -> Iterable[torch.Tensor]:
    seen: set[int] = set()
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if (tensor.device.type == "cpu" and tensor.layout == torch.strided
                and tensor.is_contiguous() and not tensor.is_quantized
                and tensor.numel() * tensor.element_size() >= MIN_MOVED_BYTES):
            yield tensor
