"""Program states and how appended items run.

`s += item` returns at once: each state has one worker thread that runs its items in order, so a program
keeps building while its generations run, and the branches of a `fork` run concurrently (on the server they
batch together and share the prefix through the radix cache). Reading a result (`s["x"]`, `s.text()`)
waits for the items before it. The first failure stops the state's later items and is raised by the next
read (and recorded on the state by `run_batch`).
"""
from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from radixlm.lang.backend.base import Backend, Call, LangError
from radixlm.lang.ir import Gen, Image, Role, RoleBegin, RoleEnd, Select, Seq


class ProgramState:
    def __init__(self, backend: Backend, defaults: dict | None = None, stream: bool = False):
        self.backend = backend
        self.defaults = dict(defaults or {})
        self.stream = stream
        self.error: BaseException | None = None
        self.ret_value = None
        self._text = ""
        self._vars: dict = {}
        self._meta: dict = {}
        self._messages: list[dict] = []
        self._role: str | None = None
        self._role_start = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixlm-program")
        self._last: Future | None = None
        self._changed = threading.Condition()
        self._events: list[tuple[str | None, str]] = []  # (variable or None, appended text), for streaming
        self._finished = False

    # --- building ------------------------------------------------------------------------------------------
    def __iadd__(self, item):
        self._submit(item)
        return self

    def _submit(self, item) -> None:
        self._last = self._pool.submit(self._run_item, item)

    def _run_item(self, item) -> None:
        if self.error is not None:
            return  # a failed state runs nothing more
        try:
            self._exec(item)
        except BaseException as e:  # kept for the next read, and for run_batch to report
            self.error = e
            self._notify()

    def _exec(self, item) -> None:
        if item is None:
            return
        if isinstance(item, str):
            self._append(item)
        elif isinstance(item, (int, float)):
            self._append(str(item))
        elif isinstance(item, (Seq, list, tuple)):
            for x in (item.items if isinstance(item, Seq) else item):
                self._exec(x)
        elif isinstance(item, Gen):
            self._gen(item)
        elif isinstance(item, Select):
            self._select(item)
        elif isinstance(item, RoleBegin):
            self._begin(item.role)
        elif isinstance(item, RoleEnd):
            self._end(item.role)
        elif isinstance(item, Role):
            self._begin(item.role)
            self._exec(item.content)
            self._end(item.role)
        elif isinstance(item, Image):
            raise LangError(f"image({item.path!r}): the model behind this backend has no vision; radixlm serves "
                            "text-only models")
        else:
            raise LangError(f"cannot append a {type(item).__name__} to a program state (append str, gen, select, "
                            "roles)")

    def _append(self, text: str, var: str | None = None) -> None:
        with self._changed:
            self._text += text
            self._events.append((var, text))
            self._changed.notify_all()

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    # --- roles ---------------------------------------------------------------------------------------------
    def _markers(self):
        return self.backend.role_markers()

    def _begin(self, role: str) -> None:
        if self._role is not None:
            raise LangError(f"{role}_begin() while the {self._role} block is still open (end it first)")
        self._append(self._markers().prefix[role])
        self._role, self._role_start = role, len(self._text)

    def _end(self, role: str) -> None:
        if self._role != role:
            raise LangError(f"{role}_end() without {role}_begin()" if self._role is None else
                            f"{role}_end() inside an open {self._role} block")
        content = self._text[self._role_start:]
        self._append(self._markers().suffix[role])
        self._messages.append({"role": role, "content": content})
        self._role = None

    def _call(self, params: dict) -> Call:
        role_text = self._text[self._role_start:] if self._role else ""
        return Call(self._text, params, list(self._messages), self._role, role_text)

    # --- primitives ----------------------------------------------------------------------------------------
    def _gen(self, g: Gen) -> None:
        if g.choices is not None:
            self._select(Select(g.name, g.choices, g.choices_method, g.temperature or 0.0))
            return
        params = {**self.defaults, **g.sampling_params()}
        call = self._call(params)
        if self.stream:
            pieces, result = [], None
            for piece, res in self.backend.stream(call):
                if piece:
                    pieces.append(piece)
                    self._append(piece, g.name)
                result = res or result
            text = "".join(pieces)
        else:
            result = self.backend.generate(call)
            text = result.text
            self._append(text, g.name)
        if g.name:
            self._vars[g.name] = text
            self._meta[g.name] = result.meta if result else {}

    def _select(self, sel: Select) -> None:
        if not isinstance(sel.choices, (list, tuple)) or not sel.choices or \
                not all(isinstance(c, str) for c in sel.choices):
            raise LangError(f"select({sel.name!r}) needs a non-empty list of strings as choices")
        idx, meta = self.backend.select(self._call({}), list(sel.choices), sel.choices_method, sel.temperature)
        choice = sel.choices[idx]
        self._append(choice, sel.name)
        if sel.name:
            self._vars[sel.name] = choice
            self._meta[sel.name] = meta

    # --- reading -------------------------------------------------------------------------------------------
    def sync(self) -> "ProgramState":
        """Wait for every appended item; raise the state's error, if any."""
        if self._last is not None:
            self._last.result()
        if self.error is not None:
            raise self.error
        return self

    def __getitem__(self, name: str):
        self.sync()
        if name not in self._vars:
            have = ", ".join(sorted(self._vars)) or "none yet"
            raise LangError(f"the program has no variable {name!r} (variables: {have})")
        return self._vars[name]

    def get_var(self, name: str):
        return self[name]

    def set_var(self, name: str, value) -> None:
        self.sync()
        self._vars[name] = value

    def text(self) -> str:
        self.sync()
        return self._text

    def messages(self) -> list[dict]:
        self.sync()
        return [dict(m) for m in self._messages]

    def get_meta_info(self, name: str) -> dict:
        self.sync()
        if name not in self._meta:
            raise LangError(f"no meta info for {name!r} (only gen and select calls with a name have it)")
        return self._meta[name]

    @property
    def variables(self) -> dict:
        self.sync()
        return dict(self._vars)

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The text as it is generated (with run(stream=True)): every piece, or only `var_name`'s."""
        seen = 0
        while True:
            with self._changed:
                while seen == len(self._events) and not self._done():
                    self._changed.wait(0.5)
                new, seen = self._events[seen:], len(self._events)
                done = self._done()
            for var, piece in new:
                if var_name is None or var == var_name:
                    yield piece
            if done and seen == len(self._events):
                if self.error is not None:
                    raise self.error
                return

    def _done(self) -> bool:
        return self.error is not None or (self._finished and (self._last is None or self._last.done()))

    def _mark_finished(self) -> None:
        with self._changed:
            self._finished = True
            self._changed.notify_all()

    # --- role blocks as methods: `s.user("hi")`, or `with s.user(): s += ...` -------------------------------
    def _role_method(self, role: str, expr=None):
        if expr is not None:
            self._submit(Role(role, [expr]))
            return None
        return _RoleScope(self, role)

    def system(self, expr=None):
        return self._role_method("system", expr)

    def user(self, expr=None):
        return self._role_method("user", expr)

    def assistant(self, expr=None):
        return self._role_method("assistant", expr)

    # --- fork ----------------------------------------------------------------------------------------------
    def fork(self, size: int = 1) -> "ForkGroup":
        """`size` copies of this state that go on independently; the shared prefix is sent to the backend
        once first, so every branch finds it cached."""
        if not isinstance(size, int) or size < 1:
            raise LangError(f"fork needs a positive number of branches, got {size!r}")
        self.sync()
        self.backend.commit_prefix(self._text)
        branches = []
        for _ in range(size):
            b = ProgramState(self.backend, self.defaults, self.stream)
            b._text, b._vars, b._meta = self._text, dict(self._vars), copy.deepcopy(self._meta)
            b._messages, b._role, b._role_start = [dict(m) for m in self._messages], self._role, self._role_start
            b._finished = True
            branches.append(b)
        return ForkGroup(branches, self)

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    def __repr__(self) -> str:
        return f"ProgramState(text={self._text[-60:]!r}, vars={sorted(self._vars)})"


class _RoleScope:
    def __init__(self, state: ProgramState, role: str):
        self.state, self.role = state, role

    def __enter__(self):
        self.state._submit(RoleBegin(self.role))
        return self.state

    def __exit__(self, *exc):
        self.state._submit(RoleEnd(self.role))
        return False


class ForkGroup(list):
    """The branches of a fork: a list of states; `forks += item` appends to every branch."""

    def __init__(self, branches: list[ProgramState], parent: ProgramState):
        super().__init__(branches)
        self.parent = parent

    def __iadd__(self, item):
        for b in self:
            b += item
        return self

    def join(self, mode: str = "gather_variable") -> list[ProgramState]:
        """Wait for every branch. With "gather_variable", each variable the branches made becomes a list on
        the parent (branch order)."""
        for b in self:
            b.sync()
        if mode == "gather_variable":
            names = {n for b in self for n in b._vars if n not in self.parent._vars}
            for n in sorted(names):
                self.parent._vars[n] = [b._vars.get(n) for b in self]
        elif mode != "concate_and_append":
            raise LangError(f"unknown join mode {mode!r}")
        else:
            self.parent.sync()
            self.parent._append("".join(b._text[len(self.parent._text):] for b in self))
        return list(self)
