"""The node label every node of a rayline cluster carries, and the check of a config's `node_labels` selector."""

from __future__ import annotations

NODE_LABEL = "rayline.io/node"
"""The label every node of the stack carries: `head`, or `worker-<i>` for worker node i."""


def check_node_labels(labels: dict, field: str) -> None:
    """A config's `node_labels` (label -> Ray label-selector value: `v`, `!v`, `in(a,b)`, `!in(a,b)`), checked
    by Ray's own validator; a ConfigError names `<field>.<label>`."""
    from core.config import require

    if not labels:
        return
    from ray._private.label_utils import validate_label_selector

    for key, value in labels.items():
        require(isinstance(value, str) and bool(value.strip()), f"{field}.{key}",
                f"must be a selector string such as 'worker-1' or 'in(a,b)', got {value!r}")
        error = validate_label_selector({key: value})
        require(error is None, f"{field}.{key}", str(error))
