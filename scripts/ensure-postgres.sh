#!/usr/bin/env bash
# Make sure the local PostgreSQL the tests use is up (start the cluster if it is down).
set -euo pipefail
HOST="${KVGUARD_PG_HOST:-127.0.0.1}"
PORT="${KVGUARD_PG_PORT:-5432}"
if pg_isready -q -h "$HOST" -p "$PORT" 2>/dev/null; then
    exit 0
fi
if command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ]; then
    echo "==> PostgreSQL is down; starting it"
    for version in $(ls /etc/postgresql); do
        pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
    done
    for _ in $(seq 1 30); do
        pg_isready -q -h "$HOST" -p "$PORT" && exit 0
        sleep 1
    done
fi
echo "warning: PostgreSQL at $HOST:$PORT is not reachable; tests marked 'postgres' will fail" >&2
exit 0
