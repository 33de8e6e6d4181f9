"""The tamper-evident ledger.

Owns: the audit event schema, leaf encoding, the SQL store, the RFC 6962 Merkle tree and RFC 9162
proofs, C2SP signed checkpoints, export bundles, the offline verifier and queries. Never holds tenant
secrets or KV payloads.
"""
