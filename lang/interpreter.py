"""Program states and how appended items run.

`s += item` returns at once: each state has one worker thread that runs its items in order, so a program
keeps building while its generations run, and the branches of a `fork` run concurrently (on the server they
batch together and share the prefix through the radix cache). Reading a result (`s["x"]`, `s.text()`)
waits for the items before it. The first failure stops the state's later items and is raised by the next
read (and recorded on the state by `run_batch`). With `run(use_thread=False)` items run as they are appended.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

from radixlm.lang.backend.base import Backend, Call, LangError
from radixlm.lang.fork import ForkGroup, _Join
from radixlm.lang.generation import run_gen
from radixlm.lang.ir import Gen, Image, Role, RoleBegin, RoleEnd, Select, Seq, VarScopeBegin, VarScopeEnd, resolve_dtype
from radixlm.lang.speculative import ChatTurnSpeculation, CompletionSpeculation, Term, speculable


class ProgramState:
    def __init__(
        self,
        backend: Backend,
        defaults: dict | None = None,
        stream: bool = False,
        use_thread: bool = True,
        num_api_spec_tokens: int | None = None,
    ):
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
        self._scopes: dict[str, int] = {}  # open var_scope name -> where its text starts
        self._spec_tokens = num_api_spec_tokens
        self._spec = (
            CompletionSpeculation(num_api_spec_tokens) if num_api_spec_tokens and not backend.is_chat_model else None
        )
        self._turn: ChatTurnSpeculation | None = None  # an assistant turn being recorded (chat speculation)
        self._fork_pos = 0  # for a branch: where its own text starts
        self._forked_vars: frozenset = frozenset()  # for a branch: the variables it was forked with
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixlm-program") if use_thread else None
        self._last: Future | None = None
        self._changed = threading.Condition()
        self._events: list[tuple[str | None, str]] = []  # (variable or None, appended text), for streaming
        self._finished = False

    # --- building ------------------------------------------------------------------------------------------
    def __iadd__(self, item):
        self._submit(item)
        return self

    def _submit(self, item) -> None:
        if self._pool is None:
            self._run_item(item)
        else:
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
            self._fill(item)
        elif isinstance(item, (int, float)):
            self._fill(str(item))
        elif isinstance(item, (Seq, list, tuple)):
            for x in item.items if isinstance(item, Seq) else item:
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
        elif isinstance(item, VarScopeBegin):
            self._scopes[item.name] = len(self._text)
        elif isinstance(item, VarScopeEnd):
            self._vars[item.name] = self._text[self._scopes.pop(item.name) :]
        elif isinstance(item, _Join):
            item.run(self, self._fill)
        elif isinstance(item, Image):
            raise LangError(
                f"image({item.path!r}): the model behind this backend has no vision; radixlm serves text-only models"
            )
        else:
            raise LangError(
                f"cannot append a {type(item).__name__} to a program state (append str, gen, select, roles)"
            )

    def _fill(self, text: str) -> None:
        """Fixed text from the program."""
        if self._turn is not None:
            self._turn.terms.append(Term(text=text))
            return
        if self._spec is not None:
            self._spec.observe(text)
        self._append(text)

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
        prefix = self._markers().prefix[role]
        if self._spec is not None:
            self._spec.observe(prefix)
        self._append(prefix)
        self._role, self._role_start = role, len(self._text)
        if role == "assistant" and self._spec_tokens and self.backend.is_chat_model:
            self._turn = ChatTurnSpeculation(self._spec_tokens)

    def _end(self, role: str) -> None:
        if self._role != role:
            raise LangError(
                f"{role}_end() without {role}_begin()"
                if self._role is None
                else f"{role}_end() inside an open {self._role} block"
            )
        if self._turn is not None:
            self._finish_turn()
        content = self._text[self._role_start :]
        suffix = self._markers().suffix[role]
        if self._spec is not None:
            self._spec.observe(suffix)
        self._append(suffix)
        self._messages.append({"role": role, "content": content})
        self._role = None

    def _finish_turn(self) -> None:
        """The recorded assistant turn, from one answer if it fits its pattern, else piece by piece."""
        turn, self._turn = self._turn, None
        got = turn.resolve(self.backend, self._call({}))
        if got is None:
            for term in turn.terms:
                self._exec(term.text if term.text is not None else term.gen)
            return
        parts, res = got
        for term, text in zip(turn.terms, parts):
            name = getattr(term.gen, "name", None)
            self._append(text, name)
            if name:
                self._vars[name] = text
                self._meta[name] = {**res.meta, "speculative": True}

    def _call(self, params: dict) -> Call:
        role_text = self._text[self._role_start :] if self._role else ""
        return Call(self._text, params, list(self._messages), self._role, role_text)

    # --- primitives ----------------------------------------------------------------------------------------
    def _gen(self, g: Gen) -> None:
        if g.choices is not None:
            self._select(Select(g.name, g.choices, g.choices_method, g.temperature or 0.0))
            return
        params = resolve_dtype({**self.defaults, **g.sampling_params()})
        if self._turn is not None:
            self._turn.terms.append(Term(gen=g, params=params if speculable(params) else None))
            return
        if self._spec is not None and speculable(params):
            value, meta = self._spec.gen(self.backend, self._call(params))
            self._append(value, g.name)
        else:
            if self._spec is not None:
                self._spec.reset()  # this gen has its own request: the speculation no longer follows the text
            value, meta = run_gen(self.backend, self._call(params), self.stream, lambda t: self._append(t, g.name))
        if g.name:
            self._vars[g.name] = value
            self._meta[g.name] = meta

    def _select(self, sel: Select) -> None:
        if (
            not isinstance(sel.choices, (list, tuple))
            or not sel.choices
            or not all(isinstance(c, str) for c in sel.choices)
        ):
            raise LangError(f"select({sel.name!r}) needs a non-empty list of strings as choices")
        if self._turn is not None:
            self._turn.terms.append(Term(gen=sel))
            return
        idx, meta = self.backend.select(self._call({}), list(sel.choices), sel.choices_method, sel.temperature)
        choice = sel.choices[idx]
        if self._spec is not None:
            self._spec.observe(choice)
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
            if self._turn is not None and self._turn.pending(name):
                raise LangError(
                    f"{name!r} is generated with the whole assistant turn (num_api_spec_tokens): read it "
                    "after the turn ends"
                )
            have = ", ".join(sorted(self._vars)) or "none yet"
            raise LangError(f"the program has no variable {name!r} (variables: {have})")
        return self._vars[name]

    def __setitem__(self, name: str, value) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._vars

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

    def get_meta_info(self, name: str):
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

    # --- scopes: `s.user("hi")`, `with s.user(): s += ...`, `with s.var_scope("x"): s += ...` ---------------
    def _role_method(self, role: str, expr=None):
        if expr is not None:
            self._submit(Role(role, [expr]))
            return None
        return self._scope(RoleBegin(role), RoleEnd(role))

    def system(self, expr=None):
        return self._role_method("system", expr)

    def user(self, expr=None):
        return self._role_method("user", expr)

    def assistant(self, expr=None):
        return self._role_method("assistant", expr)

    def var_scope(self, name: str):
        """Everything appended inside the `with` block, generated or not, becomes the variable `name`."""
        return self._scope(VarScopeBegin(name), VarScopeEnd(name))

    @contextmanager
    def _scope(self, begin, end):
        self._submit(begin)
        try:
            yield self
        finally:
            self._submit(end)

    # --- fork ----------------------------------------------------------------------------------------------
    def fork(self, size: int = 1) -> ForkGroup:
        """`size` copies of this state that go on independently; the shared prefix is sent to the backend
        once first, so every branch finds it cached."""
        if not isinstance(size, int) or size < 1:
            raise LangError(f"fork needs a positive number of branches, got {size!r}")
        self.sync()
        if self._turn is not None:
            raise LangError("fork inside an assistant turn that num_api_spec_tokens generates whole")
        self.backend.commit_prefix(self._text)
        branches = []
        for _ in range(size):
            b = ProgramState(self.backend, self.defaults, self.stream, use_thread=self._pool is not None)
            b._text, b._vars, b._meta = self._text, dict(self._vars), copy.deepcopy(self._meta)
            b._messages, b._role, b._role_start = [dict(m) for m in self._messages], self._role, self._role_start
            b._fork_pos, b._forked_vars = len(self._text), frozenset(self._vars)
            b._finished = True
            branches.append(b)
        return ForkGroup(branches, self)

    @contextmanager
    def copy(self):
        """`with s.copy() as c:` a one-branch fork, joined (its new variables gathered) when the block ends."""
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def __repr__(self) -> str:
        return f"ProgramState(text={self._text[-60:]!r}, vars={sorted(self._vars)})"
