from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvguard.errors import PolicyValidationError
from kvguard.policy import PolicySet, Reuse, load_policy_file, parse_policy
from tests.policy.conftest import EXAMPLES, FIXTURES


def _problems(text: str, source: str = "p.yaml") -> list[tuple[str, str]]:
    with pytest.raises(PolicyValidationError) as info:
        parse_policy(text, source)
    assert info.value.source == source
    return info.value.problems


def _paths(text: str, source: str = "p.yaml") -> list[str]:
    return [path for path, _ in _problems(text, source)]


def test_examples_all_validate() -> None:
    files = sorted(EXAMPLES.glob("*.yaml"))
    assert len(files) >= 3
    for path in files:
        assert isinstance(load_policy_file(path), PolicySet)


def test_regulated_example_has_a_confidential_ttl_and_a_restricted_tenant() -> None:
    p = load_policy_file(EXAMPLES / "regulated.yaml")
    assert p.tenants["hospital-a"].retention.ttl_s == 300
    restricted = p.tenants["defence-lab"]
    assert restricted.reuse is Reuse.NONE and restricted.retention.ttl_s == 0


def test_malformed_fixture_reports_every_problem_at_its_field_path() -> None:
    with pytest.raises(PolicyValidationError) as info:
        load_policy_file(FIXTURES / "malformed.yaml")
    paths = [path for path, _ in info.value.problems]
    assert paths == [
        "default.retention.ttl",
        "tenants.acme.reuse",
        "tenants.globex.reuse",
        "tenants.globex.retention.ttl_s",
    ]
    assert str(FIXTURES / "malformed.yaml") in str(info.value)


def test_field_path_for_a_negative_ttl() -> None:
    problems = _problems("tenants:\n  acme:\n    retention:\n      ttl_s: -1\n")
    assert problems == [
        ("tenants.acme.retention.ttl_s", "Input should be greater than or equal to 0")
    ]


def test_unknown_keys_are_errors_at_every_level() -> None:
    text = "retention_days: 3\ndefault:\n  zeroize:\n    on_relase: always\n"
    paths = _paths(text)
    assert paths == ["default.zeroize.on_relase", "retention_days"]
    assert "typo" in _problems(text)[0][1]


def test_invariant_problems_carry_their_own_field_path() -> None:
    text = "tenants:\n  lab:\n    classification: restricted\n    reuse: public\n    retention: {ttl_s: 9}\n"
    assert _paths(text) == ["tenants.lab.reuse", "tenants.lab.retention.ttl_s"]
    text = "tenants:\n  acme:\n    reuse: group\n    groups: [ghost]\n"
    assert _problems(text) == [("tenants.acme.groups.0", "names a share group share_groups lacks")]


@pytest.mark.parametrize(
    ("text", "source", "expected"),
    [
        ("tenants:\n  a: {}\n  a: {reuse: none}\n", "p.yaml", "duplicate key 'a'"),
        ('{"tenants": {"a": {}, "a": {}}}', "p.json", "duplicate key 'a'"),
        ("default: &d {reuse: session}\ntenants:\n  a: *d\n", "p.yaml", "aliases are not allowed"),
        ("", "p.yaml", "empty policy document"),
        ("# only a comment\n", "p.yaml", "empty policy document"),
        ("- 1\n", "p.yaml", "expected a mapping at the top, got list"),
        ("tenants: [\n", "p.yaml", "line 2"),
        ('{"epoch": NaN}', "p.json", "NaN is not a valid number"),
        ('{"epoch": ', "p.json", "line 1"),
    ],
)
def test_document_level_problems(text: str, source: str, expected: str) -> None:
    problems = _problems(text, source)
    assert len(problems) == 1
    path, message = problems[0]
    assert path == "(document)"
    assert expected in message


def test_json_and_yaml_give_the_same_policy() -> None:
    yaml_text = (EXAMPLES / "multi-tenant.yaml").read_text()
    from_yaml = parse_policy(yaml_text, "m.yaml")
    from_json = parse_policy(json.dumps(from_yaml.model_dump(mode="json")), "m.json")
    assert from_json == from_yaml


def test_fmt_overrides_the_suffix() -> None:
    assert parse_policy('{"epoch": 2}', "no-suffix", fmt="json").epoch == 2


def test_load_policy_file_unreadable_or_not_utf8(tmp_path: Path) -> None:
    with pytest.raises(PolicyValidationError) as info:
        load_policy_file(tmp_path / "missing.yaml")
    assert info.value.problems[0][0] == "(file)"
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"default: {audit: \xe9}\n")
    with pytest.raises(PolicyValidationError, match="not UTF-8"):
        load_policy_file(bad)
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * ((1 << 20) + 1))
    with pytest.raises(PolicyValidationError, match="larger than"):
        load_policy_file(big)


def test_errors_do_not_echo_long_or_nested_input() -> None:
    # A pasted prompt in the wrong place must not be reflected into logs or terminals (G6).
    secret = "You are the internal assistant of ACME; the launch code is 1234 " * 3
    problems = _problems(f"default:\n  reuse: '{secret}'\n")
    assert all(secret not in message for _, message in problems)


@pytest.mark.parametrize("name", ["off", "no", "yes", "on", "null"])
def test_an_unquoted_yaml_boolean_key_is_named_with_a_fix(name: str) -> None:
    text = f"version: 1\ntenants:\n  {name}:\n    reuse: none\n"
    with pytest.raises(PolicyValidationError, match=rf"key '{name}' is read by YAML as .*quote it"):
        parse_policy(text, "policy.yaml")
    quoted = parse_policy(f'version: 1\ntenants:\n  "{name}":\n    reuse: none\n', "policy.yaml")
    assert name in quoted.tenants
