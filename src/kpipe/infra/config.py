"""Config validation: JSON-Schema with defaults, errors reduced to one line naming the key."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema
import yaml

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_SCHEMA = REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml"


class ConfigError(ValueError):
    """A config key is unknown, missing or of the wrong type/value."""


def _with_defaults(validator_class: type) -> type:
    """A validator that fills `default` values of absent properties while it validates.

    This is the jsonschema documentation's recipe; defaults of nested objects are filled
    because the parent's default ({}) is inserted before its own properties are visited.
    """
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator: Any, properties: Mapping, instance: Any, schema: Mapping) -> Any:
        if isinstance(instance, dict):
            for name, subschema in properties.items():
                if "default" in subschema and name not in instance:
                    instance[name] = copy.deepcopy(subschema["default"])
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


_Validator = _with_defaults(jsonschema.Draft202012Validator)


RANGE_VALIDATORS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _key_path(error: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(top level)"


def describe(error: jsonschema.ValidationError) -> str:
    """One line: the offending key and why."""
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed))
        prefix = _key_path(error)
        key = f"{prefix}.{extra[0]}" if prefix != "(top level)" else extra[0]
        return f"config error: {key}: unknown key (allowed here: {', '.join(allowed)})"
    if error.validator in RANGE_VALIDATORS:
        return f"config error: {_key_path(error)}: out of range: {error.message}"
    if error.validator == "type" and _number_yaml_read_as_text(error.instance):
        return (f"config error: {_key_path(error)}: {error.message}: YAML reads a number with an exponent "
                f"but no dot as text; write {_with_dot(error.instance)}")
    return f"config error: {_key_path(error)}: {error.message}"


def _number_yaml_read_as_text(value: Any) -> bool:
    """'1e-12': a number to Python and YAML 1.2, a string to YAML 1.1 (PyYAML, Snakemake)."""
    if not isinstance(value, str):
        return False
    try:
        float(value)
    except ValueError:
        return False
    return "e" in value.lower() and "." not in value


def _with_dot(text: str) -> str:
    mantissa, _, exponent = text.lower().partition("e")
    return f"{mantissa}.0e{exponent}"


# libyaml's safe loader where PyYAML was built with it: the schema is read by every Snakemake
# start (its plan, a dry run, each job), and the pure-Python loader took 0.1 s of it
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_schema(path: Path = DEFAULT_SCHEMA) -> dict[str, Any]:
    return yaml.load(Path(path).read_text(), Loader=SAFE_LOADER)


def canonical(value: Any) -> Any:
    """`value` with every mapping's keys sorted, recursively.

    Snakemake compares rule params by their text, so key order must not depend on how the
    YAML file happened to be written.
    """
    if isinstance(value, Mapping):
        return {key: canonical(value[key]) for key in sorted(value, key=str)}
    if isinstance(value, list):
        return [canonical(item) for item in value]
    return value


def validate_config(config: dict[str, Any], schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """Validate `config` in place, filling defaults and sorting keys; raise ConfigError with one line otherwise."""
    schema = schema if schema is not None else load_schema()
    validator = _Validator(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: (len(e.absolute_path), e.path))
    if errors:
        deepest = jsonschema.exceptions.best_match(errors)
        raise ConfigError(describe(deepest))
    ordered = canonical(config)
    config.clear()
    config.update(ordered)
    return config


def load_config(*paths: str | Path, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """Merge YAML files left to right (later overlays win, dicts merged deeply) and validate."""
    merged: dict[str, Any] = {}
    for path in paths:
        merged = deep_merge(merged, yaml.safe_load(Path(path).read_text()) or {})
    return validate_config(merged, schema)


def parse_nested_strings(value: Any) -> Any:
    """`value` with every string inside a mapping or list read as YAML.

    Snakemake reads a nested ``--config key='{"size_cap": 128}'`` with YAML's BaseLoader, which
    leaves every scalar a string; a config file would have read 128 as a number."""
    if isinstance(value, Mapping):
        return {key: parse_nested_strings(item) if isinstance(item, (Mapping, list)) else _yaml_scalar(item)
                for key, item in value.items()}
    if isinstance(value, list):
        return [parse_nested_strings(item) if isinstance(item, (Mapping, list)) else _yaml_scalar(item)
                for item in value]
    return value


def _yaml_scalar(item: Any) -> Any:
    return yaml.safe_load(item) if isinstance(item, str) else item


def deep_merge(base: Mapping[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    """`overlay` on top of `base`; nested mappings merge, everything else is replaced."""
    out = copy.deepcopy(dict(base))
    for key, value in overlay.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
