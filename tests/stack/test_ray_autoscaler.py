"""Ray's autoscaler on the local stack (stack/ray_autoscaler.py): the cluster config it gives Ray's autoscaler
and what the head passes on to the nodes it launches. The autoscaler at work (a Serve replica the head cannot
place brings a node, which goes once idle) is tests/serve/test_serve_autoscaling.py."""

from __future__ import annotations

import json

from stack import lifecycle as stack
from core.config import from_dict
from stack.ray_autoscaler import AUTOSCALED_LABEL, autoscaling_config, head_autoscaler
from core.node_labels import NODE_LABEL


def test_the_config_gives_the_autoscaler_one_labelled_worker_type():
    cfg = autoscaling_config(head_cpus=1, node_cpus=2, max_nodes=3, idle_timeout_s=30, gcs_address="127.0.0.1:6399")
    worker = cfg["available_node_types"]["rayline.worker"]
    assert worker == {"resources": {"CPU": 2}, "labels": {NODE_LABEL: AUTOSCALED_LABEL}, "node_config": {},
                      "min_workers": 0, "max_workers": 3}
    assert cfg["provider"]["module"].endswith("fake_multi_node.node_provider.FakeMultiNodeProvider")
    assert cfg["provider"]["gcs_address"] == "127.0.0.1:6399"
    assert cfg["idle_timeout_minutes"] == 0.5 and cfg["max_workers"] == 3


def test_the_head_starts_the_autoscaler_only_when_asked(tmp_path):
    plain = from_dict(stack.StackConfig, {"state_dir": str(tmp_path / "a")})
    assert head_autoscaler(plain) == ([], {})
    cfg = from_dict(stack.StackConfig, {"state_dir": str(tmp_path / "b"), "num_cpus": 1, "ray_port": 6409,
                                        "autoscale_nodes": 2, "node_cpus": 1, "autoscale_idle_timeout_s": 12})
    argv, env = head_autoscaler(cfg)
    (path,) = [a.removeprefix("--autoscaling-config=") for a in argv]
    written = json.loads(open(path).read())
    assert written["max_workers"] == 2 and written["idle_timeout_minutes"] == 0.2
    assert written["provider"]["gcs_address"] == "127.0.0.1:6409"
    assert written["available_node_types"]["ray.head.default"]["resources"] == {"CPU": 1}
    # Autoscaler v2; the nodes it launches inherit a Serve proxy port of their own (any free one).
    assert env["RAY_enable_autoscaler_v2"] == "1" and env["RAY_SERVE_WORKER_PROXY_HTTP_PORT"] == "0"
