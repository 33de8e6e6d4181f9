"""`/v1/audit` on SQLite and PostgreSQL, over real ledger entries: engine events under scope tags that
an engine registered for acme and globex, plus the API's own admin actions. Tenant admins see only
their tenant's entries; proofs verify; the streamed export passes `kvguard verify`."""

from __future__ import annotations

import base64
import io
import json
import tarfile
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from kvguard.audit import bundle, merkle, note
from kvguard.audit.checkpoint import Checkpoint, format_checkpoint, parse_checkpoint
from kvguard.audit.cli import verify_command
from kvguard.audit.events import AuditEvent
from kvguard.audit.signing import SigningKey
from tests.api.conftest import ApiEnv

T0 = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)
TAGS = {"acme": ["st_acme_a", "st_acme_b"], "globex": ["st_globex_a"]}


def _seed(env: ApiEnv) -> dict[str, Any]:
    """Engine events of both tenants (and one untagged), registered tags, two API actions."""
    s = env.services
    s.engines.register("e1", model="m", block_size=16, num_blocks=64, now=0.0)
    pairs = [(tag, tenant) for tenant, tags in TAGS.items() for tag in tags]
    s.engines.heartbeat("e1", now=1.0, totals={}, tenants=(), new_tags=pairs)
    tags = [*TAGS["acme"], *TAGS["globex"], None]
    kinds = ["block.alloc", "block.reuse", "block.release", "block.zeroize"]
    events = [
        AuditEvent(
            kind=kinds[i % 4],
            scope_tag=tags[i % 4],
            request_id=f"req-{i // 4}",
            block_ids=[i, 100 + i % 5],
            details={"blocks": 2},
            ts=T0 + timedelta(seconds=i),
        )
        for i in range(40)
    ]
    s.ledger.append_many(events)
    # the API's own entries: admin.action with the tenant's tt_ tag (and a policy.change)
    policy = env.call("acme", "GET", "/v1/tenants/acme/policy").json()["policy"]
    assert (
        env.call(
            "acme", "PUT", "/v1/tenants/acme/policy", json={"policy": policy, "reason": "r"}
        ).status_code
        == 201
    )
    assert (
        env.call("admin", "POST", "/v1/tenants", json={"tenant_id": "initech"}).status_code == 201
    )
    return {"events": events, "tt_acme": s.deriver.tenant_tag("acme")}


def _all(env: ApiEnv, who: str, **params: Any) -> list[dict[str, Any]]:
    """Every entry, following `next_cursor` in pages of 3."""
    out: list[dict[str, Any]] = []
    cursor = None
    while True:
        query = {**params, "limit": 3, **({"cursor": cursor} if cursor is not None else {})}
        r = env.call(who, "GET", "/v1/audit/entries", params=query)
        assert r.status_code == 200, r.text
        out += r.json()["entries"]
        cursor = r.json()["next_cursor"]
        if cursor is None:
            return out


def test_entries_filters_and_cursor_pages(make_env: Callable[..., ApiEnv], any_db: str) -> None:
    env = make_env(any_db)
    seeded = _seed(env)
    everything = _all(env, "auditor")
    assert [e["index"] for e in everything] == list(range(env.services.ledger.size))
    first = everything[0]
    assert first["ts"] == "2026-11-26T12:00:00.000000Z" and first["block_ids"] == [0, 100]
    assert first["payload"] is None and first["payload_erased"] is False
    kinds = {e["kind"] for e in _all(env, "admin", kind=["block.reuse", "block.zeroize"])}
    assert kinds == {"block.reuse", "block.zeroize"}
    acme = _all(env, "auditor", tenant_id="acme")
    assert {e["scope_tag"] for e in acme} == {*TAGS["acme"], seeded["tt_acme"]}
    action = next(e for e in acme if e["kind"] == "admin.action")
    assert action["payload"] == {"tenant_id": "acme"}  # erasable detail, shown to the tenant
    window = _all(env, "auditor", since="2026-11-26T12:00:10Z", until="2026-11-26T13:00:13+01:00")
    assert [e["index"] for e in window] == [10, 11, 12]
    assert [e["index"] for e in _all(env, "auditor", request_id="req-2")] == [8, 9, 10, 11]
    assert [e["index"] for e in _all(env, "auditor", block_id=103)] == [
        3,
        8,
        13,
        18,
        23,
        28,
        33,
        38,
    ]
    assert _all(env, "auditor", tenant_id="nobody") == []
    r = env.call("auditor", "GET", "/v1/audit/entries", params={"cursor": 37, "limit": 1000})
    assert [e["index"] for e in r.json()["entries"]] == list(range(38, env.services.ledger.size))


def test_tenant_admin_sees_only_its_tenants_entries(
    make_env: Callable[..., ApiEnv], any_db: str
) -> None:
    env = make_env(any_db)
    seeded = _seed(env)
    own = _all(env, "acme")
    assert own and {e["scope_tag"] for e in own} == {*TAGS["acme"], seeded["tt_acme"]}
    assert _all(env, "acme", tenant_id="acme") == own
    r = env.call("acme", "GET", "/v1/audit/entries", params={"tenant_id": "globex"})
    assert r.status_code == 404
    globex_entry = next(e for e in _all(env, "auditor", tenant_id="globex"))
    untagged = 3  # scope_tag None: engine-wide, not any tenant's
    for index in (globex_entry["index"], untagged, 10_000):
        r = env.call("acme", "GET", f"/v1/audit/entries/{index}")
        assert r.status_code == 404 and r.json()["message"] == f"entry {index} not found"
    assert env.call("acme", "GET", f"/v1/audit/entries/{own[0]['index']}").status_code == 200
    assert env.call("globex", "GET", f"/v1/audit/entries/{own[0]['index']}").status_code == 404


def _verify_entry_proof(body: dict[str, Any]) -> None:
    leaf = base64.b64decode(body["leaf"])
    proof = [base64.b64decode(h) for h in body["inclusion_proof"]]
    root = base64.b64decode(body["root"])
    index, size = body["entry"]["index"], body["tree_size"]
    merkle.verify_inclusion(index, size, merkle.leaf_hash(leaf), proof, root)
    assert json.loads(leaf)["kind"] == body["entry"]["kind"]


def test_entry_inclusion_proof_against_the_latest_checkpoint(
    make_env: Callable[..., ApiEnv], any_db: str
) -> None:
    env = make_env(any_db)
    _seed(env)
    assert env.call("admin", "POST", "/v1/audit/checkpoints").status_code == 200
    signed_size = env.services.ledger.size  # it covers its own admin.action, the last entry
    env.services.ledger.append(AuditEvent(kind="block.alloc", scope_tag="st_acme_a", ts=T0))
    body = env.call("auditor", "GET", "/v1/audit/entries/5").json()
    _verify_entry_proof(body)
    assert body["tree_size"] == signed_size
    assert env.signing_key is not None
    cp = parse_checkpoint(note.open_note(body["checkpoint"], [env.signing_key.verifier()])[0])
    assert (cp.size, base64.b64encode(cp.root).decode()) == (signed_size, body["root"])
    # newer than the latest checkpoint: proved against the current tree, no signed note
    newest = env.services.ledger.size - 1
    body = env.call("auditor", "GET", f"/v1/audit/entries/{newest}").json()
    _verify_entry_proof(body)
    assert body["checkpoint"] is None and body["tree_size"] == newest + 1
    # an explicit tree size, with the stored checkpoint of that size when there is one
    body = env.call("auditor", "GET", "/v1/audit/entries/5", params={"tree_size": 7}).json()
    _verify_entry_proof(body)
    assert (body["tree_size"], body["checkpoint"]) == (7, None)
    r = env.call("auditor", "GET", "/v1/audit/entries/5", params={"tree_size": signed_size})
    assert r.json()["checkpoint"] is not None
    for bad in (5, newest + 2):
        r = env.call("auditor", "GET", "/v1/audit/entries/5", params={"tree_size": bad})
        assert r.status_code == 422 and "tree_size" in r.json()["message"]


def test_checkpoints_history_and_consistency(make_env: Callable[..., ApiEnv], any_db: str) -> None:
    env = make_env(any_db)
    assert env.call("auditor", "GET", "/v1/audit/checkpoints/latest").status_code == 404
    _seed(env)
    assert env.call("auditor", "POST", "/v1/audit/checkpoints").status_code == 403
    first = env.call("admin", "POST", "/v1/audit/checkpoints").json()
    env.services.ledger.append_many(
        [AuditEvent(kind="block.alloc", scope_tag="st_acme_a", ts=T0) for _ in range(9)]
    )
    second = env.call("admin", "POST", "/v1/audit/checkpoints").json()
    assert second["prev_size"] == first["tree_size"] < second["tree_size"]
    for who in ("admin", "auditor", "acme"):  # checkpoints carry no tenant data
        latest = env.call(who, "GET", "/v1/audit/checkpoints/latest").json()
        assert latest == second
    page = env.call("acme", "GET", "/v1/audit/checkpoints", params={"limit": 1}).json()
    assert page["checkpoints"] == [first] and page["next_cursor"] == first["tree_size"]
    rest = env.call(
        "acme", "GET", "/v1/audit/checkpoints", params={"cursor": page["next_cursor"]}
    ).json()
    assert rest == {"checkpoints": [second], "next_cursor": None}
    old, new = first["tree_size"], second["tree_size"]
    body = env.call("globex", "GET", "/v1/audit/consistency", params={"old_size": old}).json()
    assert body["new_size"] == new  # default: the latest checkpoint
    proof = [base64.b64decode(h) for h in body["proof"]]
    roots = [base64.b64decode(c["root"]) for c in (first, second)]
    merkle.verify_consistency(old, new, roots[0], roots[1], proof)
    for params, field in (
        ({"old_size": 0}, "query.old_size"),
        ({"old_size": new, "new_size": old}, "query.old_size"),
        ({"old_size": 1, "new_size": env.services.ledger.size + 1}, "query.new_size"),
    ):
        r = env.call("auditor", "GET", "/v1/audit/consistency", params=params)
        assert r.status_code == 422 and field in r.json()["message"], (params, r.text)
    actions = env.services.ledger.query(kinds=["admin.action"], limit=100).records
    done = [(r.event.details["action"], r.event.details["outcome"]) for r in actions]
    assert done.count(("audit.checkpoint", "ok")) == 2 and ("audit.checkpoint", "denied") in done


@pytest.mark.parametrize(
    ("path", "params", "field"),
    [
        ("/v1/audit/entries", {"since": "yesterday"}, "query.since"),
        ("/v1/audit/entries", {"until": "2026-11-26T12:00:00"}, "query.until"),  # no zone
        ("/v1/audit/entries", {"limit": 0}, "query.limit"),
        ("/v1/audit/entries", {"limit": 1001}, "query.limit"),
        ("/v1/audit/entries", {"cursor": -1}, "query.cursor"),
        ("/v1/audit/entries", {"kind": "block.teleport"}, "query.kind"),
        ("/v1/audit/entries", {"block_id": -3}, "query.block_id"),
        ("/v1/audit/entries", {"tenant_id": "a/b"}, "query.tenant_id"),
        ("/v1/audit/entries/-1", {}, "path.index"),
        ("/v1/audit/checkpoints", {"limit": 0}, "query.limit"),
        ("/v1/audit/export", {"since": "2026-13-01T00:00:00Z"}, "query.since"),
        ("/v1/audit/export", {"format": "zip"}, "query.format"),
    ],
)
def test_invalid_parameters_are_422_naming_the_field(
    env: ApiEnv, path: str, params: dict[str, Any], field: str
) -> None:
    r = env.call("auditor", "GET", path, params=params)
    assert r.status_code == 422, r.text
    assert field in r.json()["message"]
    if path.endswith("/export"):  # audited: the refusal is recorded as invalid, not failed
        action = env.services.ledger.query(kinds=["admin.action"]).records[-1].event
        assert (action.details["action"], action.details["outcome"]) == ("audit.export", "invalid")


def _unpack(data: bytes, into: Path, gz: bool = False) -> Path:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz" if gz else "r:") as tar:
        (top,) = {n.split("/")[0] for n in tar.getnames()}
        tar.extractall(into, filter="data")
    return into / top


def _verify(directory: Path, env: ApiEnv, *extra: str) -> None:
    """`kvguard verify DIR --key VKEY`: the command itself, without `kvguard`'s callback, which
    would point the process's logging at CliRunner's stream (closed after the call)."""
    assert env.signing_key is not None
    cli = typer.Typer()
    cli.callback()(lambda: None)  # a group, so that `verify` stays a named subcommand
    cli.command("verify")(verify_command)
    args = ["verify", str(directory), "--key", env.signing_key.verifier_key(), *extra]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output


def _entries(directory: Path) -> list[dict[str, Any]]:
    lines = (directory / bundle.ENTRIES).read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["event"] for line in lines]


def test_streamed_export_passes_the_offline_verifier(
    make_env: Callable[..., ApiEnv], any_db: str, tmp_path: Path
) -> None:
    env = make_env(any_db)
    _seed(env)
    env.call("admin", "POST", "/v1/audit/checkpoints")  # an older checkpoint: consistency.jsonl
    size_before = env.services.ledger.size
    r = env.call("auditor", "GET", "/v1/audit/export")
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-tar"
    assert r.headers["content-disposition"] == (
        f'attachment; filename="kvguard-audit-{size_before}.tar"'
    )
    bundle_dir = _unpack(r.content, tmp_path / "all")
    _verify(bundle_dir, env, "--full")  # complete: the root is recomputed from every leaf
    assert sorted(p.name for p in bundle_dir.iterdir()) == [
        bundle.CHECKPOINT,
        bundle.CONSISTENCY,
        bundle.ENTRIES,
        "manifest",
        "payloads.jsonl",
    ]
    assert len(_entries(bundle_dir)) == size_before
    # recorded before the stream started, naming the tree the bundle covers
    record = env.services.ledger.query(after=size_before - 1).records[0].event
    assert record.kind == "admin.action" and record.details["action"] == "audit.export"
    assert record.details["tree_size"] == size_before and record.details["entries"] is None
    gz = env.call(
        "admin", "GET", "/v1/audit/export", params={"format": "tar.gz", "kind": "block.alloc"}
    )
    assert gz.headers["content-type"] == "application/gzip"
    packed = _unpack(gz.content, tmp_path / "gz", gz=True)
    _verify(packed, env)
    assert {e["kind"] for e in _entries(packed)} == {"block.alloc"}


def test_tenant_export_holds_only_that_tenants_entries(
    make_env: Callable[..., ApiEnv], any_db: str, tmp_path: Path
) -> None:
    env = make_env(any_db)
    seeded = _seed(env)
    acme_tags = {*TAGS["acme"], seeded["tt_acme"]}
    r = env.call("acme", "GET", "/v1/audit/export", params={"since": "2026-11-26T12:00:05Z"})
    assert r.status_code == 200
    own = _unpack(r.content, tmp_path / "acme")
    _verify(own, env)
    events = _entries(own)
    assert events and {e["scope_tag"] for e in events} <= acme_tags
    assert "st_acme_b" in {e["scope_tag"] for e in events}
    assert not any("globex" in json.dumps(e) for e in events)
    # the same export by an auditor, by tenant, matches line for line
    r2 = env.call("auditor", "GET", "/v1/audit/export", params={"tenant_id": "acme"})
    assert {e["scope_tag"] for e in _entries(_unpack(r2.content, tmp_path / "aud"))} <= acme_tags
    assert (
        env.call("acme", "GET", "/v1/audit/export", params={"tenant_id": "globex"}).status_code
        == 404
    )
    actions = env.services.ledger.query(kinds=["admin.action"], limit=100).records
    exports = [r.event for r in actions if r.event.details["action"] == "audit.export"]
    assert [e.details["outcome"] for e in exports] == ["ok", "ok", "not_found"]
    assert exports[0].scope_tag == seeded["tt_acme"] and exports[0].details["since"] == (
        "2026-11-26T12:00:05.000000Z"
    )


def test_checkpoint_routes_serve_only_checkpoints_this_log_signed(
    make_env: Callable[..., ApiEnv], any_db: str
) -> None:
    """Whoever may write the database can insert a checkpoint row (the append guards check its
    size, not its signature): a row signed by another key at the current tree size is never
    served as the latest checkpoint, as the one an entry is proved against, or as the default
    end of a consistency proof; asked for by size, the entry is proved against the computed
    root with no note (found by a re-test: the planted note and its made-up root were served)."""
    env = make_env(any_db)
    _seed(env)
    ours = env.call("admin", "POST", "/v1/audit/checkpoints").json()
    ledger = env.services.ledger
    ledger.append_many([AuditEvent(kind="block.alloc", scope_tag="st_acme_a", ts=T0)] * 3)
    size = ledger.size
    stranger = SigningKey.generate(ledger.origin)
    made_up = b"\x07" * 32
    text = format_checkpoint(Checkpoint(ledger.origin, size, made_up))
    with ledger.store.engine.begin() as conn:
        planted = note.join_note(text, [stranger.signature_line(text)])
        ledger.store.insert_checkpoint(conn, size, made_up, planted, ours["tree_size"])
    listed = env.call("auditor", "GET", "/v1/audit/checkpoints").json()["checkpoints"]
    assert [c["tree_size"] for c in listed] == [ours["tree_size"], size]  # stored, listed as is
    assert env.call("auditor", "GET", "/v1/audit/checkpoints/latest").json() == ours
    body = env.call("auditor", "GET", "/v1/audit/consistency", params={"old_size": 1}).json()
    assert body["new_size"] == ours["tree_size"]
    body = env.call("auditor", "GET", "/v1/audit/entries/2").json()
    _verify_entry_proof(body)
    assert (body["tree_size"], body["checkpoint"]) == (ours["tree_size"], ours["note"])
    body = env.call("auditor", "GET", "/v1/audit/entries/2", params={"tree_size": size}).json()
    _verify_entry_proof(body)
    assert body["checkpoint"] is None and base64.b64decode(body["root"]) == ledger.root(size)
    newer = env.call("admin", "POST", "/v1/audit/checkpoints").json()  # signing goes on
    assert newer["tree_size"] == size + 1
    assert env.call("auditor", "GET", "/v1/audit/checkpoints/latest").json() == newer


def test_a_retired_keys_checkpoint_is_served_with_its_true_root_and_a_misconfigured_one_is_503(
    make_env: Callable[..., ApiEnv], any_db: str
) -> None:
    """After a finished key rotation the newest checkpoint may be the retired key's: it is still
    served when the stored tree reproduces its root (the reader checks the note with the key it
    holds), as the exporter keeps it. A row this log's own key signed for another origin is a
    misconfiguration the reads answer 503 for, not a 400 that says "refusing to sign"."""
    env = make_env(any_db)
    _seed(env)
    ours = env.call("admin", "POST", "/v1/audit/checkpoints").json()
    ledger = env.services.ledger
    ledger.append_many([AuditEvent(kind="block.alloc", scope_tag="st_acme_a", ts=T0)] * 2)
    size, retired = ledger.size, SigningKey.generate(ledger.origin)
    text = format_checkpoint(Checkpoint(ledger.origin, size, ledger.root(size)))
    with ledger.store.engine.begin() as conn:
        signed = note.join_note(text, [retired.signature_line(text)])
        ledger.store.insert_checkpoint(conn, size, ledger.root(size), signed, ours["tree_size"])
    latest = env.call("auditor", "GET", "/v1/audit/checkpoints/latest").json()
    assert (latest["tree_size"], latest["note"]) == (size, signed)
    note.open_note(latest["note"], [retired.verifier()])  # the retired key's holder checks it
    body = env.call("auditor", "GET", "/v1/audit/entries/2", params={"tree_size": size}).json()
    _verify_entry_proof(body)
    assert body["checkpoint"] == signed
    ledger.append(AuditEvent(kind="block.alloc", scope_tag="st_acme_a", ts=T0))
    other = format_checkpoint(Checkpoint("other.example/log", size + 1, ledger.root(size + 1)))
    with ledger.store.engine.begin() as conn:
        ledger.store.insert_checkpoint(
            conn, size + 1, ledger.root(size + 1), ledger.sign_note(other), size
        )
    for path in ("/v1/audit/checkpoints/latest", "/v1/audit/entries/2"):
        r = env.call("auditor", "GET", path)
        assert (r.status_code, r.json()["error"]) == (503, "unavailable"), r.text
