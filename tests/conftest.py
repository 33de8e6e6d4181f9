"""Suite-wide test settings.

The test machines have 2 shared cores and their timings are noisy, so hypothesis runs without
per-example deadlines and without the too-slow health check: a slow machine must not fail a test
whose property holds. (Speed is checked by the scripts in benchmarks/, never by unit tests.)
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

settings.register_profile(
    "kvguard", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile("kvguard")
