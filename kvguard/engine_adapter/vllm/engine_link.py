"""The engine's end of the command link: poll `engine_commands`, run each command, acknowledge it.

`CommandRunner` runs in the scheduler thread. It polls at most every `COMMAND_POLL_S`, or at once when
its PostgreSQL `CommandListener` heard a `NOTIFY` (see `kvguard.engine_adapter.commands`). Purges are
carried out by the scheduler guard (custody lives there); policy commands load the named version from
the policy store (`policy_url`), and the guard swaps it in. Acknowledgements carry counts and version
numbers only.

A policy version that cannot be loaded (missing, or failing its digest check) leaves the engine on
the policy it has: the last one that loaded is known-good, and refusing every request over a bad row
would let one bad write stop every engine. The acknowledgement says so (`policy_load_failed: 1`)
and the error is logged. An engine without `policy_url` follows its policy file only and acknowledges
policy commands with `policy_version: null`.
"""

from __future__ import annotations

from typing import Any, Final, Protocol

from kvguard.engine_adapter.commands import (
    CommandListener,
    CommandQueue,
    PolicyCommand,
    PurgeCommand,
)
from kvguard.engine_adapter.records import PurgeSelector
from kvguard.errors import PolicyStoreError
from kvguard.logging import get_logger
from kvguard.policy import PolicySet
from kvguard.policy.store import PolicyStore

COMMAND_POLL_S: Final = 1.0
_log = get_logger("vllm.commands")


class CommandTarget(Protocol):
    """What a command acts on: the scheduler guard."""

    policy_version: int | None

    def purge_for_command(
        self, selector: PurgeSelector, now: float, command_id: int
    ) -> dict[str, int]: ...

    def use_policy(self, policies: PolicySet, version: int) -> None: ...


class CommandRunner:
    """Polls and runs engine commands for one engine (see the module docstring)."""

    def __init__(self, engine_id: str, *, control_url: str, policy_url: str | None) -> None:
        self.engine_id = engine_id
        self.queue = CommandQueue.open(control_url)
        self._last = self.queue.latest_id()  # older commands found nothing of ours to act on
        self._last_poll = float("-inf")
        self.store = PolicyStore.open(policy_url) if policy_url else None
        self.listener: CommandListener | None = None
        if self.queue.engine.dialect.name == "postgresql":
            self.listener = CommandListener(self.queue.engine).start()
        self.executed = 0

    @property
    def last_id(self) -> int:
        """The newest command this engine has run (or skipped as older than itself)."""
        return self._last

    def due(self, now: float) -> bool:
        woken = self.listener is not None and self.listener.take()
        return woken or now - self._last_poll >= COMMAND_POLL_S

    def run(self, now: float, target: CommandTarget) -> int:
        """Run every command created since the last one run; returns how many ran."""
        self._last_poll = now
        ran = 0
        for command in self.queue.pending_after(self._last):
            if isinstance(command, PurgeCommand):
                result: dict[str, Any] = target.purge_for_command(command.selector, now, command.id)
            else:
                result = self._policy(command, target)
            self.queue.acknowledge(command.id, self.engine_id, result)
            self._last = command.id
            ran += 1
        self.executed += ran
        return ran

    def _policy(self, command: PolicyCommand, target: CommandTarget) -> dict[str, Any]:
        if self.store is None:
            return {"policy_version": None}
        current = target.policy_version
        if current is not None and command.version <= current:
            return {"policy_version": current}  # versions only grow; never go back to an older one
        try:
            loaded = self.store.get(command.version)
        except PolicyStoreError as exc:
            _log.error(
                "policy version could not be loaded; keeping the current policy",
                version=command.version,
                error=str(exc),
            )
            return {"policy_version": current, "policy_load_failed": 1}
        target.use_policy(loaded.policy, loaded.change.version)
        _log.info("policy version applied", version=loaded.change.version)
        return {"policy_version": loaded.change.version}

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
        self.queue.engine.dispose()
        if self.store is not None:
            self.store.engine.dispose()
