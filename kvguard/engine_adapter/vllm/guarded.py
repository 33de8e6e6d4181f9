"""`GuardedLLM`: `vllm.LLM` with server-side salts, policy admission and kvguard's connector.

The caller names a tenant (and optionally a session); `GuardedLLM` builds the scope, asks policy how
the request may run, derives the salt with the server's keyring and sends the scope to the engine in
the request's `extra_args` (see `transport`). A caller-supplied `cache_salt` is refused (G1).
"""

from __future__ import annotations

import copy
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt

from kvguard.engine_adapter.records import PurgeSelector
from kvguard.engine_adapter.vllm.connector import KVGuardConnector
from kvguard.engine_adapter.vllm.routes import POOLING_REFUSED
from kvguard.engine_adapter.vllm.runtime import GuardOptions
from kvguard.engine_adapter.vllm.transport import Envelope
from kvguard.errors import AdmissionError, ConfigError
from kvguard.isolation.scope import AdapterRef, CacheConfig, ModelRef, Scope, Share, TokenizerRef
from kvguard.policy import NO_USAGE, PolicySet, Verdict, admit

CONNECTOR_MODULE = "kvguard.engine_adapter.vllm.connector"
_SETTLE_STEPS = 64


@dataclass(frozen=True, slots=True)
class TenantRequest:
    """Who asks: the tenant, and optionally the session, share group or public sharing."""

    tenant: str
    session: str | None = None
    group: str | None = None
    public: bool = False


def tiny_llama_dir() -> Path:
    """The packaged tiny Llama config (dummy weights) used by the demo and the tests."""
    return Path(str(resources.files("kvguard.engine_adapter.vllm") / "assets" / "tiny-llama"))


class GuardedLLM:
    """A governed `vllm.LLM` (offline inference). See docs/vllm.md."""

    # The connector vLLM loads (a test subclass adds an independent checker to it).
    connector_class: str = KVGuardConnector.__name__
    connector_module: str = CONNECTOR_MODULE

    def __init__(
        self,
        model: str,
        *,
        options: GuardOptions,
        model_revision: str = "main",
        weights_digest: str | None = None,
        **llm_kwargs: Any,
    ) -> None:
        for refused in ("kv_transfer_config", "kv_events_config"):
            if llm_kwargs.get(refused) is not None:
                raise ConfigError(f"GuardedLLM sets {refused} itself; do not pass it")
        for refused in ("kv_offloading_size", "kv_offloading_backend"):
            if llm_kwargs.get(refused) is not None:
                raise ConfigError(
                    f"GuardedLLM refuses {refused}: vLLM's KV offloading would move KV state off "
                    "the device unencrypted and outside purges; use kvguard's governed tier "
                    "instead (GuardOptions.offload_bytes, docs/offload.md)"
                )
        if llm_kwargs.get("runner") == "pooling" or llm_kwargs.get("convert") not in (
            None,
            "auto",
            "none",
        ):
            raise ConfigError(POOLING_REFUSED)
        self.options = options
        self._deriver = options.deriver()
        transfer = KVTransferConfig(
            kv_connector=self.connector_class,
            kv_connector_module_path=self.connector_module,
            kv_role="kv_both",
            # A restored offload-tier block that fails authentication is recomputed (docs/offload.md).
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=options.to_extra_config(),
        )
        llm_kwargs.setdefault("enable_prefix_caching", True)
        self.llm = LLM(model=model, kv_transfer_config=transfer, **llm_kwargs)
        # After the engine started: its connector seeds an empty policy store from the file.
        self._policies = options.initial_policy()[0]
        config = self.llm.llm_engine.vllm_config
        self._model = ModelRef(id=model, revision=model_revision, weights_digest=weights_digest)
        self._tokenizer = TokenizerRef(
            id=str(config.model_config.tokenizer or model), revision=model_revision
        )
        self._cache = CacheConfig(
            kv_dtype=str(config.cache_config.cache_dtype), block_size=config.cache_config.block_size
        )

    def scope(
        self,
        tenant: str,
        *,
        session: str | None = None,
        group: str | None = None,
        public: bool = False,
        adapter: AdapterRef | None = None,
    ) -> Scope:
        share = (
            Share.SESSION
            if session
            else Share.GROUP
            if group
            else Share.PUBLIC
            if public
            else Share.TENANT
        )
        return Scope(
            tenant_id=tenant,
            share=share,
            session_id=session,
            group_id=group,
            model=self._model,
            tokenizer=self._tokenizer,
            adapter=adapter,
            cache_config=self._cache,
            policy_epoch=self.policies.epoch,
        )

    def generate(
        self,
        prompts: Sequence[Sequence[int] | dict[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        tenant: str,
        session: str | None = None,
        group: str | None = None,
        public: bool = False,
        use_tqdm: bool = False,
    ) -> list[Any]:
        """Generate for one tenant. `prompts` are token-id lists (or TokensPrompt dicts without a salt)."""
        request = TenantRequest(tenant=tenant, session=session, group=group, public=public)
        return self.generate_batch(
            [(request, p) for p in prompts], sampling_params, use_tqdm=use_tqdm
        )

    def generate_batch(
        self,
        items: Sequence[tuple[TenantRequest, Sequence[int] | dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[Any]:
        """Generate for many tenants in one engine batch; each item is (who asks, prompt).

        Admission runs first for every item: if any is refused, nothing is sent to the engine."""
        base = sampling_params or SamplingParams()
        guard = self.connector.scheduler_guard if self.connector is not None else None
        if guard is not None:
            guard.poll()  # pick up due purge and policy commands (a disabled tenant) before admitting
        prompts: list[TokensPrompt] = []
        params: list[SamplingParams] = []
        for request, prompt in items:
            salt, item_params = self._admit(request, base)
            prompts.append(self._prompt(prompt, salt))
            params.append(item_params)
        outputs = self.llm.generate(prompts, params, use_tqdm=use_tqdm)
        self.settle()
        return list(outputs)

    def _admit(self, request: TenantRequest, base: SamplingParams) -> tuple[str, SamplingParams]:
        scope = self.scope(
            request.tenant, session=request.session, group=request.group, public=request.public
        )
        # While the ledger refuses entries (G7) the tenant's `on_ledger_unavailable` decides:
        # `fail_closed` refuses here; `block` lets the request wait in the engine's queue
        # (`SchedulerGuard.may_schedule`) until the ledger takes entries again.
        guard = self.connector.scheduler_guard if self.connector is not None else None
        refusing = guard is not None and guard.refuses_new_work()
        decision = admit(self.policies, scope, NO_USAGE, ledger_available=not refusing)
        if decision.verdict is Verdict.DEFER:
            decision = admit(self.policies, scope, NO_USAGE)
        if not decision.admitted or decision.scope is None:
            raise AdmissionError(f"request refused by policy: {decision.reason.value}")
        envelope = Envelope(scope=decision.scope, use_cache=decision.use_cache)
        # No-cache requests get a one-off salt so their blocks can never match anything.
        salt = (
            self._deriver.salt(decision.scope)
            if decision.use_cache
            else "nocache:" + secrets.token_urlsafe(16)
        )
        # A shallow copy: only extra_args (a new dict) and one flag differ per request, and vLLM
        # makes its own per-request copy when it processes the input. `clone()` deep-copied every
        # field, a third of the front end's per-request cost in a profile.
        params = copy.copy(base)
        params.extra_args = {**(params.extra_args or {}), **envelope.to_extra_args()}
        if not decision.use_cache:
            params.skip_reading_prefix_cache = True
        return salt, params

    def _prompt(self, prompt: Sequence[int] | dict[str, Any], salt: str) -> TokensPrompt:
        if isinstance(prompt, dict):
            self._deriver.check_not_client_salt(prompt.get("cache_salt"))
            return TokensPrompt(prompt_token_ids=list(prompt["prompt_token_ids"]), cache_salt=salt)
        return TokensPrompt(prompt_token_ids=list(prompt), cache_salt=salt)

    # --- in-process control (VLLM_ENABLE_V1_MULTIPROCESSING=0) ------------------------------------

    def _engine_core(self) -> Any | None:
        client = self.llm.llm_engine.engine_core
        return getattr(client, "engine_core", None)

    @property
    def policies(self) -> PolicySet:
        """The policy in force: the in-process engine's, which follows policy commands from the
        admin API, else the one loaded at start (`policy_url` store, `policy_file` or defaults)."""
        conn = self.connector
        guard = conn.scheduler_guard if conn is not None else None
        return guard.policies if guard is not None else self._policies

    @property
    def connector(self) -> KVGuardConnector | None:
        """The scheduler-side connector when the engine runs in this process, else None."""
        core = self._engine_core()
        return core.scheduler.get_kv_connector() if core is not None else None

    def settle(self) -> None:
        """Step the in-process engine until every quarantined block is zeroized and released.

        `LLM.generate` stops stepping as soon as outputs are complete; blocks released by the last
        step are cleared in the next one. (A multiprocess engine keeps stepping by itself while the
        connector reports pending work.)"""
        core, conn = self._engine_core(), self.connector
        if core is None or conn is None or conn.scheduler_guard is None:
            return
        guard = conn.scheduler_guard
        try:
            for _ in range(_SETTLE_STEPS):
                if not guard.has_pending():
                    return
                if not guard.has_pending(ledger=False):
                    return  # only events the ledger still refuses: they wait (recorded later)
                core.step_fn()
            raise RuntimeError("kvguard: zeroization did not settle; blocks remain quarantined")
        finally:
            # An in-process engine steps only when its caller does: the figures of this batch
            # reach the registry now (written on the link's thread), not at the next batch.
            if guard.figures_changed():
                guard.beat_soon()

    def sync(self) -> None:
        """Run the commands and expiry that are due, step until what they released is zeroized, and
        make the ledger durable (in-process engines; e.g. after a purge queued through the admin
        API, which the engine picks up at most a second later)."""
        conn = self.connector
        if conn is None or conn.scheduler_guard is None:
            raise ConfigError("sync() needs the in-process engine")
        conn.scheduler_guard.poll()
        self.settle()
        conn.scheduler_guard.ledger.flush()

    def purge(self, selector: PurgeSelector) -> None:
        """Purge in-process (the admin API's command path serves separate engine processes)."""
        conn = self.connector
        if conn is None or conn.scheduler_guard is None:
            raise ConfigError(
                "purge() needs the in-process engine; use the admin API for a served engine"
            )
        conn.scheduler_guard.request_purge(selector)
        conn.scheduler_guard.apply_now()
        self.settle()

    def expire(self) -> None:
        """Run the retention sweep now (in-process; a served engine sweeps on every request and step)."""
        conn = self.connector
        if conn is not None and conn.scheduler_guard is not None:
            conn.scheduler_guard.apply_now()
            self.settle()

    def close(self) -> None:
        conn = self.connector
        if conn is not None:
            conn.shutdown()
