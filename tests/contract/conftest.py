from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.contract.harness import HARNESSES, Harness

# PTB itself reads RetryAfter.retry_after while building the exception; that warning is PTB's own.
pytestmark = pytest.mark.filterwarnings("ignore:.*retry_after.*:telegram.warnings.PTBDeprecationWarning")


@pytest.fixture(params=sorted(HARNESSES))
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    made = HARNESSES[request.param]()
    await made.open()
    try:
        yield made
    finally:
        await made.close()
