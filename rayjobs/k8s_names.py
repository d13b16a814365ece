"""Kubernetes name rules (k8s.io/apimachinery/pkg/util/validation): each function says why a value is not a
valid name of its kind, as a list of reasons (empty when it is one)."""

from __future__ import annotations

import re

_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")


def dns1123_label_errors(value: str) -> list[str]:
    """Why `value` is not a DNS-1123 label (namespace names, Service names); empty if it is one."""
    errs = [] if _DNS1123_LABEL.fullmatch(value) else ["must consist of lower case alphanumerics or '-', and start and end with an alphanumeric"]
    return errs + (["must be no more than 63 characters"] if len(value) > 63 else [])


def dns1035_label_errors(value: str) -> list[str]:
    """Why `value` is not a DNS-1035 label (KubeRay's rule for RayCluster/RayJob/RayService names)."""
    errs = [] if _DNS1035_LABEL.fullmatch(value) else ["must consist of lower case alphanumerics or '-', start with a letter and end with an alphanumeric"]
    return errs + (["must be no more than 63 characters"] if len(value) > 63 else [])


def dns1123_subdomain_errors(value: str) -> list[str]:
    """Why `value` is not a DNS-1123 subdomain (custom resource names, label key prefixes)."""
    ok = all(_DNS1123_LABEL.fullmatch(part) for part in value.split("."))
    errs = [] if ok else ["must consist of lower case alphanumerics, '-' or '.', and start and end with an alphanumeric"]
    return errs + (["must be no more than 253 characters"] if len(value) > 253 else [])


def qualified_name_errors(value: str) -> list[str]:
    """Why `value` is not a qualified name (`prefix/name`), the rule for label and annotation keys."""
    prefix, _, name = value.rpartition("/")
    errs = [f"prefix {e}" for e in dns1123_subdomain_errors(prefix)] if "/" in value else []
    if not _QUALIFIED_NAME.fullmatch(name):
        errs.append("name part must be alphanumerics, '-', '_' or '.', starting and ending with an alphanumeric")
    if len(name) > 63:
        errs.append("name part must be no more than 63 characters")
    return errs


def label_value_errors(value: str) -> list[str]:
    """Why `value` is not a valid label value (empty, or a qualified name part of at most 63 characters)."""
    if value == "":
        return []
    return qualified_name_errors(value) if "/" not in value else ["must not contain '/'"]
