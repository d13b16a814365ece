"""In CI a skipped test fails the run (tests/conftest.py): a skip there can only hide a missing part."""

import os
import subprocess
import sys
from pathlib import Path

from tests.pipelines.conftest_plugin import conftest_plugin

ROOT = Path(__file__).resolve().parents[2]

PLUGIN = conftest_plugin("pytest_runtest_makereport")

TESTS = '''
import pytest

def test_passes():
    pass

def test_needs_a_part():
    pytest.skip("Swift is not installed")

@pytest.mark.xfail(reason="known", strict=True)
def test_known_failure():
    assert False
'''


def _run(tmp_path: Path, ci: bool) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(PLUGIN)
    (tmp_path / "test_sample.py").write_text(TESTS)
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": "true"} if ci else {})
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           "-c", os.devnull, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_skip_fails_in_ci(tmp_path):
    proc = _run(tmp_path, ci=True)
    assert proc.returncode == 1, proc.stdout
    assert "1 failed, 1 passed, 1 xfailed" in proc.stdout, proc.stdout
    assert "skipped in CI, where nothing may be: Skipped: Swift is not installed" in proc.stdout, proc.stdout


def test_a_skip_stays_a_skip_elsewhere(tmp_path):
    proc = _run(tmp_path, ci=False)
    assert proc.returncode == 0, proc.stdout
    assert "1 passed, 1 skipped, 1 xfailed" in proc.stdout, proc.stdout
