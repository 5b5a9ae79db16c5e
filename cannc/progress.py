"""Progress of long compiles and tuning runs, drawn by tqdm on the terminal.

The compiler reports stages (`stage(desc, total, unit)`, then `advance()` per step):
the passes, the kernels lowered of the total and the LLVM modules compiled. Nothing is
shown unless a caller turned reporting on with `show_progress()` (the CLI does, around
every verb; `cannc.compile` in Python stays quiet), and then
only once the compile has taken `delay` seconds (2 by default: a warm compile shows
nothing) and only on a terminal (tqdm disables itself when the stream is not one, so
logs and pipes get no control characters; `force=True` draws anyway, for tests).

Stages may advance from several threads (the LLVM modules compile in a pool).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

DELAY = 2.0

_lock = threading.Lock()
_active: _Reporter | None = None


class _Reporter:
    def __init__(self, stream: TextIO, delay: float, force: bool) -> None:
        self.stream, self.delay, self.force = stream, delay, force
        self.t0 = time.perf_counter()

    def bar(self, desc: str, total: int, unit: str) -> Any:
        from tqdm import tqdm

        # the delay counts from the start of the compile, not of this stage: once a compile
        # has taken a couple of seconds, every later stage is shown at once
        left = max(0.0, self.delay - (time.perf_counter() - self.t0))
        tty = bool(getattr(self.stream, "isatty", lambda: False)())
        return tqdm(total=total, desc=desc, unit=unit, file=self.stream, delay=left,
                    leave=False, dynamic_ncols=tty, ncols=None if tty else 100,
                    disable=False if self.force else None)


class Stage:
    """One stage's counter; a no-op when progress is not shown."""

    def __init__(self, bar: Any = None) -> None:
        self._bar = bar

    def advance(self, n: int = 1, note: str | None = None) -> None:
        if self._bar is None:
            return
        with _lock:
            if note is not None:
                # a new note alone is drawn now (update(0) would not), once the bar's
                # delay has passed (a refresh draws regardless of it)
                b = self._bar
                shown = not b.disable and time.time() - b.start_t >= b.delay
                b.set_postfix_str(note, refresh=n == 0 and shown)
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            with _lock:
                self._bar.close()
            self._bar = None

    def __enter__(self) -> Stage:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def stage(desc: str, total: int, unit: str = "it") -> Stage:
    """A counter of `total` steps for the reporter in effect (a no-op without one)."""
    r = _active
    if r is None or total <= 0:
        return Stage()
    return Stage(r.bar(desc, total, unit))


@contextmanager
def show_progress(stream: TextIO | None = None, delay: float = DELAY,
                  force: bool = False) -> Iterator[None]:
    """Within this block, stages are drawn on `stream` (default stderr) once `delay`
    seconds have passed."""
    global _active
    prev = _active
    _active = _Reporter(stream or sys.stderr, delay, force)
    try:
        yield
    finally:
        _active = prev
