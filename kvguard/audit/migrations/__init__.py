"""Alembic migration environment of the audit ledger (ships inside the wheel)."""
