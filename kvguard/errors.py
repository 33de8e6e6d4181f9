"""One exception hierarchy for kvguard.

Security checks raise from here instead of returning booleans (STYLE.md, habit 4), so a caller cannot
forget to look at a result. Messages name what is wrong and where, and never carry secret material: an
error string may end up in a log line, an HTTP response or an audit export (G6).
"""

from __future__ import annotations

import re
from typing import Final

# What a secret pasted into a document looks like: kvguard's API keys, or a run of token characters
# longer than any name (tenant ids, field names and tags have at most 64).
_SECRET_SHAPED: Final = re.compile(r"kvg_[A-Za-z0-9_-]{16,}|[A-Za-z0-9_+/=-]{65,}")
REDACTED_PART: Final = "<redacted>"


def mask_secrets(text: str) -> str:
    """`text` with every secret-shaped run (`_SECRET_SHAPED`) replaced by `REDACTED_PART`: for
    messages that quote a document back to its author (a key pasted as a field name)."""
    return _SECRET_SHAPED.sub(REDACTED_PART, text)


class KvguardError(Exception):
    """Base class of every error kvguard raises on purpose."""


class ConfigError(KvguardError):
    """Settings or secret files are missing, malformed or unsafe."""


class SchemaVersionError(ConfigError):
    """The database schema is at a revision this release cannot use: one made by a newer release,
    or one this release must migrate but the connecting role may not (it has no DDL)."""


class SecretFileError(ConfigError):
    """A secret file is missing, unreadable or readable by group/others."""


class FailClosedError(KvguardError):
    """kvguard refuses new work because a precondition of safe operation is missing (G7)."""


class IsolationError(KvguardError):
    """A scope, salt or key operation was refused."""


class ScopeError(IsolationError):
    """A scope is incomplete or inconsistent (e.g. share='session' without a session id)."""


class UntrustedSaltError(IsolationError):
    """A caller tried to supply its own cache salt; salts are derived server-side only (G1)."""


class UnknownKeyError(IsolationError):
    """A key id named in a salt or keyring lookup is not in the keyring."""


class PolicyError(KvguardError):
    """A policy document is invalid or a policy operation was refused."""


class PolicyValidationError(PolicyError):
    """A policy document failed validation. `problems` lists (field path, message) pairs."""

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        self.source = source
        # The paths and messages quote the document (its keys, YAML tags, short values): a secret
        # pasted into it is masked, as the API masks it in a request body's field paths (found by
        # a review: the dashboard's policy form echoed an API key given as a field name).
        problems = [(mask_secrets(path), mask_secrets(msg)) for path, msg in problems]
        self.problems = problems
        lines = [f"{source}: {path}: {msg}" for path, msg in problems]
        super().__init__("\n".join(lines) if lines else f"{source}: invalid policy")


class PolicyStoreError(PolicyError):
    """The policy store could not read or write a version."""


class PolicyVersionConflictError(PolicyStoreError):
    """A write expected the store to be at one version and found another (someone wrote first)."""


class AuditError(KvguardError):
    """Base of audit ledger errors."""


class SensitiveFieldError(AuditError):
    """An audit event carried a field that looks like token ids, prompts, salts or key material (G6)."""


class LedgerUnavailableError(AuditError, FailClosedError):
    """The ledger cannot accept entries and its buffer is full: refuse work rather than lose evidence."""


class AppendOnlyViolationError(AuditError):
    """Something tried to change or remove ledger history."""


class VerificationError(AuditError):
    """A proof, signature, checkpoint or export failed to verify.

    One opaque family for every verification failure (pyca/cryptography habit); the message says which
    entry or line failed and why, never what secret was involved.
    """


class LogRewrittenError(VerificationError, AppendOnlyViolationError):
    """The stored audit log no longer extends a checkpoint it signed: history was removed or changed.

    Both a verification failure and an append-only violation, so handlers of either catch it.
    """


class ZeroizeError(KvguardError):
    """A zeroization could not be planned or executed."""


class CacheLayoutError(ZeroizeError):
    """A KV cache tensor does not match the layout it was described with."""


class ZeroizeVerificationError(ZeroizeError):
    """A block was not all-zero after zeroization. Never reported as success (G2)."""


class BlockIdError(ZeroizeError):
    """A block id handed to the zeroize planner is not an integer in [0, num_blocks)."""


class OffloadError(KvguardError):
    """The offload tier cannot store or serve a block."""


class OffloadKeyError(OffloadError):
    """An offload data key cannot be used (shredded epoch, exhausted nonce counter)."""


class TierAuthError(OffloadError):
    """An offloaded block failed authentication (tampered, moved or corrupted): recompute it."""


class TierReadError(OffloadError):
    """An offloaded block's file could not be read (an I/O error): recompute it."""


class CustodyError(KvguardError):
    """The block custody state machine refused a transition or found a broken invariant (G4)."""


class AdmissionError(KvguardError):
    """A request was refused by policy (quota, disabled tenant, fail-closed)."""


class NotFoundError(KvguardError):
    """The named tenant, job, entry or version does not exist (or is not visible to the caller)."""


class ConflictError(KvguardError):
    """The request contradicts stored state (a tenant that already exists, a job not finished)."""


class AuthenticationError(KvguardError):
    """No valid API key. The message never contains the key."""


class PreconditionFailedError(ConflictError):
    """A write's precondition (`If-Match`, `expected_version`) does not hold: someone wrote first."""


class PreconditionRequiredError(ConflictError):
    """A write that must name the version it edits (`If-Match`, `expected_version`) did not."""


class PermissionDeniedError(KvguardError):
    """The caller's role does not allow the action."""
