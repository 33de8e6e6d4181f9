"""How a ledger entry records a request id (G6): as it is only when the engine made it up.

Clients choose request ids (vLLM's OpenAI server takes them from the `X-Request-Id` header and from
a body `request_id`) and a ledger entry is never erased, so a client's id may be anything a person
types: an e-mail address, a user name (`jane.doe`), a ticket title, a card number. An id is recorded
as it is only when it has the shape of an id vLLM generates: an optional serving prefix (`cmpl-`,
`chatcmpl-`, ...) and 16 or 32 lowercase hex digits with at least one letter, or a UUID (vLLM's
random ids, W3C trace ids), then vLLM's prompt index and its 8-hex-digit suffix. Anything else is
recorded as `rid-sha256:` and the first 32 hex digits of its SHA-256, the offline `LLM`'s counter
ids (`17-a1b2c3d4`) too: the Responses API takes a body `request_id` with no prefix, so a client's
digits (a phone or account number) look the same. An auditor holding the engine's id finds its
entries either way: `run_query(request_id=...)` matches an id as given and in its recorded form.
"""

from __future__ import annotations

import hashlib
import re
from typing import Final

RID_DIGEST_PREFIX: Final = "rid-sha256:"

# At least one hex letter: a client's digits (a card or phone number) never pass as vLLM's random id
# (1 in about 1,800 of vLLM's 16-digit ids has none, and is digested: still found by a query).
_RANDOM = (
    r"(?:(?=[0-9]{0,15}[a-f])[0-9a-f]{16}"
    r"|(?=[0-9]{0,31}[a-f])[0-9a-f]{32}"
    r"|(?=[0-9-]{0,35}[a-f])[0-9a-f]{8}(?:-[0-9a-f]{4}){3}-[0-9a-f]{12})"
)
_GENERATED: Final = re.compile(
    rf"(?:[a-z]{{1,16}}[-_])?{_RANDOM}"  # a serving prefix, vLLM's random id
    r"(?:-[0-9]{1,6})?"  # a completion's prompt index
    r"(?:-[0-9a-f]{8})?"  # the engine's suffix (input processor)
    r"(?:_[0-9]{1,6})?"  # a sub-request
    rf"|{re.escape(RID_DIGEST_PREFIX)}[0-9a-f]{{32}}"  # already in recorded form
)


def ledger_request_id(request_id: str | None) -> str | None:
    """The request id as a ledger entry records it: as it is when vLLM generated it, else a digest
    (deterministic, so an auditor holding the id computes the same one)."""
    if request_id is None or _GENERATED.fullmatch(request_id):
        return request_id
    digest = hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).hexdigest()
    return RID_DIGEST_PREFIX + digest[:32]


def recorded_forms(request_id: str) -> list[str]:
    """What to look for when an auditor asks for a request id: the id as given (entries recorded
    before ids were digested, or a digest given directly) and its recorded form."""
    return sorted({request_id, ledger_request_id(request_id) or request_id})
