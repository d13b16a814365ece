"""`make check`'s tier: tests/conftest.py marks `stack` every test that starts the stack or a part of it, so
`-m "not stack"` runs none of them and never starts one."""

import os
import subprocess
import sys
from pathlib import Path

from tests.pipelines.conftest_plugin import conftest_plugin

ROOT = Path(__file__).resolve().parents[2]

PLUGIN = conftest_plugin("pytest_collection_modifyitems")

# Stand-ins named as the real fixtures: if a `not stack` run ever set one up, its test fails.
TESTS = '''
import pytest

@pytest.fixture(scope="session")
def local_stack():
    pytest.fail("the stack was started")

@pytest.fixture()
def ray_session(local_stack):
    yield

@pytest.fixture()
def mini_cfg(tmp_path):
    pytest.fail("a stack of its own was started")

def test_pure_unit():
    assert 1 + 1 == 2

def test_asks_for_the_stack(local_stack):
    pass

def test_reaches_it_through_another_fixture(ray_session):
    pass

def test_starts_a_stack_of_its_own(mini_cfg):
    pass
'''


def pytest_in(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(PLUGIN)
    (tmp_path / "test_sample.py").write_text(TESTS)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           "-c", os.devnull, *args, str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)


def test_a_test_whose_fixture_closure_holds_the_stack_is_marked_and_a_unit_test_is_not(tmp_path):
    marked = pytest_in(tmp_path, "--collect-only", "-m", "stack")
    assert marked.returncode == 0, marked.stdout + marked.stderr
    assert sorted(line.split("::")[1] for line in marked.stdout.splitlines() if "::" in line) == [
        "test_asks_for_the_stack", "test_reaches_it_through_another_fixture", "test_starts_a_stack_of_its_own"]

    run = pytest_in(tmp_path, "-rA", "-m", "not stack")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed, 3 deselected" in run.stdout, run.stdout
    assert "PASSED test_sample.py::test_pure_unit" in run.stdout, run.stdout


def test_the_suites_stack_tests_are_out_of_the_check_tier():
    files = ["tests/stack/test_stack.py", "tests/stack/test_stack_secrets.py",
             "tests/core/test_ray_cluster.py"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", "not stack", *files], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    kept = {line.split("[")[0] for line in proc.stdout.splitlines() if "::" in line}
    # test_stack.py's config checks start nothing; its mini_cfg tests start a stack of their own; test_stack_secrets
    # asks for the test stack (local_stack) or starts Redis and Ray in its body (STACK_TESTS); test_ray_cluster gets
    # it through ray_session.
    assert kept == {"tests/stack/test_stack.py::test_bad_worker_node_settings_are_named"}, proc.stdout
