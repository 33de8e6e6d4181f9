"""The zeroize package's logger: structlog when present, the standard library otherwise.

structlog is a core dependency, but GPU hosts may run this package bare (torch + Triton only); the
stdlib fallback keeps the executors importable there and still logs the same fields.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any


def event(level: int, name: str, **fields: Any) -> None:
    _logger()[0](level, name, **fields)


def enabled(level: int) -> bool:
    """Whether `level` would be logged (so a caller can skip building the fields)."""
    return _logger()[1](level)


@functools.cache
def _logger() -> tuple[Callable[..., None], Callable[[int], bool]]:
    try:
        from kvguard.logging import get_logger  # noqa: PLC0415
    except ImportError:
        stdlib = logging.getLogger("kvguard.zeroize")
        return (
            lambda level, name, **fields: stdlib.log(level, "%s %s", name, fields),
            stdlib.isEnabledFor,
        )
    structured = get_logger("zeroize")
    is_enabled: Callable[[int], bool] = getattr(structured, "is_enabled_for", lambda _level: True)
    return structured.log, is_enabled
