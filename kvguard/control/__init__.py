"""The control plane shared by the admin API and engine processes through the database.

Owns: the tenant registry, the engine registry and per-tenant cache statistics (and what each figure
means to Prometheus, `engine_metrics`), the scope-tag index.
Never holds secrets, salts, token ids or KV bytes; engines and the API share nothing else.
"""
