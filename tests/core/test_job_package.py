"""The job package a laptop submits: the project's code and configs, never what else lies in the checkout."""

import subprocess
from pathlib import Path

import pytest

from core import job_package
from core.job_package import PackageError, build_job_package, package_files

ROOT = Path(__file__).resolve().parents[2]


def _checkout(root: Path) -> Path:
    """A git checkout shaped like the project, with the litter a user leaves in one."""
    files = {
        "pyproject.toml": "[project]\n", "README.md": "# r\n", "pipelines/stage.py": "x = 1\n",
        "serve/batch/rows.py": "y = 2\n", "configs/data/sample.yaml": "a: 1\n", "tests/test_x.py": "",
        "data/notes.txt": "tracked, but not code\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "-C", str(root), "add", "."], check=True)
    litter = {
        "demo.log": "growing\n", "data/corpus/train.jsonl": "{}\n", "pipelines/scratch.py": "untracked code\n",
        "out/model.safetensors": "w", ".venv/bin/python": "", "pipelines/__pycache__/stage.cpython-311.pyc": "",
        "configs/mine.yaml": "b: 2\n",  # a user's own config is input: it travels even untracked
    }
    for rel, text in litter.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_package_holds_tracked_code_and_every_config(tmp_path):
    root = _checkout(tmp_path / "checkout")
    assert package_files(root) == [
        "configs/data/sample.yaml", "configs/mine.yaml", "pipelines/stage.py", "pyproject.toml", "serve/batch/rows.py",
    ]
    dest = build_job_package(root, into=tmp_path)
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == package_files(root)
    assert (dest / "serve/batch/rows.py").read_text() == "y = 2\n"


def test_without_git_the_same_rules_go_by_pattern(tmp_path):
    root = _checkout(tmp_path / "tarball")
    subprocess.run(["rm", "-rf", str(root / ".git")], check=True)
    assert package_files(root) == [
        "configs/data/sample.yaml", "configs/mine.yaml", "pipelines/scratch.py", "pipelines/stage.py", "pyproject.toml",
        "serve/batch/rows.py",
    ]


def test_the_projects_own_package(tmp_path):
    files = package_files(ROOT)
    assert {"pipelines/submit.py", "serve/batch/pipeline.py", "configs/data/sample.yaml", "pyproject.toml"} <= set(files)
    assert all(f == "pyproject.toml" or f.startswith("configs/") or f.endswith(".py") for f in files), files
    assert not [f for f in files if f.startswith(("tests/", "bench/", "docs/"))]


def test_a_package_over_rays_limit_is_refused_in_one_line(tmp_path, monkeypatch):
    root = _checkout(tmp_path / "checkout")
    monkeypatch.setattr(job_package, "MAX_PACKAGE_BYTES", 10)
    (tmp_path / "pkgs").mkdir()
    with pytest.raises(PackageError, match=r"^job package: 0 MiB of code and configs is over Ray's 0 MiB working_dir "
                                           r"limit; move large files out of configs/$"):
        build_job_package(root, into=tmp_path / "pkgs")
    assert not list((tmp_path / "pkgs").iterdir())  # the half-built package is gone
