"""How many threads the CPU forward uses, and how they wait.

OpenMP's defaults assume the machine is ours: as many threads as the CPUs in the affinity mask (a container's
CPU quota is not looked at), each spinning for a while after every parallel region. On a shared or
quota-limited CPU the spinning threads take the time slices the working ones need, and a decode step that
takes milliseconds alone takes seconds. So the thread count comes from the CPUs this process may really use,
and waiting threads sleep (OMP_WAIT_POLICY=PASSIVE) unless the operator's environment says otherwise.
"""

from __future__ import annotations

import math
import os
import sys

from radixlm.srt import env

WAIT_POLICY_DEFAULT = "PASSIVE"
_late = False  # the default was set after torch (and its OpenMP runtime) had loaded: it does not apply here


def set_wait_policy_default() -> None:
    """Ask for passive waiting before the OpenMP runtime loads (it reads the variable once, when torch is first
    imported); an operator's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins."""
    global _late
    if not env.GOMP_SPINCOUNT.is_set() and env.OMP_WAIT_POLICY.set_default(WAIT_POLICY_DEFAULT):
        _late = "torch" in sys.modules  # processes started from here still get it


def _cgroup_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """The CPU quota of this process's cgroup in CPUs (cgroup v2 cpu.max, else v1 cfs files); None if unlimited."""
    try:
        with open(os.path.join(root, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as f:
            period = int(f.read())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cpus(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """CPUs this process may run on at once: its affinity mask, cut to its cgroup quota (rounded up)."""
    n = len(os.sched_getaffinity(0))
    quota = _cgroup_quota(cgroup_root)
    if quota is not None:
        n = min(n, max(1, math.ceil(quota)))
    return max(1, n)


def configure_cpu_forward(share: int = 1) -> str:
    """Set torch's (and our OpenMP kernels') thread count for a CPU forward; returns a line for the start-up log.
    OMP_NUM_THREADS, when set, is the operator's choice and is kept. `share`: processes forwarding on these
    CPUs at once (tensor-parallel ranks of one host), which split them instead of each spinning on all."""
    import torch

    policy = env.OMP_WAIT_POLICY.get() or "default (spin, then sleep)"
    if _late:
        policy = (
            "default (spin, then sleep): torch was imported before radixlm; set OMP_WAIT_POLICY=PASSIVE "
            "before it for a shared CPU"
        )
    if env.OMP_NUM_THREADS.is_set():
        return f"{torch.get_num_threads()} threads (OMP_NUM_THREADS), wait policy {policy}"
    n = max(1, usable_cpus() // share)
    torch.set_num_threads(n)
    shared = f", shared by {share} ranks" if share > 1 else ""
    return f"{n} threads (the CPUs this process may use{shared}), wait policy {policy}"
