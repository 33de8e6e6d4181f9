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
from typing import Any, Final, TypeVar

from pydantic import BaseModel, ValidationError

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
        # Keys in sorted order at every level, as `json.dumps(sort_keys=True)` writes them.
        return (
            '{"default":'
            + self.fragment(policy_set.default)
            + ',"epoch":'
            + _json(policy_set.epoch)
            + ',"share_groups":'
            + self._mapping(policy_set.share_groups)
            + ',"tenants":'
            + self._mapping(policy_set.tenants)
            + ',"version":'
            + _json(policy_set.version)
            + "}"
        )

    def _mapping(self, parts: dict[str, TenantPolicy] | dict[str, ShareGroup]) -> str:
        items = sorted(parts.items())
        return "{" + ",".join(_json(key) + ":" + self.fragment(part) for key, part in items) + "}"


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
