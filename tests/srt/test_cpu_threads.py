"""CPU defaults that decide whether a shared or small machine serves well: the forward's thread count from the
CPUs the process may use (affinity, cgroup quota), a passive OpenMP wait unless the operator says otherwise,
and a KV pool sized to the model."""

import os
import subprocess
import sys

import pytest

from radixlm.srt.cpu_threads import _cgroup_quota, usable_cpus

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python(code: str, env_extra: dict | None = None, drop: tuple = ()) -> str:
    env = {k: v for k, v in os.environ.items() if k not in drop} | (env_extra or {})
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=True, timeout=300
    ).stdout.strip()


def _cgroup(tmp_path, v2: str | None = None, v1: tuple[str, str] | None = None):
    if v2 is not None:
        (tmp_path / "cpu.max").write_text(v2)
    if v1 is not None:
        (tmp_path / "cpu").mkdir()
        (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(v1[0])
        (tmp_path / "cpu" / "cpu.cfs_period_us").write_text(v1[1])
    return str(tmp_path)


def test_cgroup_quota_cuts_the_thread_count(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    (tmp_path / "a").mkdir()
    root = _cgroup(tmp_path / "a", v2="max 100000\n")  # no quota
    assert _cgroup_quota(root) is None and usable_cpus(root) == affinity
    (tmp_path / "b").mkdir()
    root = _cgroup(tmp_path / "b", v2="50000 100000\n")  # half a CPU: one thread
    assert _cgroup_quota(root) == 0.5
    assert usable_cpus(root) == 1
    (tmp_path / "c").mkdir()
    root = _cgroup(tmp_path / "c", v1=("150000", "100000"))  # cgroup v1, 1.5 CPUs: two threads at most
    assert _cgroup_quota(root) == 1.5
    assert usable_cpus(root) == min(2, affinity)
    (tmp_path / "d").mkdir()
    root = _cgroup(tmp_path / "d", v1=("-1", "100000"))  # v1 unlimited
    assert _cgroup_quota(root) is None and usable_cpus(root) == affinity
    assert usable_cpus(str(tmp_path / "nowhere")) == affinity


def test_affinity_cuts_the_thread_count_of_a_cpu_engine():
    """A process pinned to one CPU runs its forward on one thread (torch would take every CPU of the machine's
    OpenMP default otherwise), and says so at start-up."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs to pin to fewer")  # CI has two
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); import radixlm, torch; "
        "from radixlm.srt.cpu_threads import configure_cpu_forward; line = configure_cpu_forward(); "
        "print(torch.get_num_threads()); print(line)"
    )
    threads, line = _python(code, drop=("OMP_NUM_THREADS",)).splitlines()[-2:]
    assert threads == "1" and line.startswith("1 threads") and "PASSIVE" in line
    # the operator's OMP_NUM_THREADS is kept
    threads, line = _python(code, {"OMP_NUM_THREADS": "2"}).splitlines()[-2:]
    assert threads == "2" and "OMP_NUM_THREADS" in line


def test_passive_wait_is_the_default_and_the_operator_s_choice_wins():
    code = "import radixlm, os; print(os.environ.get('OMP_WAIT_POLICY'))"
    drop = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    assert _python(code, drop=drop) == "PASSIVE"
    assert _python(code, {"OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"
    assert _python(code, {"GOMP_SPINCOUNT": "10000"}, drop=("OMP_WAIT_POLICY",)) == "None"
    # imported after torch, the default cannot reach this process's OpenMP: the start-up line says so
    late = (
        "import torch, radixlm; from radixlm.srt.cpu_threads import configure_cpu_forward; "
        "print(configure_cpu_forward())"
    )
    assert "torch was imported before radixlm" in _python(late, drop=drop)


def test_cpu_kv_pool_is_sized_to_the_model(smol_engine):
    """Two full contexts of the embedded model (not tens of thousands of tokens of fp32 KV it never fills),
    unless memory is shorter."""
    from radixlm.srt.model_executor import model_runner

    runner = smol_engine.runner
    bytes_per_token = runner.config.kv_bytes_per_token * 4
    tokens = runner._default_kv_tokens(bytes_per_token, smol_engine.server_args)
    assert tokens == min(
        2 * (runner.context_length + 1), model_runner._mem_available_bytes() // 5 // bytes_per_token, 65536
    )
    assert tokens * bytes_per_token < 1 << 30  # the 135M model's pool stays under 1 GiB
