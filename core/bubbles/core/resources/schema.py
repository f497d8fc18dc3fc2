"""The table every custom resource is written in: ``Field``, and what comes of a table of them.

A resource's ``spec`` (and ``status``) is a tuple of ``Field`` values. From it come the CRD's structural OpenAPI
schema (``openapi_schema``, ``spec_schema``: what ``bubbles.operator.crd`` writes to ``crds/``), the operator's own
validation (``validate``: the same rules the API server enforces, for emulators and for messages that name the field
and the fix) and the defaults (``apply_defaults``); ``valid_spec`` does both or raises ``ResourceError``. Also here:
the patterns of Kubernetes' names and quantities, and label selectors (their field and ``selector_matches``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bubbles.core.api import parse_duration, parse_quantity

QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?([KMGTPE]i?|k)?$"
CPU_PATTERN = r"^[0-9]+(\.[0-9]+)?m?$"  # cores (2, 0.5) or millicores (500m)
DURATION_PATTERN = r"^[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?(ns|us|µs|ms|s)?$"
TIMEOUT_PATTERN = r"^[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?(ns|us|µs|ms|s|m|h)?$"  # also minutes and hours
ENTRY_PATTERN = r"^[\w.]+:[\w.]+$"
IMAGE_PATTERN = r"^[^\s]+$"
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"  # what Kubernetes accepts as an environment variable's name
DNS_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"  # a Secret's, a ConfigMap's, a claim's name
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"  # a volume's name
LABEL_KEY_PATTERN = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                     r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


# -- the field tables ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Field:
    """One field of a resource's spec: its schema, its checks and its default, in one place."""

    name: str
    type: str  # string | integer | number | boolean | object | array | quantity | cpu | duration | map
    description: str
    required: bool = False
    default: Any = None
    enum: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    pattern: str | None = None
    max_length: int | None = None
    min_items: int | None = None
    max_items: int | None = None
    items: Field | None = None  # for arrays
    fields: tuple[Field, ...] = ()  # for objects
    one_of: tuple[tuple[str, ...], ...] = ()  # for objects: exactly one of each group may be set
    free_form: bool = False  # objects: any JSON (x-kubernetes-preserve-unknown-fields)
    # Rules across fields, in CEL (x-kubernetes-validations, GA in Kubernetes 1.29; an older API server ignores them):
    # (rule on ``self``, the message). The operator checks the same in Python for servers that do not.
    rules: tuple[tuple[str, str], ...] = ()


def parse_cpu(value: Any) -> float | None:
    """Cores from a Kubernetes CPU quantity (``2``, ``0.5``, ``500m``); None if it is not one."""
    if isinstance(value, bool | float):  # the CRD takes an integer or a string, as Kubernetes does
        return None
    try:
        if isinstance(value, int):
            return float(value) if value >= 0 else None
        if isinstance(value, str) and re.match(CPU_PATTERN, value):
            return float(value[:-1]) / 1000 if value.endswith("m") else float(value)
    except OverflowError:
        return None
    return None


# -- schema ----------------------------------------------------------------------------------------------------
def openapi_schema(f: Field) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of one field (what a Kubernetes 1.20 API server enforces: no CEL)."""
    s: dict[str, Any] = {"description": f.description}
    if f.type in ("string", "integer", "number", "boolean"):
        s["type"] = f.type
    elif f.type == "quantity":
        s.update({"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN})
    elif f.type == "cpu":
        s.update({"x-kubernetes-int-or-string": True, "pattern": CPU_PATTERN})
    elif f.type == "duration":
        s.update({"type": "string", "pattern": DURATION_PATTERN})
    elif f.type == "timeout":
        s.update({"type": "string", "pattern": TIMEOUT_PATTERN})
    elif f.type == "map":
        s.update({"type": "object", "additionalProperties": {"type": "string"}})
    elif f.type == "array":
        s["type"] = "array"
        s["items"] = openapi_schema(f.items) if f.items else {"type": "string"}
    elif f.type == "object":
        s["type"] = "object"
        if f.free_form:
            s["x-kubernetes-preserve-unknown-fields"] = True
        else:
            s["properties"] = {c.name: openapi_schema(c) for c in f.fields}
            required = [c.name for c in f.fields if c.required]
            if required:
                s["required"] = required
    else:
        raise ValueError(f"unknown field type {f.type!r}")
    if f.enum:
        s["enum"] = list(f.enum)
    if f.minimum is not None:
        s["minimum"] = f.minimum
    if f.maximum is not None:
        s["maximum"] = f.maximum
    if f.pattern and "pattern" not in s:
        s["pattern"] = f.pattern
    if f.max_length is not None:
        s["maxLength"] = f.max_length
    if f.min_items is not None:
        s["minItems"] = f.min_items
    if f.max_items is not None:
        s["maxItems"] = f.max_items
    if f.default is not None:
        s["default"] = f.default
    validations = [{"rule": rule, "message": message} for rule, message in cel_rules(f)]
    if validations:
        s["x-kubernetes-validations"] = validations
    return s


def cel_rules(f: Field) -> list[tuple[str, str]]:
    """The CEL rules of one field: its one-of groups (exactly one set), then its own rules."""
    rules = [(f"[{', '.join(f'has(self.{n})' for n in group)}].filter(x, x).size() == 1",
              f"needs exactly one of {', '.join(group)}") for group in f.one_of]
    return rules + list(f.rules)


def spec_schema(fields: Sequence[Field], description: str) -> dict[str, Any]:
    """The OpenAPI schema of a resource's ``spec`` from its table."""
    return openapi_schema(Field("spec", "object", description, fields=tuple(fields)))


# -- validation and defaults -----------------------------------------------------------------------------------
class ResourceError(ValueError):
    """A resource the operator cannot act on; the message names the field and what to do."""


def _check(f: Field, value: Any, path: str, errors: list[str]) -> None:
    where = f"{path}"
    if f.type == "string":
        if not isinstance(value, str):
            errors.append(f"{where} must be a string, got {value!r}")
            return
        if f.max_length is not None and len(value) > f.max_length:
            errors.append(f"{where} must be at most {f.max_length} characters")
        if f.pattern and not re.match(f.pattern, value):
            errors.append(f"{where} {value!r} is not valid: {f.description}")
    elif f.type in ("integer", "number"):
        ok = isinstance(value, int) if f.type == "integer" else isinstance(value, int | float)
        if isinstance(value, bool) or not ok or (isinstance(value, float) and not math.isfinite(value)):
            errors.append(f"{where} must be {'an integer' if f.type == 'integer' else 'a number'}, got {value!r}")
            return
        if f.minimum is not None and value < f.minimum:
            errors.append(f"{where} must be >= {f.minimum:g}, got {value}")
        if f.maximum is not None and value > f.maximum:
            errors.append(f"{where} must be <= {f.maximum:g}, got {value}")
    elif f.type == "boolean":
        if not isinstance(value, bool):
            errors.append(f"{where} must be true or false, got {value!r}")
    elif f.type == "quantity":
        try:
            parse_quantity(value, where)
        except ValueError as exc:
            errors.append(str(exc))
    elif f.type == "cpu":
        if parse_cpu(value) is None:
            errors.append(f"{where} must be CPU cores or millicores like 2, 0.5 or 500m, got {value!r}")
    elif f.type in ("duration", "timeout"):
        try:
            parse_duration(value, where, long=f.type == "timeout")
        except ValueError as exc:
            errors.append(str(exc))
    elif f.type == "map":
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            errors.append(f"{where} must be a map of strings to strings")
    elif f.type == "array":
        if not isinstance(value, list):
            errors.append(f"{where} must be a list, got {value!r}")
            return
        if f.min_items is not None and len(value) < f.min_items:
            errors.append(f"{where} must have at least {f.min_items} item(s)")
        if f.max_items is not None and len(value) > f.max_items:
            errors.append(f"{where} must have at most {f.max_items} item(s)")
        if f.items is not None:
            for i, v in enumerate(value):
                _check(f.items, v, f"{where}[{i}]", errors)
    elif f.type == "object":
        if not isinstance(value, dict):
            errors.append(f"{where} must be an object, got {value!r}")
            return
        if not f.free_form:
            _check_object(f.fields, f.one_of, value, where, errors)
    if f.enum and value not in f.enum:
        errors.append(f"{where} must be one of {', '.join(f.enum)}, got {value!r}")


def _check_object(fields: Sequence[Field], one_of: Sequence[tuple[str, ...]], value: Mapping[str, Any], path: str,
                  errors: list[str]) -> None:
    known = {f.name: f for f in fields}
    for name in value:
        if name not in known:
            errors.append(f"{path}.{name} is not a known field; known fields: {', '.join(known)}")
    for f in fields:
        if f.name in value and value[f.name] is not None:
            _check(f, value[f.name], f"{path}.{f.name}", errors)
        elif f.required:
            errors.append(f"{path}.{f.name} is required: {f.description}")
    for group in one_of:
        given = [n for n in group if value.get(n) is not None]
        if len(given) != 1:
            errors.append(f"{path} needs exactly one of {', '.join(group)}, got "
                          f"{', '.join(given) if given else 'none'}")


def validate(fields: Sequence[Field], spec: Any, path: str = "spec") -> list[str]:
    """Every rule of the table broken by ``spec`` (an empty list: valid)."""
    if not isinstance(spec, dict):
        return [f"{path} must be an object"]
    errors: list[str] = []
    _check_object(fields, (), spec, path, errors)
    return errors


def apply_defaults(fields: Sequence[Field], spec: Mapping[str, Any]) -> dict[str, Any]:
    """``spec`` with every defaulted field that was left out filled in (as the API server would)."""
    out = dict(spec)
    for f in fields:
        if out.get(f.name) is None and f.default is not None:
            out[f.name] = f.default
        elif f.type == "object" and not f.free_form and isinstance(out.get(f.name), dict):
            out[f.name] = apply_defaults(f.fields, out[f.name])
    return out


def valid_spec(fields: Sequence[Field], obj: Mapping[str, Any]) -> dict[str, Any]:
    """An object's spec, checked against ``fields`` (ResourceError listing every problem) and defaulted."""
    errors = validate(fields, obj.get("spec"))
    if errors:
        raise ResourceError("; ".join(errors))
    return apply_defaults(fields, obj["spec"])


# -- label selectors -------------------------------------------------------------------------------------------
def label_selector_field(name: str, description: str, required: bool = False,
                         rules: tuple[tuple[str, str], ...] = ()) -> Field:
    """A Kubernetes label selector's field (matchLabels, matchExpressions) named ``name``."""
    return Field(name, "object", description, required=required, rules=rules, fields=(
        Field("matchLabels", "map", "labels every selected object has (key: value)"),
        Field("matchExpressions", "array", "set-based requirements, as in any Kubernetes label selector",
              items=Field("requirement", "object", "one requirement", fields=(
                  Field("key", "string", "the label's key", required=True, pattern=LABEL_KEY_PATTERN),
                  Field("operator", "string", "how the values are matched", required=True,
                        enum=("In", "NotIn", "Exists", "DoesNotExist")),
                  Field("values", "array", "values for In and NotIn", items=Field("value", "string", "a value")),
              ))),
    ))


def selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """Whether ``labels`` satisfy a Kubernetes label selector (empty or None: everything)."""
    if not selector:
        return True
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for req in selector.get("matchExpressions") or []:
        key, op, values = req["key"], req["operator"], req.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True
