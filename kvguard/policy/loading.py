"""Reading policy documents from YAML or JSON, with every problem reported at its field path.

Parsing is stricter than the formats: duplicate keys are refused (YAML and JSON parsers keep the last
one silently, so a second `acme:` block would quietly replace the first), YAML aliases are refused (a
policy is short and explicit; aliases make it neither and allow expansion bombs), an empty document is
refused rather than read as "all defaults" (an empty or truncated file fails closed, G7), and unknown
keys are refused by the models.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Final, Literal

import yaml
from pydantic import ValidationError

from kvguard.errors import PolicyValidationError
from kvguard.policy.models import INVARIANT_ERROR, STORED, PolicySet

Format = Literal["yaml", "json"]
Problem = tuple[str, str]

DOCUMENT: Final = "(document)"
MAX_POLICY_BYTES: Final = 1 << 20
_MESSAGES: Final = {
    "extra_forbidden": "unknown field (refused so that a typo cannot silently weaken policy)",
    "missing": "required field is missing",
}
_ECHO_INPUT: Final = frozenset({"enum", "literal_error"})
_TOO_MANY_DIGITS: Final = "integer with too many digits for a policy value"
_TOO_DEEP: Final = "nested too deeply to be a policy document"


class _DocumentError(Exception):
    """Internal: a problem with the document as a whole, before any field can be named."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses aliases and duplicate mapping keys."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
            raise yaml.composer.ComposerError(
                None, None, "aliases are not allowed in policy files", mark
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key is None or isinstance(key, bool):
                # YAML 1.1 reads unquoted `off`, `no`, `yes`, `on`, `null`, `~` as booleans / null:
                # a tenant named `off` would otherwise fail later as "not a valid string".
                raw = getattr(key_node, "value", "")
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key '{raw}' is read by YAML as {key!r}, not a name; quote it: '\"{raw}\"'",
                    key_node.start_mark,
                )
            if isinstance(key, str | int | float | bool) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key}'", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        # Python refuses to convert integers of more than `sys.get_int_max_str_digits()` digits
        # (a CPU-time defence, CVE-2020-10735) with a bare ValueError; no policy number is that long.
        try:
            return super().construct_yaml_int(node)
        except ValueError:
            raise yaml.constructor.ConstructorError(
                None, None, _TOO_MANY_DIGITS, node.start_mark
            ) from None


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)


def _format_for(source: str) -> Format:
    return "json" if source.lower().endswith(".json") else "yaml"


def _load_yaml(text: str) -> Any:
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise _DocumentError(f"{where}{exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise _DocumentError(f"not valid YAML ({type(exc).__name__})") from None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DocumentError(f"duplicate key '{key}'")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise _DocumentError(f"{name} is not a valid number in a policy")


def _json_int(digits: str) -> int:
    # As in YAML: a bare ValueError past Python's integer conversion limit (CVE-2020-10735).
    try:
        return int(digits)
    except ValueError:
        raise _DocumentError(_TOO_MANY_DIGITS) from None


def _load_json(text: str) -> Any:
    try:
        return json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constant,
            parse_int=_json_int,
        )
    except json.JSONDecodeError as exc:
        raise _DocumentError(f"line {exc.lineno}, column {exc.colno}: {exc.msg}") from None


def load_json(text: str) -> Any:
    """`text` as JSON under the loader's strict rules (duplicate keys, NaN / Infinity and integers
    past Python's conversion limit refused): ValueError naming the problem (for readers of parts
    of a stored document, `kvguard.policy.edits.reread`)."""
    try:
        return _load_json(text)
    except _DocumentError as exc:
        raise ValueError(str(exc)) from None


def parse_policy(
    text: str, source: str = "<string>", *, fmt: Format | None = None, stored: bool = False
) -> PolicySet:
    """Parse and validate a policy document. `fmt` defaults to JSON for `*.json`, YAML otherwise.
    `stored`: a version read back from the policy store, validated by the rules it was written
    under (`PolicySet._invariants`).

    Raises PolicyValidationError listing every problem as (field path, message).
    """
    try:
        data = _load_json(text) if (fmt or _format_for(source)) == "json" else _load_yaml(text)
    except _DocumentError as exc:
        raise PolicyValidationError(source, [(DOCUMENT, str(exc))]) from None
    except RecursionError:
        # Both parsers recurse once per nesting level; a hostile document (`[[[[...`) exhausts the
        # stack long before the 1 MiB size limit. The stack has unwound by the time we get here.
        raise PolicyValidationError(source, [(DOCUMENT, _TOO_DEEP)]) from None
    if data is None:
        raise PolicyValidationError(source, [(DOCUMENT, "empty policy document")])
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise PolicyValidationError(
            source, [(DOCUMENT, f"expected a mapping at the top, got {kind}")]
        )
    try:
        return PolicySet.model_validate(data, context={STORED: True} if stored else None)
    except ValidationError as exc:
        raise PolicyValidationError(source, validation_problems(exc)) from None
    except RecursionError:  # nesting shallow enough to parse, too deep to validate
        raise PolicyValidationError(source, [(DOCUMENT, _TOO_DEEP)]) from None


def load_policy_file(path: str | os.PathLike[str]) -> PolicySet:
    """Read and validate a policy file (YAML, or JSON when it ends in `.json`)."""
    source = os.fspath(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise PolicyValidationError(source, [("(file)", f"cannot read: {exc.strerror}")]) from None
    if len(raw) > MAX_POLICY_BYTES:
        raise PolicyValidationError(source, [("(file)", f"larger than {MAX_POLICY_BYTES} bytes")])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyValidationError(source, [("(file)", f"not UTF-8 (byte {exc.start})")]) from None
    return parse_policy(text, source)


def validation_problems(exc: ValidationError) -> list[Problem]:
    """pydantic errors as (dotted field path, message), invariant problems at their own field."""
    problems: list[Problem] = []
    for error in exc.errors(include_url=False):
        loc = ".".join(str(part) for part in error["loc"])
        ctx = error.get("ctx") or {}
        if error["type"] == INVARIANT_ERROR:
            problems.extend((_join(loc, rel), msg) for rel, msg in ctx["problems"])
            continue
        message = _MESSAGES.get(error["type"], error["msg"])
        value = error.get("input")
        if error["type"] in _ECHO_INPUT and isinstance(value, str) and len(value) <= 64:
            message = f"{message} (got '{value}')"
        problems.append((loc or DOCUMENT, message))
    return problems


def _join(prefix: str, rel: str) -> str:
    return f"{prefix}.{rel}" if prefix else rel
