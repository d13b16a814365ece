"""Session fixtures that start the real parts once: a Ray head, an MLflow server and Swift (S3).

The test stack lives in `.rayline-test/` on its own ports, so it never touches a developer's `.rayline/`
demo stack. A stack that was already up when the session began is reused and left running; one the
session started is stopped at the end, by PID.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest

# Ray reads this once at import: keep the test stack's drivers on 127.0.0.1 whatever imports ray first.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stack import lifecycle as stack, objectstore  # noqa: E402
from core.config import from_dict  # noqa: E402
from stack.config import SERVE_REPLICA_PORTS  # noqa: E402

# `make test` runs the suite in two pytest-xdist workers (gw0, gw1), each on a test stack of its own: a state dir and
# ports no other stack of the suite uses (the private stacks of test_gcs_restart.py, test_serve_autoscaling.py and
# test_stack.py included), and each its own share of Serve's replica port ranges, so that neither stack's HAProxy can
# ever reach a replica of the other (replica_ports). A plain `pytest` is gw0's stack.
TEST_STACKS = (
    {"state_dir": ".rayline-test", "ray_port": 6389, "dashboard_port": 8275, "ray_client_port": 23011,
     "dashboard_agent_port": 52375, "min_worker_port": 24000, "max_worker_port": 24999,
     "serve_port": 8010, "mlflow_port": 5010, "s3_port": 8090, "memcached_port": 11221, "bucket": "rayline-test",
     "prometheus_port": 9190, "metrics_export_port": 8095, "node_port_base": 25000},
    {"state_dir": ".rayline-test-gw1", "ray_port": 6489, "dashboard_port": 8375, "ray_client_port": 23111,
     "dashboard_agent_port": 52475, "min_worker_port": 27000, "max_worker_port": 27999,
     "serve_port": 8110, "mlflow_port": 5110, "s3_port": 8190, "memcached_port": 11321, "bucket": "rayline-test",
     "prometheus_port": 9390, "metrics_export_port": 8395, "node_port_base": 20000, "redis_port": 6490},
)
REPLICA_PORT_SHARES = ("gw0", "gw1", "gcs", "autoscaling")


def replica_ports(share: str) -> dict[str, str]:
    """The `ray_env` that gives a stack of the suite its own quarter of Serve's direct-ingress port ranges
    (stack/config.py SERVE_REPLICA_PORTS): Serve hands replicas the lowest free port of the range on each node, so
    two stacks on one machine would otherwise take turns on the same ports."""
    (http_lo, http_hi), (grpc_lo, grpc_hi) = SERVE_REPLICA_PORTS
    width = (http_hi - http_lo + 1) // len(REPLICA_PORT_SHARES)
    i = REPLICA_PORT_SHARES.index(share)
    return {"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(http_lo + i * width),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(http_lo + (i + 1) * width - 1),
            "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(grpc_lo + i * width),
            "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(grpc_lo + (i + 1) * width - 1)}


def xdist_worker() -> int:
    """This process's pytest-xdist worker number (gw1 -> 1), 0 outside xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(name.removeprefix("gw"))
    if index >= len(TEST_STACKS):
        raise pytest.UsageError(f"tests/conftest.py has test stacks for {len(TEST_STACKS)} xdist workers, not "
                                f"{name}: run `pytest -n {len(TEST_STACKS)}` or fewer, or add one to TEST_STACKS")
    return index


TEST_STACK = {**TEST_STACKS[xdist_worker()], "ray_env": replica_ports(f"gw{xdist_worker()}")}
"""This worker's test stack (StackConfig fields)."""


def pytest_configure(config):
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# Fixtures that start servers: the shared test stack (and so every fixture built on it: worker_nodes, ray_session,
# served, ...) and the private stacks a few modules start on ports of their own.
STACK_FIXTURES = {"local_stack", "mini_cfg", "gcs_stack", "autoscaling_stack"}
# Tests that start stack parts in their own body, without one of those fixtures.
STACK_TESTS = ("tests/stack/test_stack_secrets.py::test_the_gcs_redis_takes_only_the_stacks_certificate",)


# Modules whose tests share a session fixture's set-up (the served app, the prepared train data) and so run on one
# xdist worker, where it is set up once; every other module is a group of its own. Collection checks that each
# module using one of SHARED_SETUPS is listed here with its group.
SHARED_SETUPS = {"served": "serve-app", "client": "serve-app", "prepared_manifest": "train-data",
                 "make_train_config": "train-data", "start_stage": "train-data", "run_stage": "train-data",
                 "history": "train-data"}
SHARED_MODULES = {
    **dict.fromkeys(("tests/serve/test_api_keys.py", "tests/serve/test_doors.py", "tests/serve/test_ingress_deployment.py",
                     "tests/serve/test_llm_hooks.py", "tests/serve/test_serve.py", "tests/serve/test_serve_adapters.py"),
                    "serve-app"),
    **dict.fromkeys(("tests/train/test_elastic.py", "tests/train/test_lora.py", "tests/train/test_preflight.py",
                     "tests/train/test_spot_notice.py",
                     "tests/train/test_train_stage.py", "tests/train/test_train_wait.py", "tests/train/test_tune_stage.py"),
                    "train-data"),
}
# The longest groups (about 100-500 s each), started first so that the two workers end together; the rest follow in
# collection order. Only an order: a group missing here, or one that moved, costs time, never a result.
LONG_FIRST = ("tests/pipelines/test_demo.py", "tests/serve/test_canary.py", "train-data", "serve-app",
              "tests/serve/test_node_loss.py", "tests/serve/test_gcs_restart.py", "tests/serve/test_rollout.py",
              "tests/serve/test_serve_autoscaling.py", "tests/posttrain/test_dpo_stage.py",
              "tests/posttrain/test_grpo_stage.py", "tests/posttrain/test_dpo_tune.py", "tests/stack/test_stack.py")


def test_group(nodeid: str) -> str:
    """The xdist group of a test: its module's shared set-up (SHARED_MODULES), else its module."""
    module = nodeid.split("::")[0]
    return SHARED_MODULES.get(module, module)


def pytest_collection_modifyitems(config, items):
    """Mark `stack` every test that starts the stack or a part of it: one whose fixture closure holds a
    STACK_FIXTURES name, or one of STACK_TESTS. `make check` deselects them (`-m "not stack"`). Under xdist, put the
    LONG_FIRST groups first (xdist hands out groups in this order)."""
    for item in items:
        if STACK_FIXTURES.intersection(item.fixturenames) or item.nodeid.startswith(STACK_TESTS):
            item.add_marker(pytest.mark.stack)
        for fixture in sorted(SHARED_SETUPS.keys() & set(item.fixturenames)):
            if test_group(item.nodeid) != SHARED_SETUPS[fixture]:
                raise pytest.UsageError(
                    f"{item.nodeid} uses the shared set-up `{fixture}`: list its module in tests/conftest.py "
                    f"SHARED_MODULES as {SHARED_SETUPS[fixture]!r}, so that it runs on the xdist worker that has it")
    # One process keeps collection order: the app `served` deploys stays up to the session's end, holding a CPU, and
    # the posttrain stages, which collection runs before it, waited for that CPU when run after it.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {g: i for i, g in enumerate(LONG_FIRST)}
        items.sort(key=lambda item: rank.get(test_group(item.nodeid), len(rank)))  # stable within a rank


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """`make test`'s xdist scheduler: a worker takes whole groups (test_group), in collection order. (xdist's own
    `--dist loadgroup` marks cannot do it under pytest 9.2, whose node ids no longer come from `_nodeid`, the
    attribute xdist 3.8 appends the group to.)"""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return test_group(nodeid)

    config.option.loadscopereorder = False  # keep LONG_FIRST's order, not xdist's by test count
    return GroupScheduling(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI (`CI` set, as `.ci/run` runs) a skipped test is a failure: every part the suite needs (Swift, vLLM,
    ...) is installed there, so a skip can only hide a missing install step or a broken fixture."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("CI") and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, where nothing may be: {reason}"


@pytest.fixture(scope="session")
def promtool() -> str:
    """Debian's `promtool` (Prometheus's own rule checker and PromQL engine), or the test is skipped."""
    import shutil

    from stack import prometheus

    path = shutil.which("promtool")
    if path is None:
        pytest.skip(f"promtool not installed: {prometheus.available()}")
    return path


@pytest.fixture(scope="session")
def stack_cfg() -> stack.StackConfig:
    return from_dict(stack.StackConfig, {**TEST_STACK, "s3": objectstore.available() is None}, "tests/conftest.py")


STACK_DATA = ("mlflow", "swift", "prometheus")  # under the test stack's state dir: what its servers store


def clear_stack_data(cfg: stack.StackConfig) -> list[str]:
    """Remove what an earlier session's test stack stored (MLflow's registry and artifacts, Swift's objects,
    Prometheus's samples) when no part of it is running; returns what went. Every session registers models under
    names of its own and none are deleted, so a checkout's registry only grew (1.3 GB after a few days), and MLflow
    3.17's version page cannot save an alias for a model that is not among the first 100 the registry lists by name
    (its registered-model search, which replaces the page's model list, answers with those only)."""
    import shutil

    if any(stack.part_healthy(cfg, p) for p in ("ray", "mlflow", "s3", "prometheus")):
        return []
    gone = [d for d in STACK_DATA if (cfg.state / d).exists()]
    for d in gone:
        shutil.rmtree(cfg.state / d)
    return gone


@pytest.fixture(scope="session")
def local_stack(stack_cfg):
    """The running test stack; its env vars (RAY_ADDRESS, MLFLOW_TRACKING_URI, AWS_*) are set in os.environ. A stack
    this session starts starts empty (clear_stack_data)."""
    already = all(stack.part_healthy(stack_cfg, p) for p in (["ray", "mlflow"] + (["s3"] if stack_cfg.s3 else [])))
    clear_stack_data(stack_cfg)
    stack.up(stack_cfg)
    saved = dict(os.environ)
    os.environ.update(stack.env_vars(stack_cfg))
    yield stack_cfg
    os.environ.clear()
    os.environ.update(saved)
    if not already and not os.environ.get("RAYLINE_KEEP_TEST_STACK"):
        stack.down(stack_cfg)


@pytest.fixture(scope="module")
def worker_nodes(local_stack):
    """Two 1-CPU worker nodes (`rayline.io/node` worker-1, worker-2) joined to the test stack's head for one
    module's fault tests, stopped when it ends, so the other tests keep a one-node cluster."""
    cfg = dataclasses.replace(local_stack, nodes=2, node_cpus=1)
    stack.up(cfg, parts=["nodes"])
    try:
        yield cfg
    finally:
        stack.down(cfg, parts=["nodes"])


@pytest.fixture(scope="session")
def s3_bucket(local_stack) -> str:
    """The test bucket as an s3:// URI prefix; skipped with the reason where Swift cannot run."""
    reason = objectstore.available()
    if reason:
        pytest.skip(f"S3 tests need Swift: {reason}")
    return f"s3://{local_stack.bucket}"


@pytest.fixture(scope="module")
def log_growing_in_checkout():
    """A file in the project root that grows while the module's jobs are packaged and submitted, as
    `make demo > demo.log` leaves one; it never travels with a job, so it must not break one."""
    import threading
    import uuid

    path = ROOT / f"demo-{uuid.uuid4().hex[:8]}.log"
    stop = threading.Event()

    def grow():
        with open(path, "a") as f:
            while not stop.wait(0.02):
                f.write("a line of log output\n")
                f.flush()

    writer = threading.Thread(target=grow, daemon=True)
    writer.start()
    yield path
    stop.set()
    writer.join()
    path.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from stack.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), "tiny", seed=0)


@pytest.fixture(scope="session")
def sample_corpus_dir(tmp_path_factory) -> Path:
    from stack.sample_corpus import write_corpus

    out = tmp_path_factory.mktemp("corpus")
    write_corpus(out, seed=0, n_train=600, n_eval=100)
    return out


@pytest.fixture()
def ray_session(local_stack):
    """A Ray driver connected to the test stack's head (shut down after the test)."""
    import ray

    from core.ray_cluster import init_ray

    init_ray()
    yield ray
    ray.shutdown()
