"""Round trip of a cache line between two CPUs (ns): the state of a shared guest.

    python benchmarks/corelat.py            # CPUs: the first two this process may use

The 2-vCPU KVM guests these benchmarks run on move their vCPUs between host cores: a
line bounced between the two vCPUs takes ~55 ns when they share an L3 and 330-440 ns
when they do not, and the state changes within minutes. Two-core figures (every engine's:
the cores exchange each kernel's data) swing with it -- MobileNetV3 at batch 1 on 2 cores
2.9 ms in the first state, 4.5 ms in the second -- so run_zoo.py records it next to every
row. Two pinned threads of a small C program (the system C compiler, as for the execution
provider's shim) take turns writing one atomic word.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_SRC = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static _Atomic long word __attribute__((aligned(64)));
static long n;
static int cpu_a, cpu_b;
static void pin(int c) {
    cpu_set_t s; CPU_ZERO(&s); CPU_SET(c, &s);
    pthread_setaffinity_np(pthread_self(), sizeof s, &s);
}
static void *other(void *arg) {
    (void)arg; pin(cpu_b);
    for (long i = 0; i < n; i++) {
        while (atomic_load_explicit(&word, memory_order_acquire) != 2 * i + 1) {}
        atomic_store_explicit(&word, 2 * i + 2, memory_order_release);
    }
    return 0;
}
int main(int argc, char **argv) {
    cpu_a = atoi(argv[1]); cpu_b = atoi(argv[2]); n = atol(argv[3]);
    pthread_t t; pin(cpu_a);
    pthread_create(&t, 0, other, 0);
    struct timespec a, b; clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++) {
        atomic_store_explicit(&word, 2 * i + 1, memory_order_release);
        while (atomic_load_explicit(&word, memory_order_acquire) != 2 * i + 2) {}
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    pthread_join(t, 0);
    printf("%.1f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / n);
    return 0;
}
"""


@functools.lru_cache(maxsize=1)
def _binary() -> str | None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    d = Path(tempfile.mkdtemp(prefix="cannc-corelat-"))
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    (d / "corelat.c").write_text(_SRC)
    out = d / "corelat"
    r = subprocess.run([cc, "-O2", "-pthread", str(d / "corelat.c"), "-o", str(out)],
                       capture_output=True, text=True)
    return str(out) if r.returncode == 0 else None


def round_trip_ns(trips: int = 200_000) -> float | None:
    """Median of three measurements of the round trip between the first two CPUs this
    process may run on (None: fewer than two, or no C compiler)."""
    cpus = sorted(os.sched_getaffinity(0))
    exe = _binary()
    if len(cpus) < 2 or exe is None:
        return None
    vals = []
    for _ in range(3):
        r = subprocess.run([exe, str(cpus[0]), str(cpus[1]), str(trips)],
                           capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            return None
        vals.append(float(r.stdout.strip()))
    return sorted(vals)[1]


if __name__ == "__main__":
    ns = round_trip_ns()
    print("no measurement (one CPU, or no C compiler)" if ns is None
          else f"cache-line round trip between CPUs: {ns:.0f} ns")
    sys.exit(0)
