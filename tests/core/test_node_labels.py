"""A config's node_labels are checked by Ray's own label-selector rules at load, naming the field."""

import pytest

from core.config import ConfigError
from core.node_labels import check_node_labels


@pytest.mark.parametrize("value", ["worker-1", "!worker-1", "in(worker-1,worker-2)", "!in(a,b)"])
def test_selectors_ray_accepts_pass(value):
    check_node_labels({"rayline.io/node": value}, "node_labels")


@pytest.mark.parametrize("labels, where, says", [
    ({"rayline.io/node": "in(a,"}, r"node_labels\.rayline\.io/node", "Invalid label selector value"),
    ({"bad key!": "x"}, r"node_labels\.bad key!", "Invalid label key name"),
    ({"rayline.io/node": " "}, r"node_labels\.rayline\.io/node", "selector string"),
])
def test_a_bad_selector_names_the_field_and_rays_reason(labels, where, says):
    with pytest.raises(ConfigError, match=where) as e:
        check_node_labels(labels, "node_labels")
    assert says in str(e.value)
