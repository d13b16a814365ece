"""The node label every node of a rayline cluster carries, and the check of a config's `node_labels` selector."""

from __future__ import annotations

NODE_LABEL = "rayline.io/node"
"""The label every node of the stack carries: `head`, or `worker-<i>` for worker node i."""


def check_node_labels(labels: dict, field: str) -> None:
    """A config's `node_labels` (label -> Ray label-selector value: `v`, `!v`, `in(a,b)`, `!in(a,b)`), checked
    by Ray's own validator (through the public `RayActorOptionsSchema`); a ConfigError names `<field>.<label>`."""
    from core.config import require

    if not labels:
        return
    import pydantic
    from ray.serve.schema import RayActorOptionsSchema  # public; it runs Ray's own label-selector validator

    for key, value in labels.items():
        require(isinstance(value, str) and bool(value.strip()), f"{field}.{key}",
                f"must be a selector string such as 'worker-1' or 'in(a,b)', got {value!r}")
        try:
            RayActorOptionsSchema(label_selector={key: value})
        except pydantic.ValidationError as e:
            require(False, f"{field}.{key}", e.errors()[0]["msg"].removeprefix("Value error, "))
