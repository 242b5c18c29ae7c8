"""Fixtures for the E2B SDK suite. `run.sh` starts `cordon serve` and sets E2B_API_KEY,
E2B_API_URL and E2B_SANDBOX_URL; every test talks to it through the real `e2b` package."""

import os
import shutil
import uuid

import pytest
from e2b import Sandbox

for var in ("E2B_API_KEY", "E2B_API_URL", "E2B_SANDBOX_URL"):
    if not os.environ.get(var):
        raise RuntimeError(f"{var} is not set: run this suite through tests/e2b/run.sh")

# Tests of the other tiers skip, saying why, where the host lacks their runtime.
needs_runsc = pytest.mark.skipif(
    not (os.environ.get("CORDON_RUNSC") or shutil.which("runsc")), reason="runsc is not installed (scripts/install-deps)"
)
needs_qemu = pytest.mark.skipif(
    not (os.environ.get("CORDON_QEMU") or shutil.which("qemu-system-x86_64")),
    reason="qemu-system-x86_64 is not installed (scripts/install-deps)",
)

BASE_URL = os.environ["E2B_SANDBOX_URL"]
API_URL = os.environ["E2B_API_URL"]
API_KEY = os.environ["E2B_API_KEY"]


@pytest.fixture
def sandbox():
    """A fresh sandbox per test, killed afterwards even when the test fails."""
    sbx = Sandbox.create(timeout=120, metadata={"suite": "cordon"})
    try:
        yield sbx
    finally:
        sbx.kill()


@pytest.fixture(scope="module")
def shared():
    """One sandbox for tests that only read or write their own paths."""
    sbx = Sandbox.create(timeout=300, metadata={"suite": "cordon"})
    try:
        yield sbx
    finally:
        sbx.kill()


@pytest.fixture
def unique():
    return uuid.uuid4().hex
