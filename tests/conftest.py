from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Every test talks to 127.0.0.1 only; a proxy from the environment must not intercept.
os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
os.environ.setdefault("no_proxy", "127.0.0.1,localhost")


@pytest.fixture
def repo() -> Path:
    return REPO
