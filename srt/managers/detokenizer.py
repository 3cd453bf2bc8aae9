"""Incremental detokenization: text deltas that never split a UTF-8 character, and stop-string trimming.

A token's text can depend on its neighbours (byte-level BPE pieces, SentencePiece spaces), so each step we
decode a short window before the new tokens and emit only what the window adds once it no longer ends in an
incomplete character. Stop strings are trimmed from the final text, and while streaming we hold back any
tail that might still grow into a stop string.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from radixlm.srt.managers.io_struct import TokenOutput

_REPLACEMENT = "\ufffd"


@dataclass
class _State:
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    stop: list[str]
    no_stop_trim: bool
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""
    sent: int = 0


@dataclass
class DetokOutput:
    rid: str
    delta: str  # new text since the last output for this request
    text: str  # all text so far (final and trimmed once finished)
    out: TokenOutput


class IncrementalDetokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, _State] = {}

    def register(
        self,
        rid: str,
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: list[str] | None = None,
        no_stop_trim: bool = False,
    ) -> None:
        self.states[rid] = _State(skip_special_tokens, spaces_between_special_tokens, list(stop or []), no_stop_trim)

    def discard(self, rid: str) -> None:
        self.states.pop(rid, None)

    def process(self, outputs: list[TokenOutput]) -> list[DetokOutput]:
        """Text deltas for a step's outputs. A request may have several outputs in one batch (a step that
        finished what was in flight, then ran another); they are taken in order, one round per output."""
        results: list[DetokOutput] = []
        while outputs:
            seen: set[str] = set()
            now, later = [], []
            for out in outputs:
                (later if out.rid in seen else now).append(out)
                seen.add(out.rid)
            results += self._process_round(now)
            outputs = later
        return results

    def _process_round(self, outputs: list[TokenOutput]) -> list[DetokOutput]:
        groups: dict[tuple[bool, bool], list[tuple[TokenOutput, _State, list[int]]]] = defaultdict(list)
        results = []
        for out in outputs:
            st = self.states.get(out.rid)
            if st is None:
                continue
            st.ids += out.new_ids
            ids = st.ids
            reason = out.finished_reason
            if reason is not None and reason.type == "stop" and isinstance(reason.matched, int) and not st.no_stop_trim:
                ids = ids[:-1]  # the matched stop token is not part of the text
            groups[(st.skip_special_tokens, st.spaces_between_special_tokens)].append((out, st, ids))
        for (skip, spaces), items in groups.items():
            windows = [ids[st.prefix_offset :] for _, st, ids in items]
            heads = [ids[st.prefix_offset : st.read_offset] for _, st, ids in items]
            kw = {"skip_special_tokens": skip, "clean_up_tokenization_spaces": False}
            if not spaces:
                kw["spaces_between_special_tokens"] = False
            new_texts = self.tokenizer.batch_decode(windows, **kw)
            head_texts = self.tokenizer.batch_decode(heads, **kw)
            for (out, st, ids), new, head in zip(items, new_texts, head_texts):
                finished = out.finished_reason is not None
                if len(new) > len(head) and (finished or not new.endswith(_REPLACEMENT)):
                    st.text += new[len(head) :]
                    st.prefix_offset, st.read_offset = st.read_offset, len(ids)
                results.append(self._emit(out, st, finished))
                if finished:
                    del self.states[out.rid]
        return results

    def _emit(self, out: TokenOutput, st: _State, finished: bool) -> DetokOutput:
        if finished:
            matched = out.finished_reason.matched
            if isinstance(matched, str):
                # Emitted text never ends inside a stop string (see _partial_stop_len), so the match that ended
                # the request starts at or after what was sent; earlier ones came before min_new_tokens.
                cut = st.text.find(matched, st.sent)
                if cut >= 0:
                    st.text = st.text[: cut + (len(matched) if st.no_stop_trim else 0)]
            end = len(st.text)
        else:
            end = len(st.text) - _partial_stop_len(st.text, st.stop)
        end = max(end, st.sent)
        delta = st.text[st.sent : end]
        st.sent = end
        return DetokOutput(out.rid, delta, st.text[:end], out)


def _partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string (held back)."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
