"""Session set-up shared by every test module."""

from __future__ import annotations

import os

import torch

# Without a GPU, Triton's kernels run under its interpreter. It must be on before
# `triton.language` is first imported, and torch imports it where triton is installed (its
# compiler looks for it), so it is set here, before any test module is collected.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
