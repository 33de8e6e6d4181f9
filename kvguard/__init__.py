"""kvguard: a multi-tenant security and governance layer for the paged KV caches of LLM serving engines.

See docs/architecture.md for the package map and the guarantees G1-G7.
"""

__version__ = "0.1.0"
