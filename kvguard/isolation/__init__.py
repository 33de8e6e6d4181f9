"""Scopes and the secrets that keep them apart.

Owns: scopes, their canonical domain-separated encoding, HMAC salt derivation, the keyring and key
rotation, scope tags (public pseudonyms of scopes) and salted block-hash chains for engines with no salt
support. Never touches tensors and never decides policy.
"""
