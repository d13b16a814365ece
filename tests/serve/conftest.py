"""The OpenAI app of the serve tests, deployed once per session and shared (one vLLM engine on the 2-core head).

`served` deploys the tiny model through the real entry point (`python -m pipelines.serve`) as
`models:/rayline-serve-test@champion`; test_serve.py drives its routes and errors, test_llm_hooks.py the
version stamps rayline adds to vLLM's model routes. The app is removed when the session ends.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import yaml

from core import registry
from serve.promotion.deploy_target import LocalServe
from tests.serve.serving import (SERVED_APP, SERVED_MODEL, SERVED_PREFIX, openai_client, register_fresh,
                                 serve_config_dict)


@pytest.fixture(scope="session")
def served(local_stack, tiny_model_dir, tmp_path_factory):
    """{version, label, target, base_url, ready_at} of the deployed app (`ready_at`: when the deploy returned, the
    replica having set its served-version gauge before)."""
    (version,) = register_fresh(SERVED_MODEL, [(str(tiny_model_dir), {"eval.exact_match": "0.6"})])
    registry.set_alias(SERVED_MODEL, "champion", version)
    cfg_file = tmp_path_factory.mktemp("serve-config") / "serve.yaml"
    cfg_file.write_text(yaml.safe_dump(serve_config_dict(SERVED_APP, SERVED_PREFIX, SERVED_MODEL)))
    target = LocalServe(SERVED_APP)
    try:
        out = subprocess.run([sys.executable, "-m", "pipelines.serve", "--config", str(cfg_file)],
                             capture_output=True, text=True, timeout=900, cwd=registry.PROJECT_ROOT)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"serving {SERVED_MODEL}/{version} as 'rayline'" in out.stdout
        yield {"version": version, "label": f"{SERVED_MODEL}/{version}", "target": target,
               "base_url": f"http://127.0.0.1:{local_stack.serve_port}{SERVED_PREFIX}/v1", "ready_at": time.time()}
    finally:
        target.delete()


@pytest.fixture(scope="session")
def client(served):
    return openai_client(served["base_url"])
