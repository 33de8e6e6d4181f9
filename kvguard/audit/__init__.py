"""The tamper-evident ledger.

Owns: the audit event schema, leaf encoding, the SQL store, the RFC 6962 Merkle tree and RFC 9162
proofs, C2SP signed checkpoints, export bundles, the offline verifier and queries. Never holds tenant
secrets or KV payloads.

Entry points: `kvguard.audit.events.AuditEvent`, `kvguard.audit.ledger.Ledger`,
`kvguard.audit.signing.SigningKey`, `kvguard.audit.offline.verify_bundle` and the Typer apps in
`kvguard.audit.cli`. This `__init__` imports nothing, so that the offline verifier can be imported
without SQLAlchemy or pydantic (docs/audit.md).
"""
