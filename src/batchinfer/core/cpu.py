"""What this CPU is: its model name and instruction-set flags, from `/proc/cpuinfo`.

Pure Python (no torch), so every layer can read them: the native kernels key their build by
them, the start-up measurements key their cached choices by the model name, and
`models.hardware` looks for the bfloat16 flags.
"""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's instruction-set flags (`flags` on x86, `Features` on Arm, from `cpuinfo`);
    empty where they cannot be read."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_model() -> str:
    """The CPU's model name (`/proc/cpuinfo`), what measured figures and cached choices quote."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
