"""Typed observability and behaviour flags, read once from the environment.

CANNC_DEBUG=1      log pass timings and fusion decisions to stderr
CANNC_VERIFY=1     verify the IR after every pass (always on in tests)
CANNC_DUMP_DIR=D   write each kernel's LLVM IR and assembly, and the IR after passes, to D
CANNC_CACHE_DIR=D  where compiled objects are cached (default ~/.cache/cannc); 'off' disables
"""

from __future__ import annotations

import os
from pathlib import Path


def _flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "on")


DEBUG: bool = _flag("CANNC_DEBUG")
VERIFY: bool = _flag("CANNC_VERIFY")
DUMP_DIR: str | None = os.environ.get("CANNC_DUMP_DIR") or None


def cache_dir() -> Path | None:
    v = os.environ.get("CANNC_CACHE_DIR")
    if v and v.lower() == "off":
        return None
    if v:
        return Path(v)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cannc"
