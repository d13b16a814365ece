"""tests/conftest.py's hooks as a pytest plugin's source, for tests that run pytest on a temporary test file."""

from __future__ import annotations

from pathlib import Path

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


def conftest_plugin(*hooks: str) -> str:
    """A plugin module's source that loads tests/conftest.py and exposes the named hooks of it."""
    return "\n".join([
        "import importlib.util",
        f"spec = importlib.util.spec_from_file_location('rayline_tests_conftest', {str(CONFTEST)!r})",
        "module = importlib.util.module_from_spec(spec)",
        "spec.loader.exec_module(module)",
        *(f"{hook} = module.{hook}" for hook in hooks),
        "",
    ])
