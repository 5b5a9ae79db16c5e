"""Typed observability and behaviour flags, read once from the environment.

CANNC_DEBUG=1      log pass timings and fusion decisions to stderr
CANNC_VERIFY=1     verify the IR before the first pass and after every pass (on in tests)
CANNC_DUMP_DIR=D   write each kernel's LLVM IR and assembly, and the IR after passes, to D
CANNC_CACHE_DIR=D  where compiled objects are cached (default ~/.cache/cannc); 'off' disables
CANNC_TUNING_CACHE=F  the tuning cache written by `cannc tune` (default <cache dir>/tuning.json)
CANNC_TUNING=0     ignore the tuning cache (every kernel gets its modelled default plan)
CANNC_ISA=avx2     generate code for an AVX2 machine (no AVX-512) even on an AVX-512 host
                   (avx512-nobf16: AVX-512 without avx512_bf16, avx512_fp16 and AMX)
CANNC_WINOGRAD=0   never use the Winograd Conv path (default: where its cost model wins;
                   'force': every eligible 3x3 stride-1 Conv, for tests and experiments)
CANNC_STEM_CONV=0  never use the stem Conv path (codegen/stemconv.py: few input channels,
                   strided; default: every eligible Conv of enough flops; 'force': every
                   eligible one)
CANNC_DEVICE_MEMORY=N  the device memory budget in bytes (suffixes K, M, G, T: 8G); default
                   the host's physical memory. No tensor, and no specialisation's arena +
                   weights + workspace, may exceed it: such shapes are a ShapeError at
                   compile time (see `check_size`), before anything is allocated
CANNC_CORE_CHOICE=0  every launch of a program on every AI core (default: a program times
                   launches on every core and on core 0 alone and keeps the faster;
                   runtime/corechoice.py)
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np

from .errors import CanncError, ShapeError

T = TypeVar("T")


def _choice(name: str, choices: dict[str, T]) -> T:
    """A switch with a few values (lower case; "" is the value when unset or empty); a
    misspelt one is an error, not silently the default."""
    v = os.environ.get(name, "").lower()
    if v not in choices:
        known = ", ".join(repr(k) for k in choices if k)
        raise CanncError(f"{name}={os.environ[name]!r}: expected one of {known} (or unset)")
    return choices[v]


_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def _switch(name: str, default: bool) -> bool:
    """An on/off switch: 1, true, yes, on or 0, false, no, off (any case); unset or empty
    is `default`. Anything else is an error, not silently one or the other (a misspelt
    CANNC_CORE_CHOICE=of had left core choice on)."""
    return _choice(name, {"": default, **dict.fromkeys(_ON, True),
                          **dict.fromkeys(_OFF, False)})


def _flag(name: str) -> bool:
    return _switch(name, False)


DEBUG: bool = _flag("CANNC_DEBUG")
VERIFY: bool = _flag("CANNC_VERIFY")
DUMP_DIR: str | None = os.environ.get("CANNC_DUMP_DIR") or None
ISA: str | None = _choice("CANNC_ISA", {"": None, "avx512": None, "avx2": "avx2",
                                        "avx512-nobf16": "avx512-nobf16"})
# a codegen path's switch: where its cost model wins (unset, auto, on), never, or always
_PATH_MODES = {"": "auto", "auto": "auto", **dict.fromkeys(_ON, "auto"),
               **dict.fromkeys(_OFF, "off"), "force": "force"}
WINOGRAD: str = _choice("CANNC_WINOGRAD", _PATH_MODES)
STEM_CONV: str = _choice("CANNC_STEM_CONV", _PATH_MODES)


def cache_dir() -> Path | None:
    v = os.environ.get("CANNC_CACHE_DIR")
    if v and v.lower() == "off":
        return None
    if v:
        return Path(v)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cannc"


def _on_unless_off(name: str) -> bool:
    """A switch that is on unless set to 0, false, no or off (read at each call, so tests
    can set it; a value that is neither is a CanncError)."""
    return _switch(name, True)


def tuning_enabled() -> bool:
    return _on_unless_off("CANNC_TUNING")


def core_choice_enabled() -> bool:
    """CANNC_CORE_CHOICE=0: every launch of a program on every AI core."""
    return _on_unless_off("CANNC_CORE_CHOICE")


def tuning_cache_path() -> Path | None:
    """The tuning cache file (read at every compile, so tests and `cannc tune --cache`
    can point it elsewhere); None when there is no cache directory."""
    v = os.environ.get("CANNC_TUNING_CACHE")
    if v:
        return Path(v)
    d = cache_dir()
    return d / "tuning.json" if d is not None else None


# -- the size guard: shapes are multiplied out before anything allocates or generates code --

INT64_MAX = (1 << 63) - 1
# the highest tensor rank: NumPy's (no result of higher rank can be returned or fed)
MAX_RANK = 64
_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


@functools.cache
def _physical_memory() -> int:
    # (kept: check_size asks for the budget ~1700 times a BERT-base specialisation)
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 1 << 36     # (no sysconf: 64 GiB)


def device_memory_bytes() -> int:
    """The device memory budget (CANNC_DEVICE_MEMORY, read at every call so tests can set
    it; default the host's physical memory)."""
    v = os.environ.get("CANNC_DEVICE_MEMORY", "").strip().lower().removesuffix("b")
    if not v:
        return _physical_memory()
    num, suf = (v[:-1], v[-1]) if v[-1] in _SUFFIX else (v, "")
    try:
        n = int(float(num) * _SUFFIX[suf])
    except ValueError:
        n = 0
    if n <= 0:
        raise CanncError(f"CANNC_DEVICE_MEMORY={os.environ['CANNC_DEVICE_MEMORY']!r}: expected "
                         "a positive number of bytes (suffixes K, M, G, T)")
    return n


def fmt_bytes(n: float) -> str:
    """'512 B', '3.1 KiB', ... '1.5 TiB' (what the reports and errors print)."""
    for unit, f in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= f:
            return f"{n / f:.1f} {unit}"
    return f"{n:.0f} B"


def check_size(what: str, shape: Sequence[object], itemsize: int = 1,
               where: str = "") -> int:
    """The number of elements of `shape`, or a ShapeError naming `what` (e.g. "input 'x'")
    and the figure when a dimension is negative or not an integer, when the element count
    or byte size overflows int64, or when the tensor alone exceeds the device memory
    budget. Symbolic (str) dims are skipped. Python integers: exact, and microseconds."""
    n = 1
    dims = []
    for d in shape:
        if isinstance(d, str):
            continue
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
            raise ShapeError(f"{what}{where}: dimension {d!r} is not an integer "
                             f"(shape {list(shape)})")
        d = int(d)
        if d < 0:
            raise ShapeError(f"{what}{where}: negative dimension {d} in shape {list(shape)}")
        dims.append(d)
    for d in dims:
        n *= d
    nbytes = n * max(int(itemsize), 1)
    if n > INT64_MAX or nbytes > INT64_MAX:
        raise ShapeError(f"{what}{where} has shape {list(shape)}: {n} elements "
                         f"({nbytes} bytes) overflow int64")
    budget = device_memory_bytes()
    if nbytes > budget:
        raise ShapeError(f"{what}{where} has shape {list(shape)}: {n} elements = "
                         f"{fmt_bytes(nbytes)}, more than the device memory budget of "
                         f"{fmt_bytes(budget)} (CANNC_DEVICE_MEMORY)")
    return n


def check_budget(what: str, nbytes: int) -> None:
    """A ShapeError when `nbytes` (e.g. a specialisation's arena + weights + workspace)
    exceeds the device memory budget."""
    budget = device_memory_bytes()
    if nbytes > budget:
        raise ShapeError(f"{what} needs {fmt_bytes(nbytes)} of device memory, more than "
                         f"the budget of {fmt_bytes(budget)} (CANNC_DEVICE_MEMORY)")
