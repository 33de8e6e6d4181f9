"""The compliance admin API (FastAPI).

Owns: authentication and authorization, tenant, policy, purge, cache-state and audit endpoints, the
metrics endpoint. Never reaches into an engine process: it talks to engines through the database.
"""
