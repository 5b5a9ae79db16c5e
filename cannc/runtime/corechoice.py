"""How many of the device's AI cores a program's launches use: measured, not assumed.

Splitting a kernel over two cores costs a wake-up, a start gate, claims on shared
counters and the hand-over of data that the other core wrote; a model of many kernels of
a few microseconds each can run slower on two cores than on one (the zoo's small
MobileNet at batch 1 on a Sapphire Rapids guest: 0.104 ms on one core, 0.129 on two). No
model should, so a program on more than one core times its own launches: after WARM
launches on every core it runs blocks of BLOCK launches on every core and on core 0
alone, in turn, timing all but the first of each block (a worker that slept through a
block on one core is woken by the next block's first launch: back to back, it would not
be), and keeps core 0 alone when its median is below MARGIN times the median on every
core (decided after MIN_PAIRS to PAIRS pairs of blocks: early where one setting is
plainly faster). A program whose launches take TRIAL_MAX_S or more on every core
skips the trial: a split costs microseconds. A program on core 0 alone runs the trial
again after RECHECK launches, so a machine whose state changed (the 2-vCPU guests do) is
measured again; so does one that chose every core by a close margin (core 0 alone less
than RECLOSE times slower: its trial launches cost it little, and a near tie can be
decided wrongly by a noisy moment -- the zoo MobileNet chose every core once in five
processes, then ran 0.123 ms a launch against 0.106 on core 0 alone). One that chose
every core by more does not: its trial would slow whole launches up to twofold. Only
launches with
the cores to themselves take part in the trial (others run on every core); profiling
launches are neither timed nor counted.

CANNC_CORE_CHOICE=0 keeps every launch on every core.
"""

from __future__ import annotations

import statistics
import threading

from ..config import core_choice_enabled

WARM = 8          # launches on every core before the first trial (the first after a
                  # cold compile ran slow on one core as well: 1.46x at the zoo MobileNet)
BLOCK = 4         # launches in a row on one setting; the first of a block is not timed
PAIRS = 4         # at most this many (every core, one core) pairs of blocks
MIN_PAIRS = 2     # ... and at least this many before either is chosen
MARGIN = 0.97     # one core's median must be this far below every core's
GIVE_UP = 1.3     # after MIN_PAIRS pairs, one core's median this far above: every core
RECHECK = 4096    # launches on core 0 alone, then the trial again
RECLOSE = 1.10    # ... and launches on every core, where core 0 alone was this close
TRIAL_MAX_S = 0.02  # the last warm launch this long or longer: every core, no trial


class CoreChoice:
    """The number of cores a program's next launch uses, and the trials that choose it."""

    def __init__(self, cores: int, enable: bool | None = None) -> None:
        self.cores = cores
        self.enabled = cores > 1 and (core_choice_enabled() if enable is None else enable)
        self.use = cores
        self.decided = not self.enabled
        # (median ms on every core, median ms on one core, pairs) of the last decision
        self.measured: tuple[float, float, int] | None = None
        self._lock = threading.Lock()
        self._n = 0
        self._all: list[float] = []
        self._one: list[float] = []

    def next(self, alone: bool = True) -> tuple[int, str | None]:
        """(cores for this launch, None or the tag to `record` its time with). A launch
        while others of the program are in flight (not `alone`) takes the choice, or
        every core during the trial, and leaves the trial where it is."""
        if not self.enabled:
            return self.cores, None
        with self._lock:
            if not alone and not self.decided:
                return self.cores, None
            n = self._n
            self._n += 1
            if self.decided:
                if n >= RECHECK and (self.use == 1 or self._close()):
                    self._restart()
                return self.use, None
            if n < WARM:
                return self.cores, ("warm" if n == WARM - 1 else None)
            block, i = divmod(n - WARM, BLOCK)
            return (1 if block % 2 else self.cores), ("trial" if i > 0 else None)

    def record(self, cores: int, seconds: float, tag: str) -> None:
        """The time of a launch that `next` tagged."""
        with self._lock:
            if self.decided:
                return
            if tag == "warm":
                if seconds >= TRIAL_MAX_S:
                    self._decide(self.cores, seconds, float("nan"), 0)
                return
            (self._one if cores == 1 else self._all).append(seconds)
            per = BLOCK - 1
            pairs = min(len(self._one), len(self._all)) // per
            if pairs == 0 or len(self._one) != len(self._all) or len(self._one) % per:
                return
            every, one = statistics.median(self._all), statistics.median(self._one)
            if pairs >= MIN_PAIRS and one > GIVE_UP * every:
                self._decide(self.cores, every, one, pairs)
            elif pairs >= PAIRS or (pairs >= MIN_PAIRS and one < MARGIN * every
                                    and max(self._one) < min(self._all)):
                self._decide(1 if one < MARGIN * every else self.cores, every, one, pairs)

    @property
    def unlaunched(self) -> bool:
        """No launch has asked for its cores yet (a program compiled and never run: the
        one `cannc.compile` makes for a model's default shapes, when the runs use
        others)."""
        return not self.decided and self._n == 0

    def _decide(self, use: int, every: float, one: float, pairs: int) -> None:
        self.use = use
        self.decided = True
        self.measured = (every * 1e3, one * 1e3, pairs)
        self._n = 0

    def _close(self) -> bool:
        """Every core was chosen in a trial where core 0 alone was within RECLOSE."""
        return (self.measured is not None and self.measured[2] > 0
                and self.measured[1] < RECLOSE * self.measured[0])

    def _restart(self) -> None:
        self.decided = False
        self._n = WARM          # (the program is warm)
        self._all, self._one = [], []

    def describe(self) -> str:
        """One line for reports: what the launches use and why."""
        if not self.enabled:
            return f"{self.cores} AI core(s)" + ("" if self.cores == 1 else
                                                  " (CANNC_CORE_CHOICE=0)")
        if not self.decided or self.measured is None:
            return f"{self.cores} AI cores (the 1-core trial is not finished)"
        every, one, pairs = self.measured
        if pairs == 0:
            return (f"all {self.cores} AI cores: a launch took {every:.3f} ms (no trial on "
                    f"1 core from {TRIAL_MAX_S * 1e3:.0f} ms)")
        which = "1 of " if self.use == 1 else "all "
        return (f"{which}{self.cores} AI cores: a launch took {every:.3f} ms on {self.cores}, "
                f"{one:.3f} ms on 1 (medians of {pairs} pairs of {BLOCK}-launch blocks)")
