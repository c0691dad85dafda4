"""Each test tier runs alone (`pytest tests/<tier>`, `make test-fast`): no test module imports
another tier's, which collects only when that tier happens to be collected first."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import TIERS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("tier", TIERS)
def test_a_tier_collects_alone(tier):
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                          os.path.join("tests", tier)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " collected" in out.stdout.splitlines()[-1], out.stdout[-500:]
