"""Typed observability and behaviour flags, read once from the environment.

CANNC_DEBUG=1      log pass timings and fusion decisions to stderr
CANNC_VERIFY=1     verify the IR before the first pass and after every pass (on in tests)
CANNC_DUMP_DIR=D   write each kernel's LLVM IR and assembly, and the IR after passes, to D
CANNC_CACHE_DIR=D  where compiled objects are cached (default ~/.cache/cannc); 'off' disables
CANNC_TUNING_CACHE=F  the tuning cache written by `cannc tune` (default <cache dir>/tuning.json)
CANNC_TUNING=0     ignore the tuning cache (every kernel gets its modelled default plan)
CANNC_ISA=avx2     generate code for an AVX2 machine (no AVX-512) even on an AVX-512 host
CANNC_WINOGRAD=0   never use the Winograd Conv path (default: where its cost model wins;
                   'force': every eligible 3x3 stride-1 Conv, for tests and experiments)
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import CanncError


def _flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "on")


DEBUG: bool = _flag("CANNC_DEBUG")
VERIFY: bool = _flag("CANNC_VERIFY")
DUMP_DIR: str | None = os.environ.get("CANNC_DUMP_DIR") or None


def _choice(name: str, choices: dict[str, str | None]) -> str | None:
    """A switch with a few values; a misspelt one is an error, not silently the default."""
    v = os.environ.get(name, "").lower()
    if v not in choices:
        known = ", ".join(repr(k) for k in choices if k)
        raise CanncError(f"{name}={os.environ[name]!r}: expected one of {known} (or unset)")
    return choices[v]


ISA: str | None = _choice("CANNC_ISA", {"": None, "avx512": None, "avx2": "avx2"})
WINOGRAD: str = _choice("CANNC_WINOGRAD", {
    "": "auto", "auto": "auto", "1": "auto", "true": "auto", "yes": "auto", "on": "auto",
    "0": "off", "false": "off", "no": "off", "off": "off", "force": "force"}) or "auto"


def cache_dir() -> Path | None:
    v = os.environ.get("CANNC_CACHE_DIR")
    if v and v.lower() == "off":
        return None
    if v:
        return Path(v)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cannc"


def tuning_enabled() -> bool:
    return os.environ.get("CANNC_TUNING", "1").lower() not in ("0", "false", "no", "off")


def tuning_cache_path() -> Path | None:
    """The tuning cache file (read at every compile, so tests and `cannc tune --cache`
    can point it elsewhere); None when there is no cache directory."""
    v = os.environ.get("CANNC_TUNING_CACHE")
    if v:
        return Path(v)
    d = cache_dir()
    return d / "tuning.json" if d is not None else None
