"""Build-time only: the optional C planner. Every other piece of metadata lives in pyproject.toml.

`optional=True`: on a machine without a C compiler the install still succeeds, and
`kvguard.zeroize.plan` uses its pure-Python path (same results, about 9x slower on 10,000 ids;
docs/zeroize.md). tests/zeroize/test_plan_native.py fails when the extension is missing unless
KVGUARD_ALLOW_PURE_PLANNER=1, so CI cannot fall back silently.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("kvguard.zeroize._plan", sources=["kvguard/zeroize/_plan.c"], optional=True),
    ],
)
