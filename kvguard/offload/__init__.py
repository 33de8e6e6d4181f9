"""The governed offload tier (issue 15): KV blocks leaving the device, encrypted per reuse domain.

This package holds the tier's cryptographic core: per-domain, per-epoch data keys derived from the
salt keyring and shredded by destroying their epoch secret (`keys`), and the encrypted block store
with its byte budget, authenticated lookups and crypto-shredding (`tier`). The engine connector's
save / load hooks, the restore-or-recompute decision, policy and ledger events build on it
(docs/offload.md says what exists today).
"""

from kvguard.errors import OffloadKeyError, TierAuthError, TierReadError
from kvguard.offload.keys import DataKey, OffloadKeys, Shred
from kvguard.offload.tier import BlockAddress, EncryptedTier, Removal, ShredReport

__all__ = [
    "BlockAddress",
    "DataKey",
    "EncryptedTier",
    "OffloadKeyError",
    "OffloadKeys",
    "Removal",
    "Shred",
    "ShredReport",
    "TierAuthError",
    "TierReadError",
]
