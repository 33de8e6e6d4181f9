"""Retention and sharing policy.

Owns: policy models, their validation, the versioned policy store, and pure decision functions (admit,
may-reuse, expired, must-zeroize, quota). Never touches tensors and never writes the ledger directly (the
store offers a hook the ledger subscribes to).
"""
