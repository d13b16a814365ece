"""The package a laptop submission uploads as a Ray job's working_dir: the project's code and configs only.

Ray hashes a working_dir, then zips and uploads it; a file that changes in between (a log the user writes
in the checkout, e.g. `make demo > demo.log`) makes every job fail with "Failed to download runtime_env file
package ... from the GCS". So the package is a snapshot copied into a folder of its own first, and it
holds only what a stage runs: the Python files of the project's packages and `pyproject.toml` as git tracks
them, plus every config under `configs/` (a user's own, untracked config is input, not litter). Logs,
outputs, data, environments and anything else untracked stay behind. Without `.git` (a release tarball)
the same rules apply by pattern.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

CODE_PACKAGES = ("pipelines", "core", "data", "train", "serve", "rayjobs")
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")
MAX_PACKAGE_BYTES = 100 * 1024 * 1024  # Ray refuses larger working_dirs (RAY_max_working_dir_size)


class PackageError(RuntimeError):
    """The job package could not be built; the message says why in one line."""


def _tracked(root: Path) -> list[str] | None:
    """Paths git tracks under `root` (relative, posix), or None when `root` is not a git checkout."""
    if not (root / ".git").exists() or shutil.which("git") is None:
        return None
    proc = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, text=True)
    if proc.returncode != 0:
        return None
    return [p for p in proc.stdout.split("\0") if p]


def package_files(root: Path) -> list[str]:
    """The project-relative paths that go into the job package, sorted."""
    tracked = _tracked(root)
    if tracked is None:
        tracked = [p.relative_to(root).as_posix() for pkg in CODE_PACKAGES for p in (root / pkg).rglob("*.py")]
        tracked.append("pyproject.toml")
    code = {p for p in tracked if p == "pyproject.toml" or (p.split("/", 1)[0] in CODE_PACKAGES and p.endswith(".py"))}
    configs = {p.relative_to(root).as_posix() for p in (root / "configs").rglob("*")
               if p.is_file() and p.suffix in CONFIG_SUFFIXES}
    return sorted(p for p in code | configs if "__pycache__" not in p and (root / p).is_file())


def build_job_package(root: Path, into: Path | None = None) -> Path:
    """Copy the package's files from `root` into a new folder (under `into`, or a temp dir) and return it."""
    dest = Path(tempfile.mkdtemp(prefix="rayline-job-", dir=into))
    total = 0
    for rel in package_files(root):
        src, dst = root / rel, dest / rel
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
        except OSError as e:
            shutil.rmtree(dest, ignore_errors=True)
            raise PackageError(f"job package: cannot copy {rel} from {root}: {e.strerror or e}") from None
        total += dst.stat().st_size
    if total > MAX_PACKAGE_BYTES:
        shutil.rmtree(dest, ignore_errors=True)
        raise PackageError(f"job package: {total / 2**20:.0f} MiB of code and configs is over Ray's "
                           f"{MAX_PACKAGE_BYTES / 2**20:.0f} MiB working_dir limit; move large files out of configs/")
    return dest
