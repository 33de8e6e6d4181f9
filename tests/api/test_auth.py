"""Admin API keys: shown once, stored as scrypt, constant-time checked, revocable, rate-limited."""

from __future__ import annotations

import sqlalchemy as sa
import structlog

from kvguard.api.auth import ApiKeyRow, ApiKeys, FailureLimiter, Role
from kvguard.errors import ConfigError, NotFoundError
from tests.api.conftest import ApiEnv


def test_keys_are_stored_only_as_scrypt_hashes(env: ApiEnv) -> None:
    issued = env.services.keys.create(Role.AUDITOR, label="ci")
    secret = issued.api_key.rsplit("_", 1)[1]
    with env.services.db.connect() as conn:
        rows = conn.execute(sa.select(ApiKeyRow)).all()
    dumped = repr([tuple(r) for r in rows])
    assert secret not in dumped and issued.api_key not in dumped
    row = next(r for r in rows if r.key_id == issued.principal.key_id)
    assert len(row.secret_scrypt) == 32 and row.role == "auditor"


def test_authenticate_accepts_the_key_and_nothing_close_to_it(env: ApiEnv) -> None:
    keys: ApiKeys = env.services.keys
    issued = keys.create(Role.ADMIN)
    assert keys.authenticate(issued.api_key) == issued.principal
    flipped = issued.api_key[:-1] + ("A" if issued.api_key[-1] != "A" else "B")
    for bad in (flipped, issued.api_key + "x", "", None, "Bearer x", issued.api_key.upper()):
        assert keys.authenticate(bad) is None
    # The verified-key cache must not accept a different secret for the same key id.
    assert keys.authenticate(flipped) is None


def test_a_second_process_verifies_with_scrypt_not_its_cache(env: ApiEnv) -> None:
    issued = env.services.keys.create(Role.AUDITOR)
    other = ApiKeys(env.services.db)
    assert other.authenticate(issued.api_key) == issued.principal


def test_revoked_keys_fail_at_once_even_when_cached(env: ApiEnv) -> None:
    keys = env.services.keys
    issued = keys.create(Role.ADMIN)
    assert env.client.get("/v1/tenants", headers=_bearer(issued.api_key)).status_code == 200
    keys.revoke(issued.principal.key_id)
    assert env.client.get("/v1/tenants", headers=_bearer(issued.api_key)).status_code == 401
    try:
        keys.revoke(issued.principal.key_id)
    except NotFoundError:
        pass
    else:
        raise AssertionError("revoking twice must say the key is not active")


def test_tenant_admin_keys_need_a_tenant_and_others_must_not_have_one(env: ApiEnv) -> None:
    for role, tenant in ((Role.TENANT_ADMIN, None), (Role.ADMIN, "acme"), (Role.AUDITOR, "acme")):
        try:
            env.services.keys.create(role, tenant_id=tenant)
        except ConfigError:
            continue
        raise AssertionError(f"{role} with tenant {tenant} was accepted")


def test_missing_and_bad_keys_get_401_with_a_bearer_challenge(env: ApiEnv) -> None:
    for headers in (
        {},
        {"Authorization": "Basic abc"},
        _bearer("kvg_adm_000000000000_" + "a" * 43),
    ):
        r = env.client.get("/v1/tenants", headers=headers)
        assert r.status_code == 401
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"] == "unauthenticated"


def test_failed_authentications_are_rate_limited_per_client(make_env) -> None:  # type: ignore[no-untyped-def]
    env = make_env(auth_max_failures=3, auth_window_s=60.0)
    for _ in range(3):
        assert env.client.get("/v1/tenants", headers=_bearer("nope")).status_code == 401
    limited = env.client.get("/v1/tenants", headers=env.headers("admin"))
    assert limited.status_code == 429  # even a good key waits: the client is locked out
    assert int(limited.headers["retry-after"]) >= 1


def test_failure_limiter_window_moves_on() -> None:
    now = [0.0]
    limiter = FailureLimiter(max_failures=2, window_s=10.0, clock=lambda: now[0])
    limiter.failed("a")
    limiter.failed("a")
    assert limiter.retry_after("a") == 10.0
    assert limiter.retry_after("b") == 0.0
    now[0] = 10.5
    assert limiter.retry_after("a") == 0.0


def test_failed_auth_is_logged_without_the_key(env: ApiEnv) -> None:
    attempt = "kvg_adm_0123456789ab_" + "Z" * 43
    with structlog.testing.capture_logs() as logs:
        env.client.get("/v1/tenants", headers=_bearer(attempt))
    assert any(e["event"] == "authentication failed" for e in logs)
    assert attempt not in repr(logs) and "Z" * 20 not in repr(logs)


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
