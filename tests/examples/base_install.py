"""Running a program as a user with only the base install would (issue 28, item 3), without building a venv.

Building a fresh venv needs a network and minutes, so instead a program runs in a subprocess whose start-up (a
`sitecustomize` on PYTHONPATH, inherited by every process it starts: a server launched by `sgl.Runtime()`,
spawned workers) hides every installed package that the base install would not bring:

- the base install is `[project] dependencies` of pyproject.toml and everything they require, transitively
  (read from the installed packages' metadata, environment markers evaluated here);
- hidden is every installed distribution outside it (the extras' packages, and whatever else this machine has),
  by import name (`importlib.metadata.packages_distributions()`), for `import`, `importlib.util.find_spec` and
  `importlib.metadata` alike, exactly as if it were not installed; only `pip` (every venv has it) is kept.

Used by test_readme_base_install.py (the README's snippets) and test_examples.py (every example).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from radixlm.srt.utils import kill_on_parent_death
from tests.helpers import group_alive

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 240  # seconds per program (an Engine start and a few short generations on a busy 2-core CPU)


# Import names of distributions pyproject.toml names but that are not installed here (so their metadata cannot
# say): hidden anyway, so that the list stays complete on any machine.
UNINSTALLED_IMPORT_NAMES = {
    "flashinfer-python": ["flashinfer"],
    "llama-cpp-python": ["llama_cpp"],
    "matplotlib": ["matplotlib", "mpl_toolkits", "pylab"],
}
ALWAYS_PRESENT = {"pip", "radixlm"}  # a venv has pip (the default model's download runs it); radixlm is the install


# --- what the base install holds ---------------------------------------------------------------------------------


def _project() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def requirement_closure(requirements: list[str]) -> set[str]:
    """Canonical names of the distributions `pip install` of these requirements would bring, read from the
    installed metadata (a requirement that is not installed is kept, its own requirements unknown)."""
    out: set[str] = set()
    seen: set[tuple[str, frozenset]] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name, extras = canonicalize_name(req.name), frozenset(req.extras)
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        out.add(name)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        for spec in dist.requires or []:
            sub = Requirement(spec)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in extras | {""}):
                todo.append(sub)
    return out


def _import_names_by_dist() -> dict[str, set[str]]:
    by_dist: dict[str, set[str]] = {}
    for module, dists in md.packages_distributions().items():
        if not module.isidentifier():
            continue
        for dist in dists:
            by_dist.setdefault(canonicalize_name(dist), set()).add(module)
    for dist, names in UNINSTALLED_IMPORT_NAMES.items():
        by_dist.setdefault(canonicalize_name(dist), set()).update(names)
    return by_dist


PROJECT = _project()
BASE = requirement_closure(PROJECT["dependencies"]) | ALWAYS_PRESENT
EXTRAS_ONLY = {extra: requirement_closure(reqs) - BASE for extra, reqs in PROJECT["optional-dependencies"].items()}
OPENAI_CLIENT = requirement_closure(["openai"]) - BASE  # what a user adds to run the openai-client snippets
IMPORT_NAMES = _import_names_by_dist()
INSTALLED = {canonicalize_name(d.metadata["Name"]) for d in md.distributions()}


def hidden_names(allow: set[str] = frozenset()) -> tuple[set[str], set[str]]:
    """(import names, distribution names) to hide: every installed or extras-named distribution outside the base
    install (and `allow`), and its import names but those a base distribution also provides (namespaces)."""
    keep = BASE | set(allow)
    dists = (INSTALLED | set().union(*EXTRAS_ONLY.values())) - keep
    base_modules = set().union(*(IMPORT_NAMES.get(d, set()) for d in keep))
    modules = set().union(*(IMPORT_NAMES.get(d, set()) for d in dists)) - base_modules
    modules -= set(sys.stdlib_module_names) | {"__editable__", "_virtualenv"}
    return modules, dists


EXTRAS_ONLY_MODULES = set().union(*(IMPORT_NAMES.get(d, set()) for d in set().union(*EXTRAS_ONLY.values())))

# The start-up hook every program here runs under. It wraps each finder on sys.meta_path (they are all there by the
# time sitecustomize runs: site-packages' .pth files, editable installs' finders, come first) so that a hidden name
# is found by none of them: `import` raises ModuleNotFoundError, `importlib.util.find_spec` answers None, and
# importlib.metadata does not list the distribution, as when it is not installed. Each hidden import that was tried
# is logged (an optional import may try one and carry on; that is fine).
SITECUSTOMIZE = """
import json, os, re, sys

with open(os.environ["RADIXLM_TEST_HIDDEN"]) as _f:
    _SPEC = json.load(_f)
_MODULES, _DISTS, _LOG = frozenset(_SPEC["modules"]), frozenset(_SPEC["dists"]), _SPEC["log"]


def _note(name):
    try:
        with open(_LOG, "a") as f:
            f.write(f"{os.getpid()} {name}\\n")
    except OSError:
        pass


class _Hiding:
    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _MODULES:
            _note(name)
            return None
        find = getattr(self._finder, "find_spec", None)
        return find(name, path, target) if find is not None else None

    def find_distributions(self, *args, **kwargs):
        find = getattr(self._finder, "find_distributions", None)
        for dist in (find(*args, **kwargs) if find is not None else ()):
            name = dist.metadata["Name"] or ""
            if re.sub(r"[-_.]+", "-", name).lower() not in _DISTS:
                yield dist

    def invalidate_caches(self):
        inv = getattr(self._finder, "invalidate_caches", None)
        if inv is not None:
            inv()

    def __getattr__(self, attr):
        return getattr(self._finder, attr)


sys.meta_path[:] = [_Hiding(f) for f in sys.meta_path]
"""


def base_env(tmp_path: Path, allow: set[str] = frozenset()) -> tuple[dict, Path]:
    """Environment for a subprocess that sees only the base install (plus `allow`); and the hidden-import log."""
    hook = tmp_path / "hide"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "hidden_imports.log"
    modules, dists = hidden_names(allow)
    spec = hook / "hidden.json"
    spec.write_text(json.dumps({"modules": sorted(modules), "dists": sorted(dists), "log": str(log)}))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_CURRENT_TEST")}
    env.update(PYTHONPATH=str(hook), RADIXLM_TEST_HIDDEN=str(spec), PYTHONUNBUFFERED="1")
    return env, log


# --- running a program ------------------------------------------------------------------------------------------


def run_base(
    args: list[str], tmp_path: Path, *, allow: set[str] = frozenset(), cwd: Path | None = None, timeout: float = TIMEOUT
) -> str:
    """Run `python *args` seeing only the base install; it must exit 0 within `timeout` s and leave no process
    behind (its whole process group, a server it started included, is killed past the timeout). Its stdout."""
    env, log = base_env(tmp_path, allow)
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=cwd or tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=kill_on_parent_death,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{args} ran past {timeout} s\n--- stdout ---\n{out[-3000:]}\n--- stderr ---\n{err[-3000:]}")
    leftover = group_alive(proc.pid)
    if leftover:
        os.killpg(proc.pid, signal.SIGKILL)
    tried = sorted(set(log.read_text().split()[1::2])) if log.exists() else []
    assert proc.returncode == 0, (
        f"{args} exited {proc.returncode} with only the base install"
        f"{' (+' + ', '.join(sorted(allow)) + ')' if allow else ''}; hidden imports it "
        f"tried: {tried}\n--- stdout ---\n{out[-3000:]}\n--- stderr ---\n{err[-5000:]}"
    )
    assert not leftover, f"{args} exited but left processes running: {leftover}"
    return out
