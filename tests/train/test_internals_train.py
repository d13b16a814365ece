"""Guards for the private Ray internals that train/ relies on (docs/INTERNALS.md, rows T1-T4). Fast: imports only,
no cluster. Ray 2.60.0 at the time of writing."""

from __future__ import annotations

import inspect
import re


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


def test_preemption_poll_interval_env_is_ray_trains():
    """T2, train/trainer.py `connect_ray` (PREEMPTION_POLL_INTERVAL_ENV): Ray Train names its preemption watcher's poll
    interval RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S, propagates it from the driver to the controller, and the
    controller's PreemptionCallback reads it from its environment when the worker group starts."""
    from ray.train.v2._internal import constants
    from ray.train.v2._internal.callbacks import preemption_callback

    from train.trainer import PREEMPTION_POLL_INTERVAL_ENV, PREEMPTION_POLL_INTERVAL_S

    assert constants.PREEMPTION_POLL_INTERVAL_S_ENV_VAR == PREEMPTION_POLL_INTERVAL_ENV
    assert PREEMPTION_POLL_INTERVAL_ENV in constants.ENV_VARS_TO_PROPAGATE
    assert constants.DEFAULT_ENABLE_PREEMPTION_WATCHER  # on unless switched off
    reads = inspect.getsource(preemption_callback.PreemptionCallback.__init__)
    assert re.search(r"os\.getenv\(\s*PREEMPTION_POLL_INTERVAL_S_ENV_VAR", reads)
    assert float(PREEMPTION_POLL_INTERVAL_S) > 0


def test_sigterm_to_ray_start_drains_its_node_as_a_preemption_with_a_deadline():
    """T3, rayjobs/manifests.py DRAIN_TIMEOUT_ENV (and train/notice.py, which relies on it): `ray start --block`
    registers Node's SIGTERM handler, which drains the node with reason PREEMPTION and a deadline of
    RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S seconds before it stops the node's processes; that drain is what Ray
    Train's preemption watcher turns into `ray.train.get_preemption_info()`."""
    from ray._private import node, ray_constants
    from ray.scripts import scripts
    from ray.train.v2._internal.execution import preemption

    from rayjobs.manifests import DRAIN_TIMEOUT_ENV

    assert f'"{DRAIN_TIMEOUT_ENV}"' in inspect.getsource(ray_constants)
    handler = inspect.getsource(node.Node._register_shutdown_hooks)
    assert "self._drain_node_before_shutdown()" in handler and "set_sigterm_handler" in handler
    drain = inspect.getsource(node.Node._drain_node_before_shutdown)
    assert "ray_constants.RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S" in drain
    assert "DrainNodeReason.DRAIN_NODE_REASON_PREEMPTION" in drain and "deadline_timestamp_ms" in drain
    assert "shutdown_at_exit=block" in inspect.getsource(scripts.start.callback)
    assert "get_draining_nodes()" in inspect.getsource(preemption)


def test_worker_group_start_timeout_env_is_ray_trains():
    """T4, train/trainer.py `connect_ray(elastic=True)` (ELASTIC_START_TIMEOUT_ENV): Ray Train names how long a worker
    group may wait for its placement group RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S, propagates it from the driver to the
    controller, and the worker group reads it; the elastic policy's node view is Ray Data's coordinator's, refreshed
    every 20 s, which the timeout must outlast for the retry to see a lost node gone."""
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import _AutoscalingCoordinatorActor
    from ray.train.v2._internal import constants
    from ray.train.v2._internal.execution.worker_group import worker_group

    from train.trainer import ELASTIC_START_TIMEOUT_ENV, ELASTIC_START_TIMEOUT_S

    assert constants.WORKER_GROUP_START_TIMEOUT_S_ENV_VAR == ELASTIC_START_TIMEOUT_ENV
    assert ELASTIC_START_TIMEOUT_ENV in constants.ENV_VARS_TO_PROPAGATE
    assert "WORKER_GROUP_START_TIMEOUT_S_ENV_VAR" in inspect.getsource(worker_group)
    assert _AutoscalingCoordinatorActor.TICK_INTERVAL_S < float(ELASTIC_START_TIMEOUT_S)
