"""Validating an edit of an already validated policy set part by part, and its canonical JSON.

Why. A policy write stores the canonical JSON of the whole edited set, and every reader parses that
whole document, so the writer checks that the document parses before it stores it (a version that
cannot be read back would fail every engine closed later). Parsing the whole set on every write
was the largest single cost of a loaded admin API (docs/benchmarks.md, "Control plane under load":
14% of the server's samples, about 1.7 ms of CPU per write with 32 tenants). An edit from the admin
API replaces one tenant's entry of a set that this process parsed from its stored document (or
validated when it wrote it): every other part is the very object a reader's parse produced.

Why part by part is the same check. Parsing a document validates each part (the default, each
tenant's entry, each share group) from its own JSON, and no part's validation reads another part;
then it runs the set's own rules (`invariants.policy_set_problems`), the keys, the version and the
epoch. So an edited set parses, and parses to the same set, if and only if:

1. every part that is not the base's own object parses from its canonical JSON (`_reparsed`: the
   result replaces the caller's object, which may have been built with `model_construct` and so
   never validated); and
2. the set assembled from those parts passes the set-level validation (`PolicySet.model_validate`
   on the parts, which pydantic takes as they are, and on the scalars as they come out of JSON).

`checked_edit` does exactly these two steps. Part identity (`is`), never equality, decides what
counts as already validated: an equal object built elsewhere is validated again.

The canonical JSON of the result (`CanonicalParts.document`) is assembled from each part's own
canonical JSON, cached per part object, in the order `json.dumps(..., sort_keys=True)` writes
them; it equals `PolicySet.canonical_json()` (tests/policy/test_edits.py checks it over generated
sets), and falls back to it for a set with fields this module does not know.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Final, NamedTuple, TypeVar

from pydantic import BaseModel, ValidationError

from kvguard.policy.loading import load_json
from kvguard.policy.models import PolicySet, ShareGroup, TenantPolicy

_FIELDS: Final = frozenset({"version", "epoch", "default", "tenants", "share_groups"})
_CACHE_MAX: Final = 4096  # part objects whose canonical JSON is kept (a few hundred bytes each)

P = TypeVar("P", bound=BaseModel)


# `PolicySet.canonical_json`'s settings, in one encoder (json.dumps builds one per call).
_ENCODER: Final = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _json(value: Any) -> str:
    return _ENCODER.encode(value)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid number in a policy")  # as the loader refuses it


def _reparsed(part: P, base_part: P | None, model: type[P], parts: CanonicalParts) -> P:
    """`part` as a reader parses it: the base's object itself, or validated from its JSON."""
    if base_part is not None and part is base_part:
        return base_part
    data = json.loads(parts.fragment(part), parse_constant=_refuse_constant)
    return model.model_validate(data)


def checked_edit(edited: PolicySet, base: PolicySet, parts: CanonicalParts) -> PolicySet | None:
    """`edited` as a reader would parse its canonical JSON, validating only what is not an object
    of `base`, which must be a set this process parsed or validated (module docstring). None when
    something does not validate: the caller then parses the whole document, which reports every
    problem at its field path."""
    if set(type(edited).model_fields) != _FIELDS:
        return None
    try:
        default = _reparsed(edited.default, base.default, TenantPolicy, parts)
        tenants = {
            key: _reparsed(entry, base.tenants.get(key), TenantPolicy, parts)
            for key, entry in sorted(edited.tenants.items())
        }
        groups = {
            key: _reparsed(group, base.share_groups.get(key), ShareGroup, parts)
            for key, group in sorted(edited.share_groups.items())
        }
        scalars = json.loads(
            _json({"version": edited.version, "epoch": edited.epoch}),
            parse_constant=_refuse_constant,
        )
        return PolicySet.model_validate(
            {**scalars, "default": default, "tenants": tenants, "share_groups": groups}
        )
    except (ValidationError, ValueError, TypeError):
        return None


class CanonicalParts:
    """The canonical JSON of policy parts, cached per part object (they are frozen), and of whole
    sets assembled from it. Safe to share between threads: each cache operation is one dict
    operation, and a lost race only computes a fragment twice."""

    def __init__(self) -> None:
        # id(part) -> (part, its JSON): the part is held so that its id is not reused meanwhile.
        self._fragments: dict[int, tuple[BaseModel, str]] = {}
        self._lock = threading.Lock()

    def fragment(self, part: BaseModel) -> str:
        """`part`'s canonical JSON, as it appears inside its set's canonical JSON."""
        cached = self._fragments.get(id(part))
        if cached is not None and cached[0] is part:
            return cached[1]
        text = _json(part.model_dump(mode="json"))
        with self._lock:
            if len(self._fragments) >= _CACHE_MAX:
                self._fragments.clear()
            self._fragments[id(part)] = (part, text)
        return text

    def document(self, policy_set: PolicySet) -> str:
        """`policy_set.canonical_json()`, from the cached JSON of its parts."""
        if set(type(policy_set).model_fields) != _FIELDS or not _plain_scalars(policy_set):
            return policy_set.canonical_json()
        return (
            self.head(policy_set)
            + ",".join(self.items(policy_set.tenants))
            + "}"
            + self.tail(policy_set)
        )

    def head(self, policy_set: PolicySet) -> str:
        """The canonical JSON up to the first tenant's item (keys in sorted order at every level,
        as `json.dumps(sort_keys=True)` writes them)."""
        return (
            '{"default":'
            + self.fragment(policy_set.default)
            + ',"epoch":'
            + _json(policy_set.epoch)
            + ',"share_groups":{'
            + ",".join(self.items(policy_set.share_groups))
            + '},"tenants":{'
        )

    @staticmethod
    def tail(policy_set: PolicySet) -> str:
        """The canonical JSON after the tenants map."""
        return ',"version":' + _json(policy_set.version) + "}"

    def items(self, parts: dict[str, TenantPolicy] | dict[str, ShareGroup]) -> list[str]:
        """Each `"key":{...}` item of a map of parts, in sorted key order."""
        return [_json(key) + ":" + self.fragment(part) for key, part in sorted(parts.items())]


def _plain_scalars(policy_set: PolicySet) -> bool:
    # Exactly int (not bool, not a subclass) and str keys: what `model_dump(mode="json")` passes
    # through unchanged, so `_json` writes them as the whole-set dump does.
    # Parts of exactly the declared classes: a subclass would dump its own fields on its own.
    return (
        type(policy_set.version) is int
        and type(policy_set.epoch) is int
        and type(policy_set.default) is TenantPolicy
        and all(type(k) is str and type(v) is TenantPolicy for k, v in policy_set.tenants.items())
        and all(
            type(k) is str and type(v) is ShareGroup for k, v in policy_set.share_groups.items()
        )
    )


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix (slice comparisons, so C speed on long texts)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # invariant: a[:lo] == b[:lo]
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a: str, b: str, limit: int) -> int:
    """The length of the longest common suffix, at most `limit`."""
    lo, hi = 0, limit
    while lo < hi:  # invariant: the last lo characters are equal
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid : len(a) - lo] == b[len(b) - mid : len(b) - lo]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def reread(document: str, base: PolicySet, parts: CanonicalParts) -> PolicySet | None:
    """`document` (a stored version's text) as a reader parses it, read as an edit of `base`, a set
    this process parsed or validated: only the tenant entries in the span where the two texts
    differ are parsed; every other part is `base`'s own object. None when that is not possible (the
    texts differ outside the tenants, or anything fails to parse or validate): the caller then
    parses the whole document.

    Why. A policy version written by another API process must be read before this process can edit
    it, and parsing a whole 64-tenant document costs about a millisecond, most of a write's CPU
    (docs/benchmarks.md); consecutive versions differ in one tenant's entry.

    Why it is the same set. The changed entries are parsed from their own text with the loader's
    strict JSON rules and validated as a whole parse validates them, the set is assembled from
    those and `base`'s parts and validated at the set level (`checked_edit`'s two steps), and
    then its canonical JSON, assembled from its parts, must be `document` itself, character for
    character: a reader parses exactly that text, the parse of every part is determined by its
    text, and the set level by the parts and the scalars."""
    if set(type(base).model_fields) != _FIELDS or not _plain_scalars(base):
        return None
    layout = _tenant_items(base, parts)
    if document == layout.document and _sorted(base):
        return base  # else (a base parsed from a text in another order): whole, or rebuilt below
    span = _changed_items(layout, document)
    if span is None:
        return None  # a change outside the tenants (the default, the groups, the epoch)
    lo, hi, replaced = span
    segment = document[lo : len(document) - (len(layout.document) - hi)]
    try:
        result = _with_entries(base, replaced, "{" + segment + "}", parts)
    except (ValidationError, ValueError, TypeError, RecursionError):
        return None
    return result if parts.document(result) == document else None


class _Layout(NamedTuple):
    """A set's canonical JSON, where its tenants map's items start (just after its `{`) and end
    (its `}`), and each `"key":{...}` item's span."""

    document: str
    open_at: int
    close_at: int
    items: list[tuple[str, int, int]]


def _changed_items(layout: _Layout, document: str) -> tuple[int, int, set[str]] | None:
    """The span of `layout.document` made of whole tenant items that covers every character where
    `document` differs from it, and those items' keys; None if a difference lies outside the
    tenants map. `document` is `layout.document` with that span replaced."""
    base = layout.document
    first = _common_prefix(base, document)
    tail = _common_suffix(base, document, min(len(base), len(document)) - first)
    changed_end = len(base) - tail  # base[first:changed_end] differs from document's
    if first < layout.open_at or changed_end > layout.close_at:
        return None
    items = layout.items
    if not items:
        return layout.open_at, layout.close_at, set()
    # From the last item starting at or before the change to the first ending at or after it
    # (every separator in between is inside that span).
    i0 = max((i for i, (_, start, _) in enumerate(items) if start <= first), default=0)
    i1 = next((i for i, (_, _, end) in enumerate(items) if end >= changed_end), len(items) - 1)
    i1 = max(i0, i1)
    return items[i0][1], items[i1][2], {key for key, _, _ in items[i0 : i1 + 1]}


def _with_entries(
    base: PolicySet, replaced: set[str], text: str, parts: CanonicalParts
) -> PolicySet:
    """`base` with the entries named `replaced` replaced by those in `text` (a JSON object of
    tenant entries), parsed as the loader parses them; ValueError on a key given twice."""
    data = load_json(text)
    kept = {key: part for key, part in base.tenants.items() if key not in replaced}
    if kept.keys() & data.keys():
        raise ValueError("duplicate key")
    fresh = {key: _entry(key, value, base, parts) for key, value in data.items()}
    scalars = json.loads(
        _json({"version": base.version, "epoch": base.epoch}), parse_constant=_refuse_constant
    )
    return PolicySet.model_validate(
        {
            **scalars,
            "default": base.default,
            "tenants": dict(sorted({**kept, **fresh}.items())),
            "share_groups": dict(sorted(base.share_groups.items())),
        }
    )


def _sorted(policy_set: PolicySet) -> bool:
    """Whether the set's maps are in key order, as a reader's parse of canonical JSON has them."""
    return list(policy_set.tenants) == sorted(policy_set.tenants) and list(
        policy_set.share_groups
    ) == sorted(policy_set.share_groups)


def _entry(key: str, value: Any, base: PolicySet, parts: CanonicalParts) -> TenantPolicy:
    """A tenant's entry as parsed from its text: the base's own object if its text is the same."""
    old = base.tenants.get(key)
    if old is not None and parts.fragment(old) == _json(value):
        return old
    return TenantPolicy.model_validate(value)


def _tenant_items(base: PolicySet, parts: CanonicalParts) -> _Layout:
    """`base`'s canonical JSON as `CanonicalParts.document` assembles it, and where its tenants
    are in it."""
    head = parts.head(base)
    texts = parts.items(base.tenants)
    items: list[tuple[str, int, int]] = []
    at = len(head)
    for key, text in zip(sorted(base.tenants), texts, strict=True):
        items.append((key, at, at + len(text)))
        at += len(text) + 1  # the comma
    body = ",".join(texts)
    document = head + body + "}" + parts.tail(base)
    return _Layout(document, len(head), len(head) + len(body), items)
