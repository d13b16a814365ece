"""Guards for the private Ray Train internals that train/ relies on (docs/INTERNALS.md, row T1). Fast: imports only,
no cluster. Ray 2.60.0 at the time of writing."""

from __future__ import annotations

import inspect


def test_health_check_interval_env_is_ray_trains():
    """T1, train/trainer.py `connect_ray` (HEALTH_CHECK_INTERVAL_ENV): ray.train.v2._internal.constants names the
    controller's poll interval RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, propagates it from the driver to the controller,
    and the controller reads it from its environment."""
    from ray.train.v2._internal import constants
    from ray.train.v2._internal.execution.controller import controller

    from train.trainer import HEALTH_CHECK_INTERVAL_ENV, HEALTH_CHECK_INTERVAL_S

    assert constants.HEALTH_CHECK_INTERVAL_S_ENV_VAR == HEALTH_CHECK_INTERVAL_ENV
    assert HEALTH_CHECK_INTERVAL_ENV in constants.ENV_VARS_TO_PROPAGATE
    assert "os.getenv(HEALTH_CHECK_INTERVAL_S_ENV_VAR" in inspect.getsource(controller)
    assert float(HEALTH_CHECK_INTERVAL_S) > 0
