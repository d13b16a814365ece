"""A clone needs nothing beside it: the validator's KubeRay CRDs ship in the repository and in the wheel, and no
tracked file points at a folder beside the repository.

CI runs with a `shared/` folder next to the clone, so these tests copy the tracked files into a temporary
folder that has nothing next to it, and run the user's commands there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from rayjobs.stages import PROJECT_ROOT

# Spelled in two parts so that this file does not name what it looks for.
OUTSIDE = ("../" + "shared", "shared/" + "kuberay")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=PROJECT_ROOT, capture_output=True, text=True, check=True).stdout
    return [name for name in out.split("\0") if name and (PROJECT_ROOT / name).is_file()]


def _python(cwd: Path, *args: str, path: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | ({"PYTHONPATH": str(path)} if path else {})
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """The tracked files as they are in the work tree, in a folder with nothing beside it."""
    root = tmp_path_factory.mktemp("alone") / "rayline"
    for name in _tracked():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(PROJECT_ROOT / name, root / name)
    assert sorted(p.name for p in root.parent.iterdir()) == ["rayline"]
    return root


def test_a_clone_validates_and_renders_with_its_own_crds(clone, tmp_path):
    where = _python(clone, "-c", "import rayjobs.crd_schema as c; print(c.DEFAULT_CRD_DIR)")
    assert Path(where.stdout.strip()) == clone / "rayjobs" / "crds" / "v1.7.0", where.stderr  # the copy runs, not this checkout
    manifests = sorted(str(p.relative_to(clone)) for p in (clone / "rayjobs").glob("**/*.yaml")
                       if "crds" not in p.parts)
    assert manifests
    result = _python(clone, "-m", "pipelines.validate", *manifests)
    assert result.returncode == 0, result.stdout + result.stderr
    documents = sum(len(list(yaml.safe_load_all((clone / m).read_text()))) for m in manifests)
    assert result.stdout.count(": validated (") == documents, result.stdout
    out = tmp_path / "data.yaml"
    result = _python(clone, "-m", "pipelines.render", "--stage", "data", "--config", "configs/data/sample.yaml", "-o", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rendered and validated" in result.stderr
    assert [d["kind"] for d in yaml.safe_load_all(out.read_text())] == ["RayJob", "NetworkPolicy"]


def test_a_wheel_carries_the_crds(clone, tmp_path):
    build = _python(clone, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), ".")
    assert build.returncode == 0, build.stdout + build.stderr
    [wheel] = (tmp_path / "dist").glob("rayline-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = sorted(p.name for p in (clone / "rayjobs" / "crds" / "v1.7.0").iterdir())
    assert {"LICENSE", "README.md", "ray.io_rayjobs.yaml", "ray.io_rayservices.yaml"} <= set(shipped)
    assert {f"rayjobs/crds/v1.7.0/{name}" for name in shipped} <= names
    # Installed (not editable) and imported from elsewhere, the validator finds them inside the package.
    site = tmp_path / "site"
    install = _python(tmp_path, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel))
    assert install.returncode == 0, install.stdout + install.stderr
    check = ("import sys, yaml; from rayjobs import crd_schema as c; print(c.DEFAULT_CRD_DIR); "
             "sys.exit(len(c.check_schema(next(yaml.safe_load_all(open(sys.argv[1]))))))")
    result = _python(tmp_path, "-c", check, str(clone / "rayjobs" / "rendered" / "train-tiny.yaml"), path=site)
    assert result.returncode == 0, result.stdout + result.stderr
    assert Path(result.stdout.strip()) == site / "rayjobs" / "crds" / "v1.7.0"


def test_no_tracked_file_points_beside_the_repository():
    hits = [name for name in _tracked() if any(s in (PROJECT_ROOT / name).read_text(errors="ignore") for s in OUTSIDE)]
    assert hits == [], f"these files name a folder beside the repository, which a clone does not have: {hits}"
