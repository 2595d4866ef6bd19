"""Agent sessions: the exact tokens of each session's last exchange, so that the next prompt of the
session starts with those very ids instead of a re-tokenization of their text.

An agent sends its whole conversation back each turn, as messages; rendered through the chat
template, the model's earlier turns become text again, and a BPE tokenizer need not cut that text
into the ids the engine produced. When the rendered prompt extends the text of the session's last
prompt + response, the prompt is those ids plus the tokens of what is new; otherwise (the client
rewrote history, or the session moved to another replica) it is tokenized afresh, and the export
of the session finds the break and splits it there (traces.py)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from policyloop.serving.chat_request import SESSION_METADATA_KEY, SamplingRequest
from policyloop.serving.errors import ApiError

SESSION_HEADER = "X-Session-Id"
MAX_SESSION_ID = 128


def session_of(request: web.Request, parsed: SamplingRequest) -> str:
    """The session the request belongs to: the X-Session-Id header, else metadata.session_id ("" for none)."""
    header = request.headers.get(SESSION_HEADER)
    metadata = (parsed.metadata or {}).get(SESSION_METADATA_KEY)
    if header is not None and metadata is not None and header != metadata:
        raise ApiError(f"metadata.{SESSION_METADATA_KEY}: {metadata!r} differs from the {SESSION_HEADER} header "
                       f"{header!r}", f"metadata.{SESSION_METADATA_KEY}")
    session = header if header is not None else metadata or ""
    if len(session) > MAX_SESSION_ID or any(not (c.isalnum() or c in "-_.:") for c in session):
        raise ApiError(f"session id: at most {MAX_SESSION_ID} letters, digits and -_.: characters, got {session!r}",
                       f"metadata.{SESSION_METADATA_KEY}")
    return session


@dataclass(frozen=True)
class _Seen:
    ids: list[int]
    text: str


class SessionTokens:
    """The last exchange of each recent session (the `capacity` most recent sessions)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._last: OrderedDict[str, _Seen] = OrderedDict()

    def prompt_ids(self, session: str, text: str, encode: Callable[[str], list[int]]) -> list[int]:
        seen = self._last.get(session) if session else None
        if seen is not None and text.startswith(seen.text):
            self._last.move_to_end(session)
            return seen.ids + (encode(text[len(seen.text):]) if len(text) > len(seen.text) else [])
        return encode(text)

    def remember(self, session: str, ids: list[int], text: str) -> None:
        """The session's latest prompt + response: its ids and what they decode to."""
        if not session:
            return
        self._last[session] = _Seen(list(ids), text)
        self._last.move_to_end(session)
        while len(self._last) > self.capacity:
            self._last.popitem(last=False)
