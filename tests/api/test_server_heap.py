"""A served admin API freezes its start-up heap (`create_app(freeze_heap=True)`): the collector's
full collections then skip the ~150,000 objects of the imports, which otherwise stopped the event
loop and every request thread for 100-150 ms every few seconds under load (docs/benchmarks.md,
"Full collections were the read tail"). Apps built for tests or embedding leave the collector
alone."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from kvguard.api.app import create_app
from kvguard.api.services import CONFIG_ENV, Services
from kvguard.cli import app as cli_app
from tests.api.conftest import make_config


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    # vLLM's engine core freezes the heap of the process it runs in (in-process tests do that).
    gc.unfreeze()
    yield
    gc.unfreeze()


def frozen_while_served(app: FastAPI, *, closes_services: bool = True) -> tuple[int, int]:
    """Objects frozen before the app starts and while it is serving. A served app closes its
    services at shutdown; `closes_services` False: this closes them."""
    try:
        before = gc.get_freeze_count()
        with TestClient(app) as client:
            assert client.get("/healthz").status_code == 200
            during = gc.get_freeze_count()
    finally:
        if not closes_services:
            app.state.services.close()
    return before, during


def test_kvguard_serve_freezes_the_heap_once_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGUARD_MODE", "dev")
    monkeypatch.setenv("KVGUARD_DATA_DIR", str(tmp_path))
    served: list[FastAPI] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **_kwargs: served.append(app))
    db = f"sqlite:///{tmp_path / 'k.db'}"
    result = CliRunner().invoke(cli_app, ["serve", "--db", db, "--port", "0"])
    assert result.exit_code == 0, result.output
    (app,) = served
    before, during = frozen_while_served(app)
    assert before == 0
    # Everything the process holds once started: the imports alone are over 100,000 objects.
    assert during > 50_000


def test_each_worker_of_kvguard_serve_workers_freezes_its_heap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvguard.api.app import app_from_environment  # noqa: PLC0415

    monkeypatch.setenv("KVGUARD_MODE", "dev")
    monkeypatch.setenv("KVGUARD_DATA_DIR", str(tmp_path))
    monkeypatch.setenv(CONFIG_ENV, "")  # so that teardown removes what the command sets
    monkeypatch.delenv(CONFIG_ENV)
    targets: list[Any] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **_kwargs: targets.append(app))
    db = f"sqlite:///{tmp_path / 'k.db'}"
    result = CliRunner().invoke(cli_app, ["serve", "--db", db, "--port", "0", "--workers", "2"])
    assert result.exit_code == 0, result.output
    assert targets == ["kvguard.api.app:app_from_environment"]
    before, during = frozen_while_served(app_from_environment())  # what each worker runs
    assert before == 0
    assert during > 50_000


def test_apps_for_tests_and_embedding_leave_the_collector_alone(tmp_path: Path) -> None:
    config, _key = make_config(tmp_path, f"sqlite:///{tmp_path / 'k.db'}")
    app = create_app(Services.open(config))
    before, during = frozen_while_served(app, closes_services=False)
    assert before == during == 0
