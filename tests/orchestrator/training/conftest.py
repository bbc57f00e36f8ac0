"""The trainer's tests' one real rank (gloo on CPU), made once per test module that asks for it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from rank_helpers import one_rank

from orchestrator.training import runtime


@pytest.fixture(scope="module")
def rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[runtime.Runtime]:
    with one_rank(tmp_path_factory.mktemp("pg")) as rt:
        yield rt
