"""A tiny Ray Serve app (no vLLM) for the deploy-target tests: it answers its `message` arg at its route prefix;
with `fail: true` its replica raises in the constructor, as a replica whose engine cannot start does.

    import_path: tests.serve.echo_app:build     args: {message: "...", fail: false}

The Ray head of the test stack has the project root on its PYTHONPATH, so Serve's controller can import it.
"""

from __future__ import annotations

from ray import serve


@serve.deployment(ray_actor_options={"num_cpus": 0}, health_check_period_s=2)
class Echo:
    def __init__(self, message: str, fail: bool):
        if fail:
            raise RuntimeError(f"echo replica told to fail (message {message!r})")
        self.message = message

    async def __call__(self, request) -> dict:
        return {"message": self.message}


def build(args: dict):
    """Serve's application builder: args -> the bound app."""
    return Echo.bind(str(args.get("message", "")), bool(args.get("fail", False)))
