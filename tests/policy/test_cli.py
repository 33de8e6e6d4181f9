from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from kvguard.policy import load_policy_file
from kvguard.policy.cli import policy_app
from tests.policy.conftest import EXAMPLES, FIXTURES

runner = CliRunner()


def test_validate_examples_prints_ok_per_file() -> None:
    files = sorted(str(p) for p in EXAMPLES.glob("*.yaml"))
    result = runner.invoke(policy_app, ["validate", *files])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [f"OK {f}" for f in files]


def test_validate_malformed_prints_file_path_and_message_and_exits_1() -> None:
    good = str(EXAMPLES / "default-secure.yaml")
    bad = str(FIXTURES / "malformed.yaml")
    result = runner.invoke(policy_app, ["validate", good, bad])
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert lines[0] == f"OK {good}"
    assert (
        f"{bad}: tenants.globex.retention.ttl_s: Input should be greater than or equal to 0"
        in lines
    )
    assert f"{bad}: default.retention.ttl: unknown field" in lines[1]
    assert len(lines) == 5


def test_missing_file_and_no_arguments_are_usage_errors(tmp_path: Path) -> None:
    assert runner.invoke(policy_app, ["validate", str(tmp_path / "nope.yaml")]).exit_code == 2
    assert runner.invoke(policy_app, ["validate"]).exit_code == 2
    assert runner.invoke(policy_app, ["validate", str(tmp_path)]).exit_code == 2


def test_validate_stays_a_subcommand() -> None:
    result = runner.invoke(policy_app, ["--help"])
    assert result.exit_code == 0
    assert "validate" in result.stdout


def test_digest_prints_the_canonical_digest() -> None:
    path = EXAMPLES / "multi-tenant.yaml"
    result = runner.invoke(policy_app, ["digest", str(path)])
    assert result.exit_code == 0
    assert result.stdout.strip() == load_policy_file(path).digest()
    assert runner.invoke(policy_app, ["digest", str(FIXTURES / "malformed.yaml")]).exit_code == 1
