"""Admin API keys: shown once, stored as keyed hashes, constant-time checked, revocable,
rate-limited. The limiter's guarantees against lock-out and the request gate are in
test_hardening.py."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable

import sqlalchemy as sa
import structlog

from kvguard.api.auth import ApiKeys, FailureLimiter, Role, SharedFailures
from kvguard.control.schema import AdminKeyRow
from kvguard.errors import ConfigError, NotFoundError
from tests.api.conftest import ApiEnv


def test_keys_are_stored_only_as_keyed_hashes(env: ApiEnv) -> None:
    issued = env.services.keys.create(Role.AUDITOR, label="ci")
    secret = issued.api_key.removeprefix("kvg_adm_").split("_", 1)[1]  # may itself hold "_"
    with env.services.db.connect() as conn:
        rows = conn.execute(sa.select(AdminKeyRow)).all()
    dumped = repr([tuple(r) for r in rows])
    assert secret not in dumped and issued.api_key not in dumped
    row = next(r for r in rows if r.key_id == issued.principal.key_id)
    assert len(row.secret_hash) == 32 and row.secret_scrypt is None and row.role == "auditor"


def _legacy_key(env: ApiEnv, role: str, revoked_at: float | None = None) -> tuple[str, str, bytes]:
    """A key row as kvguard 0.1.0 stored it (an scrypt hash only): its id, secret and hash."""
    key_id, secret, salt = secrets.token_hex(6), secrets.token_urlsafe(32), secrets.token_bytes(16)
    scrypt = hashlib.scrypt(
        secret.encode(), salt=salt, n=1 << 14, r=8, p=1, maxmem=64 << 20, dklen=32
    )
    with env.services.db.begin() as conn:
        conn.execute(
            sa.insert(AdminKeyRow).values(
                key_id=key_id, salt=salt, secret_scrypt=scrypt, secret_hash=None, role=role,
                tenant_id=None, label="0.1.0", created_at=0.0, revoked_at=revoked_at,
            )
        )  # fmt: skip
    return key_id, secret, scrypt


def test_a_0_1_0_scrypt_key_still_authenticates_and_is_migrated(env: ApiEnv) -> None:
    """Keys issued by kvguard 0.1.0 carry only an scrypt hash: the first good check stores the
    HMAC and drops the scrypt hash; a wrong secret changes nothing."""
    key_id, secret, scrypt = _legacy_key(env, "auditor")
    keys: ApiKeys = env.services.keys
    api_key = f"kvg_adm_{key_id}_{secret}"
    assert keys.authenticate(api_key[:-1] + ("A" if api_key[-1] != "A" else "B")) is None

    def row() -> sa.Row:  # type: ignore[type-arg]
        with env.services.db.connect() as conn:
            return conn.execute(sa.select(AdminKeyRow).where(AdminKeyRow.key_id == key_id)).one()

    assert row().secret_scrypt == scrypt and row().secret_hash is None
    principal = keys.authenticate(api_key)
    assert principal is not None and principal.role is Role.AUDITOR
    assert row().secret_scrypt is None and row().secret_hash is not None
    assert keys.authenticate(api_key) == principal  # now by HMAC
    assert env.client.get("/v1/tenants", headers=_bearer(api_key)).status_code == 200


def test_a_revoked_0_1_0_key_costs_no_scrypt_check(env: ApiEnv, monkeypatch) -> None:
    """A revoked 0.1.0 key never authenticates again, so its row kept its scrypt hash for good and
    every guess at its id cost a 16 MiB, ~35 ms scrypt check, 429 or not (found by a review: 28
    guesses a second took valid requests from 1 ms to 535 ms). Refused with the ordinary work."""
    import kvguard.control.keys as keys_module  # noqa: PLC0415

    key_id, secret, _scrypt_hash = _legacy_key(env, "admin", revoked_at=1.0)
    calls: list[str] = []
    real = keys_module._scrypt
    monkeypatch.setattr(keys_module, "_scrypt", lambda *a: calls.append("scrypt") or real(*a))
    keys: ApiKeys = env.services.keys
    assert keys.authenticate(f"kvg_adm_{key_id}_{secret}") is None  # the right secret, revoked
    assert keys.authenticate(f"kvg_adm_{key_id}_" + "A" * 43) is None
    assert calls == []


def test_authenticate_accepts_the_key_and_nothing_close_to_it(env: ApiEnv) -> None:
    keys: ApiKeys = env.services.keys
    issued = keys.create(Role.ADMIN)
    assert keys.authenticate(issued.api_key) == issued.principal
    flipped = issued.api_key[:-1] + ("A" if issued.api_key[-1] != "A" else "B")
    for bad in (flipped, issued.api_key + "x", "", None, "Bearer x", issued.api_key.upper()):
        assert keys.authenticate(bad) is None
    assert keys.authenticate(issued.api_key) == issued.principal  # a failure changes nothing


def test_a_second_process_authenticates_the_same_keys(env: ApiEnv) -> None:
    issued = env.services.keys.create(Role.AUDITOR)
    other = ApiKeys(env.services.db)
    assert other.authenticate(issued.api_key) == issued.principal


def test_revoked_keys_fail_at_once(env: ApiEnv) -> None:
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
    limited = env.client.get("/v1/tenants", headers=_bearer("nope"))
    assert limited.status_code == 429
    assert int(limited.headers["retry-after"]) >= 1
    assert limited.json()["error"] == "rate_limited"
    # A good key from the same client is never held back (test_hardening.py has the details).
    assert env.client.get("/v1/tenants", headers=env.headers("admin")).status_code == 200


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


def test_the_failure_limit_holds_across_processes(
    make_env: Callable[..., ApiEnv], any_db: str
) -> None:
    """`kvguard serve --workers N`: each process counts failures in its own memory and, while that
    is under the limit, in the control database, so a guesser spreading its tries over the
    processes is limited after `max_failures` in all, not N times that (reviewer's finding). The
    shared window starts again once it has passed; a process already over its own limit answers
    429 without writing."""
    env = make_env(any_db)
    now = [1000.0]
    shared = SharedFailures(env.services.db, max_failures=4, window_s=60.0, clock=lambda: now[0])
    processes = [FailureLimiter(max_failures=4, window_s=60.0, shared=shared) for _ in range(3)]
    waits = [processes[n % 3].failure("10.0.0.9", "k1") for n in range(6)]
    assert waits[:4] == [0.0] * 4 and waits[4] == waits[5] == 60.0
    assert processes[0].failure("10.0.0.8") == 0.0  # another address, no key id: its own count
    now[0] += 61.0  # the shared window has passed; the processes' own windows have not filled
    assert processes[1].failure("10.0.0.9", "k1") == 0.0
    with env.services.db.connect() as conn:
        rows = dict(conn.execute(sa.text("SELECT subject, failures FROM auth_failures")).all())
    assert rows == {"addr:10.0.0.9": 1, "key:k1": 1, "addr:10.0.0.8": 1}


def test_failed_auth_logs_the_route_not_the_ids_in_the_path(env: ApiEnv) -> None:
    """The failure line named the raw path (`/v1/tenants/<tenant id>`): tenant and job ids are
    what the access log keeps out by logging the route's template, and so does this line."""
    with structlog.testing.capture_logs() as logs:
        env.client.get("/v1/tenants/someones-tenant/policy", headers=_bearer("kvg_adm_x_y"))
        env.client.get("/no/such/route/someones-tenant", headers=_bearer("kvg_adm_x_y"))
    failed = [e for e in logs if e["event"] == "authentication failed"]
    assert [e["path"] for e in failed] == ["/v1/tenants/{tenant_id}/policy", "unmatched"]
    assert "someones-tenant" not in repr(logs)
