"""`kvguard demo`: a scripted multi-tenant scenario on a real vLLM engine (CPU, tiny Llama, dummy weights).

Everything is embedded: a data directory holds the salt keyring, the checkpoint signing key, the policy
and the SQLite ledger. The scenario shows each guarantee at work and ends with a signed checkpoint, an
export bundle and its offline verification. Progress goes to stderr; `--json` prints a summary on stdout.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvguard.audit.certificate import verify_certificate
from kvguard.audit.offline import verify_bundle
from kvguard.audit.signing import SigningKey
from kvguard.errors import KvguardError, VerificationError
from kvguard.isolation.keyring import Keyring
from kvguard.policy import prefix_digest
from kvguard.secretfile import write_private_file

ORIGIN = "kvguard.demo/ledger"
TENANTS = ("acme", "globex", "initech", "umbrella")
BLOCK = 32
TTL_S = 2


def _doc(seed: int, blocks: int = 2) -> list[int]:
    # A few tokens past the last full block: vLLM always recomputes the final prompt token, so a
    # prompt of exactly N blocks could reuse at most N - 1 of them.
    return [(seed * 131 + 17 * i) % 500 + 5 for i in range(blocks * BLOCK + 4)]


# The one prefix the share group lists (two blocks): group requests share it and nothing else.
SHARED_PREFIX = _doc(1)[: 2 * BLOCK]
POLICY = f"""\
# kvguard demo policy: a share group, a confidential tenant with a short TTL, a restricted tenant.
version: 1
default:
  reuse: tenant
tenants:
  acme:
    reuse: group
    groups: [research]
  globex:
    reuse: group
    groups: [research]
  initech:
    classification: confidential
    retention: {{ttl_s: {TTL_S}, idle_s: {TTL_S}}}
    zeroize: {{verify: full}}
  umbrella:
    classification: restricted
share_groups:
  research:
    prefixes:
      - id: research-system-prompt
        digest: "{prefix_digest(SHARED_PREFIX)}"
        tokens: {len(SHARED_PREFIX)}
    min_shared_tokens: 64
"""


@dataclass
class Tally:
    requests: int = 0
    cached_tokens: int = 0
    cross_scope_hits: int = 0
    hits_in_scope: int = 0
    by_tenant: dict[str, dict[str, int]] = field(default_factory=dict)
    history: list[tuple[str, list[int]]] = field(default_factory=list)

    def record(self, scope_key: str, tenant: str, prompt: list[int], cached: int) -> None:
        self.requests += 1
        self.cached_tokens += cached
        row = self.by_tenant.setdefault(tenant, {"requests": 0, "cached_tokens": 0})
        row["requests"] += 1
        row["cached_tokens"] += cached
        if cached:
            n = -(-cached // BLOCK) * BLOCK
            if any(k == scope_key and p[:n] == prompt[:n] for k, p in self.history):
                self.hits_in_scope += 1
            else:
                self.cross_scope_hits += 1
        self.history.append((scope_key, prompt))


def _prepare(data_dir: Path, fresh: bool) -> dict[str, Any]:
    if fresh and data_dir.exists():
        shutil.rmtree(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    keyring, signing, policy = (
        data_dir / "salt.keys",
        data_dir / "signing.key",
        data_dir / "policy.yaml",
    )
    if not keyring.exists():
        Keyring.generate("demo1").save(keyring)
    if not signing.exists():
        SigningKey.generate(ORIGIN).save(signing)
    # Public: what an auditor needs to verify exports offline.
    (data_dir / "verifier.key").write_text(SigningKey.load(signing).verifier_key() + "\n")
    policy.write_text(POLICY)
    return {
        "salt_keyring_file": keyring,
        "signing_key_file": signing,
        "policy_file": policy,
        "ledger_url": f"sqlite:///{(data_dir / 'ledger.db').resolve()}",
        "ledger_origin": ORIGIN,
    }


def run_demo(
    data_dir: Path, *, fresh: bool = True, console: Console | None = None
) -> dict[str, Any]:
    """Run the scenario; returns the summary (also what `--json` prints)."""
    console = console or Console(stderr=True)
    started = time.perf_counter()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    paths = _prepare(data_dir, fresh)
    with console.status(
        "starting vLLM (CPU, tiny Llama, dummy weights) with the kvguard connector"
    ):
        from vllm import SamplingParams  # noqa: PLC0415

        from kvguard.engine_adapter.vllm.guarded import GuardedLLM, tiny_llama_dir  # noqa: PLC0415
        from kvguard.engine_adapter.vllm.runtime import GuardOptions  # noqa: PLC0415

        g = GuardedLLM(
            str(tiny_llama_dir()),
            options=GuardOptions(**paths),
            load_format="dummy",
            skip_tokenizer_init=True,
            enforce_eager=True,
            block_size=BLOCK,
            kv_cache_memory_bytes=2 << 20,
            max_model_len=512,
            max_num_seqs=8,
            seed=0,
            disable_log_stats=False,
        )
    sched = g.connector.scheduler_guard if g.connector else None
    assert sched is not None, "the demo runs the engine in-process"
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tally = Tally()

    def ask(tenant: str, prompt: list[int], *, group: str | None = None) -> int:
        out = g.generate([prompt], params, tenant=tenant, group=group)[0]
        listed = group is not None and prompt[: len(SHARED_PREFIX)] == SHARED_PREFIX
        key = f"group:{group}" if listed else f"tenant:{tenant}"
        if tenant == "umbrella" or (tenant == "initech" and expired_initech):
            key = f"{key}:{tally.requests}"  # no retention: every request is its own scope
        tally.record(key, tenant, prompt, out.num_cached_tokens)
        return int(out.num_cached_tokens)

    expired_initech = False
    steps: list[tuple[str, Callable[[], tuple[int, ...]]]] = [
        (
            "shared group prefix: acme computes, globex reuses inside the group",
            lambda: (
                ask("acme", _doc(1), group="research"),
                ask("globex", _doc(1), group="research"),
            ),
        ),
        (
            "group prompt outside the group's allow-list: acme computes, globex gets no hit",
            lambda: (
                ask("acme", _doc(5), group="research"),
                ask("globex", _doc(5), group="research"),
            ),
        ),
        (
            "private prompts: acme reuses its own, globex sends the same tokens and gets no hit",
            lambda: (ask("acme", _doc(2)), ask("acme", _doc(2)), ask("globex", _doc(2))),
        ),
        (
            "confidential tenant with a TTL: reuse, then expiry",
            lambda: (ask("initech", _doc(3)), ask("initech", _doc(3))),
        ),
        (
            "restricted tenant: no prefix caching, blocks zeroized on release",
            lambda: (ask("umbrella", _doc(4)), ask("umbrella", _doc(4))),
        ),
    ]
    for title, step in steps:
        console.print(f"[bold]*[/bold] {title}: cached tokens {step()}")
    with console.status(f"waiting {TTL_S + 0.5:.1f} s for initech's TTL"):
        time.sleep(TTL_S + 0.5)
        g.expire()
    expired_initech = True
    console.print(
        f"[bold]*[/bold] after the TTL initech's prompt is gone: cached tokens {ask('initech', _doc(3))}"
    )
    with console.status("tenant purge of acme through the admin API, then its erasure certificate"):
        certificate = _purge_through_api(g, data_dir, paths)
    console.print(
        f"[bold]*[/bold] tenant purge of acme (admin API job {certificate['job']['job_id']}): "
        f"cached tokens afterwards {ask('acme', _doc(2))}"
    )
    summary = _evidence(g, sched, data_dir, paths, tally)
    summary.update(_certificate_summary(certificate, data_dir, paths))
    summary["seconds"] = round(time.perf_counter() - started, 1)
    g.close()
    _print_table(console, summary)
    return summary


def _evidence(
    g: Any, sched: Any, data_dir: Path, paths: dict[str, Any], tally: Tally
) -> dict[str, Any]:
    ledger = sched.ledger
    ledger.flush()
    checkpoint = ledger.checkpoint()
    size = ledger.size
    export_dir = data_dir / "export"
    if export_dir.exists():
        shutil.rmtree(export_dir)
    ledger.export(export_dir)
    key = SigningKey.load(paths["signing_key_file"]).verifier_key()
    try:
        report = verify_bundle(export_dir, [key], full=True, origin=ORIGIN)
        verified, verified_entries = True, report.entries
    except VerificationError:
        verified, verified_entries = False, 0
    metrics = {m.name: m.value for m in g.llm.get_metrics() if m.name == "vllm:prefix_cache_hits"}
    return {
        "requests": tally.requests,
        "cached_tokens": tally.cached_tokens,
        "hits_within_scope": tally.hits_in_scope,
        "cross_scope_hits": tally.cross_scope_hits,
        "engine_prefix_cache_hits": int(metrics.get("vllm:prefix_cache_hits", 0)),
        "blocks_zeroized": sched.stats["blocks_zeroized"],
        "zeroize_failures": sched.stats["zeroize_failures"],
        "ledger_size": size,
        "checkpoint_first_line": checkpoint.splitlines()[0],
        "export": str(export_dir),
        "export_verified": verified,
        "export_entries_verified": verified_entries,
        "tenants": tally.by_tenant,
    }


def _purge_through_api(g: Any, data_dir: Path, paths: dict[str, Any]) -> dict[str, Any]:
    """The compliance admin's path: the admin API (in-process, on the demo's database) queues a
    tenant purge; the engine picks the command up from the database, quarantines and zeroizes the
    tenant's blocks; the API then issues the erasure certificate from the ledger."""
    from fastapi.testclient import TestClient  # noqa: PLC0415

    from kvguard.api.app import create_app  # noqa: PLC0415
    from kvguard.api.auth import Role  # noqa: PLC0415
    from kvguard.api.services import ApiConfig, Services  # noqa: PLC0415

    config = ApiConfig(
        db_url=paths["ledger_url"],
        signing_key_file=paths["signing_key_file"],
        salt_keyring_file=paths["salt_keyring_file"],
        origin=ORIGIN,
        checkpoint_interval_s=None,
    )
    services = Services.open(config)
    try:
        for tenant in TENANTS:
            services.tenants.create(tenant, display_name=tenant.title(), created_by="demo")
        key = services.keys.create(Role.ADMIN, label="kvguard demo").api_key
        headers = {"Authorization": f"Bearer {key}"}
        with TestClient(create_app(services)) as client:
            body = {"kind": "tenant", "value": "acme"}
            job_id = client.post("/v1/purges", json=body, headers=headers).json()["job_id"]
            for _ in range(40):  # the engine polls its commands at most once a second
                g.sync()
                job = client.get(f"/v1/purges/{job_id}", headers=headers).json()
                if job["status"] == "done":
                    break
                time.sleep(0.1)
            response = client.get(f"/v1/purges/{job_id}/certificate", headers=headers)
            if response.status_code != 200:
                raise KvguardError(f"no erasure certificate for job {job_id}: {response.text}")
            write_private_file(data_dir / "erasure-certificate-acme.json", response.content)
            certificate: dict[str, Any] = response.json()
            return certificate
    finally:
        services.close()


def _certificate_summary(
    certificate: dict[str, Any], data_dir: Path, paths: dict[str, Any]
) -> dict[str, Any]:
    key = SigningKey.load(paths["signing_key_file"]).verifier_key()
    try:
        verify_certificate(certificate, [key], origin=ORIGIN)
        verified = True
    except VerificationError:
        verified = False
    blocks = certificate["media"]["kv_cache_blocks"]
    return {
        "erasure_certificate": str(data_dir / "erasure-certificate-acme.json"),
        "erasure_certificate_verified": verified,
        "erasure_blocks_quarantined": blocks["quarantined"],
        "erasure_blocks_cleared": blocks["cleared"],
    }


def _print_table(console: Console, summary: dict[str, Any]) -> None:
    table = Table(title="kvguard demo")
    table.add_column("tenant")
    table.add_column("requests", justify="right")
    table.add_column("cached tokens", justify="right")
    for tenant, row in sorted(summary["tenants"].items()):
        table.add_row(tenant, str(row["requests"]), str(row["cached_tokens"]))
    console.print(table)
    facts = Table(show_header=False)
    for key in (
        "hits_within_scope",
        "cross_scope_hits",
        "engine_prefix_cache_hits",
        "blocks_zeroized",
        "zeroize_failures",
        "ledger_size",
        "export_verified",
        "export_entries_verified",
        "erasure_blocks_cleared",
        "erasure_certificate_verified",
        "erasure_certificate",
        "seconds",
    ):
        facts.add_row(key.replace("_", " "), str(summary[key]))
    console.print(facts)
