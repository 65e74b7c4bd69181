"""Reading YAML and JSON configuration with duplicate keys as errors: both formats silently keep
the last of two equal keys, so ``steps: 60`` followed later by ``steps: 6`` trains 6 steps.
"""

from __future__ import annotations

import json
import os
from typing import Any

import yaml

__all__ = ["UniqueKeyLoader", "load_json_unique", "load_yaml_unique"]


class UniqueKeyLoader(yaml.SafeLoader):
    """A ``yaml.SafeLoader`` raising ``ValueError`` for a key given twice in one mapping, naming
    :attr:`source` and both lines (``yaml.load(text, UniqueKeyLoader)``; :func:`load_yaml_unique`
    sets the source).

    Example:
        >>> yaml.load("a: 1\\nb: 2\\n", UniqueKeyLoader)
        {'a': 1, 'b': 2}
    """

    source = "<yaml>"
    """What to call the text in an error (its file)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        """SafeLoader's mapping, after checking ``node`` for a repeated key (merge keys ``<<`` aside)."""
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *base`` overrides keys on purpose
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    repeated = key in seen
                except TypeError:  # an unhashable key: SafeLoader raises its own error for it
                    continue
                first = seen.setdefault(key, line)
                if repeated:
                    raise ValueError(f"{self.source}:{line}: duplicate key {key!r} (first at line {first}); "
                                     "YAML would keep only the last: remove one")
        return super().construct_mapping(node, deep=deep)


def load_yaml_unique(text: str, source: str | os.PathLike[str] = "<yaml>") -> Any:
    """``yaml.safe_load(text)``, but a key given twice in one mapping is a ``ValueError`` naming
    ``source``, its line and the first one's; invalid YAML a ``ValueError`` naming ``source``.

    Example:
        >>> load_yaml_unique("training: {steps: 5}\\nseed: 1\\n")
        {'training': {'steps': 5}, 'seed': 1}
        >>> load_yaml_unique("training:\\n  steps: 60\\n  lr: 0.1\\n  steps: 6\\n", "cfg.yaml")
        Traceback (most recent call last):
        ValueError: cfg.yaml:4: duplicate key 'steps' (first at line 2); YAML would keep only the last: remove one
    """
    loader = UniqueKeyLoader(text)
    loader.source = str(source)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as err:
        raise ValueError(f"{source}: not valid YAML: {err}") from err
    finally:
        loader.dispose()


def load_json_unique(text: str, source: str | os.PathLike[str] = "<json>") -> Any:
    """``json.loads(text)``, but a key given twice in one object is a ``ValueError`` naming
    ``source`` and the key; invalid JSON a ``ValueError`` naming ``source`` and the position.

    Example:
        >>> load_json_unique('{"seed": 1, "seed": 2}', "cfg.json")
        Traceback (most recent call last):
        ValueError: cfg.json: duplicate key 'seed' in one object; JSON would keep only the last: remove one
    """

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in items:
            if key in out:
                raise ValueError(f"{source}: duplicate key {key!r} in one object; JSON would keep only the last: "
                                 "remove one")
            out[key] = value
        return out

    try:
        return json.loads(text, object_pairs_hook=pairs)
    except json.JSONDecodeError as err:
        raise ValueError(f"{source}: not valid JSON: {err}") from err
