"""Fixtures shared by the GRPO tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def warm_policy_dir(tmp_path_factory):
    """The warmed tiny policy (stack/warm_policy.py), trained once for every GRPO test module (~40 s on 2 cores);
    its untrained start is beside it (`<parent>/base`). Tests read it; none writes into it."""
    from stack.warm_policy import warm_policy

    return warm_policy(tmp_path_factory.mktemp("grpo-warm"))
