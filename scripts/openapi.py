"""Write the admin API's OpenAPI schema to docs/openapi.json (a test checks it is current).

Run: .venv/bin/python scripts/openapi.py
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from kvguard.api.app import create_app
from kvguard.api.services import ApiConfig, Services
from kvguard.audit.signing import SigningKey
from kvguard.isolation.keyring import Keyring

OUT = Path(__file__).resolve().parents[1] / "docs" / "openapi.json"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        SigningKey.generate("openapi").save(directory / "signing.key")
        Keyring.generate("k1").save(directory / "salt.keys")
        config = ApiConfig(
            db_url=f"sqlite:///{directory / 'kvguard.db'}",
            signing_key_file=directory / "signing.key",
            salt_keyring_file=directory / "salt.keys",
            checkpoint_interval_s=None,
        )
        services = Services.open(config)
        try:
            schema = create_app(services).openapi()
        finally:
            services.close()
    OUT.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
    print(f"wrote {OUT} ({len(schema['paths'])} paths)")


if __name__ == "__main__":
    main()
