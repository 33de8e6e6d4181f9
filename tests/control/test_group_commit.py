"""Group commits of policy writes (`PolicyPublisher.publish_group`): consecutive versions, each an
edit of the one before it, stored in one transaction with every version's command and events; a
write that is refused leaves the group alone; the same checks (expected version, limits) as the
writes one at a time."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

from kvguard.control.db import open_engine
from kvguard.control.publish import PolicyBase, PolicyWrite
from kvguard.control.schema import EngineCommand
from kvguard.errors import PermissionDeniedError, PolicyVersionConflictError
from kvguard.policy import PolicySet
from kvguard.policy.store import PolicyChange, PolicyStore
from tests.control.test_publish import _events, _publish, _publisher, _rows, _set_ttl


def _write(tenant: str, ttl: int, **kw: object) -> PolicyWrite:
    return PolicyWrite(
        _set_ttl(tenant, ttl),
        author="key:a",
        reason="r",
        author_role=str(kw.pop("author_role", "admin")),
        events=_events,
        **kw,  # type: ignore[arg-type]
    )


def _ttls(db_url: str, version: int) -> dict[str, int]:
    policy = PolicyStore(open_engine(db_url)).get(version).policy
    return {t: p.retention.ttl_s for t, p in sorted(policy.tenants.items())}


def _command_seqs(db_url: str) -> list[tuple[int, str]]:
    engine = sa.create_engine(db_url)
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(EngineCommand.seq, EngineCommand.selector_value).order_by(EngineCommand.id)
        ).all()
    engine.dispose()
    return [(int(r.seq), r.selector_value) for r in rows]


def test_a_group_stores_consecutive_versions_each_over_the_one_before(db_url: str) -> None:
    publisher = _publisher(db_url)
    _publish(publisher, "acme", 100)
    outcomes = publisher.publish_group(
        [_write("globex", 200), _write("initech", 300), _write("acme", 150)]
    )
    assert [o.version for o in outcomes if isinstance(o, PolicyChange)] == [2, 3, 4]
    assert _ttls(db_url, 2) == {"acme": 100, "globex": 200}
    assert _ttls(db_url, 3) == {"acme": 100, "globex": 200, "initech": 300}
    assert _ttls(db_url, 4) == {"acme": 150, "globex": 200, "initech": 300}
    events, commands = _rows(db_url)
    assert [e["kind"] for e in events] == ["policy.change", "admin.action"] * 4
    assert [e["details"]["policy_version"] for e in events] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert commands == [("policy", str(v)) for v in range(1, 5)]
    # One command sequence number per version, in version order, as four single writes give.
    assert _command_seqs(db_url) == [(s, str(s)) for s in range(1, 5)]
    # The next write (one at a time again) edits the group's last version.
    assert _publish(publisher, "umbrella", 50).version == 5
    assert _ttls(db_url, 5)["acme"] == 150


def test_a_refused_write_leaves_the_group_and_the_next_edits_the_version_before(
    db_url: str,
) -> None:
    publisher = _publisher(db_url)

    def refuse(_base: PolicyBase) -> PolicySet:
        raise PermissionDeniedError("no")

    refused = PolicyWrite(refuse, author="key:t", reason="r", author_role="admin", events=_events)
    outcomes = publisher.publish_group([_write("acme", 100), refused, _write("globex", 200)])
    assert isinstance(outcomes[1], PermissionDeniedError)
    assert [o.version for o in outcomes if isinstance(o, PolicyChange)] == [1, 2]
    assert _ttls(db_url, 2) == {"acme": 100, "globex": 200}
    events, commands = _rows(db_url)
    assert len(events) == 4 and len(commands) == 2


def test_a_group_of_refused_writes_stores_nothing(db_url: str) -> None:
    publisher = _publisher(db_url)
    outcomes = publisher.publish_group(
        [_write("acme", 100, expected_version=3), _write("acme", 90, expected_version=7)]
    )
    assert all(isinstance(o, PolicyVersionConflictError) for o in outcomes)
    assert _rows(db_url) == ([], [])
    assert PolicyStore(open_engine(db_url)).current() is None
    assert _publish(publisher, "acme", 80).version == 1


def test_expected_versions_in_a_group_conflict_as_one_at_a_time(db_url: str) -> None:
    """Two writers that both read version 0: the first of the group stores version 1, the second
    gets the 412 it would get after it (it names a version that is no longer the latest)."""
    publisher = _publisher(db_url)
    outcomes = publisher.publish_group(
        [
            _write("acme", 100, expected_version=0),
            _write("acme", 90, expected_version=0),
            _write("acme", 80, expected_version=1),
        ]
    )
    assert isinstance(outcomes[0], PolicyChange) and outcomes[0].version == 1
    assert isinstance(outcomes[1], PolicyVersionConflictError)
    assert isinstance(outcomes[2], PolicyChange) and outcomes[2].version == 2
    assert _ttls(db_url, 2) == {"acme": 80}


def test_the_limits_in_a_group_are_those_of_the_version_edited(db_url: str) -> None:
    """A tenant_admin's write after an admin's in the same group is checked against the admin's
    version; after another tenant_admin's, against the same limits as before it."""
    publisher = _publisher(db_url)
    _publish(publisher, "acme", 100)
    seen: list[tuple[int, int | None]] = []

    def record(base: PolicyBase) -> PolicySet:
        seen.append((base.version, base.limits.change.version if base.limits else None))
        return _set_ttl("acme", 40)(base)

    def recorded(role: str) -> PolicyWrite:
        return PolicyWrite(record, author="key:t", reason="r", author_role=role, events=_events)

    publisher.publish_group(
        [recorded("tenant_admin"), recorded("admin"), recorded("tenant_admin"), recorded("admin")]
    )
    assert seen == [(1, 1), (2, 1), (3, 3), (4, 3)]


def test_a_group_over_another_process_version_is_redone_on_it(db_url: str) -> None:
    """Process A remembers version 1; process B stores version 2; A's group must edit version 2
    (its compare-and-set finds the head moved and the whole group is drafted again)."""
    a, b = _publisher(db_url), _publisher(db_url)
    _publish(a, "acme", 100)
    _publish(b, "globex", 200)
    outcomes = a.publish_group([_write("acme", 150), _write("initech", 300)])
    assert [o.version for o in outcomes if isinstance(o, PolicyChange)] == [3, 4]
    assert _ttls(db_url, 4) == {"acme": 150, "globex": 200, "initech": 300}
    events, commands = _rows(db_url)
    assert len(events) == 8 and len(commands) == 4  # the redone group left nothing extra
    assert [json.loads(json.dumps(e))["details"]["policy_version"] for e in events][-4:] == [
        3,
        3,
        4,
        4,
    ]


def test_an_empty_group_stores_nothing(db_url: str) -> None:
    assert _publisher(db_url).publish_group([]) == []
    assert _rows(db_url) == ([], [])


@pytest.mark.parametrize("size", [1, 2, 40])
def test_groups_of_any_size_keep_every_version_with_its_events(db_url: str, size: int) -> None:
    publisher = _publisher(db_url)
    outcomes = publisher.publish_group([_write(f"t{i}", 100 + i) for i in range(size)])
    assert [o.version for o in outcomes if isinstance(o, PolicyChange)] == list(range(1, size + 1))
    events, commands = _rows(db_url)
    assert len(events) == 2 * size and len(commands) == size
    assert len(_ttls(db_url, size)) == size
