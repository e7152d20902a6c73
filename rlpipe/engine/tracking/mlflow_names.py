"""MLflow names and values: valid keys, config flattened to params, batches of log calls."""

from __future__ import annotations

import json
import re
from typing import Any

from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

_BAD_KEY_CHARS = re.compile(r"[^/\w.\- ]")  # what MLflow accepts in keys on every OS (no colon on Windows)
_MAX_KEY = 250
_MAX_LIST_PARAMS = 16  # longer lists become one JSON param instead of one param per item


def key(name: str) -> str:
    """A valid MLflow metric/param/tag key for ``name`` (bad characters become '_')."""
    k = _BAD_KEY_CHARS.sub("_", str(name))
    k = re.sub(r"/+", "/", k).strip("/")  # MLflow rejects keys that normalise as paths differently
    k = "/".join(p if p not in (".", "..") else "_" for p in k.split("/"))
    return k[:_MAX_KEY] or "_"


def flatten(obj: Any, prefix: str = "") -> dict[str, str]:
    """Nested dicts/lists → {"a.b.0": "value"}; long lists stay one JSON value."""
    out: dict[str, str] = {}
    if isinstance(obj, dict) and obj:
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)) and obj and len(obj) <= _MAX_LIST_PARAMS:
        for i, v in enumerate(obj):
            out.update(flatten(v, f"{prefix}.{i}" if prefix else str(i)))
    elif prefix:
        if isinstance(obj, (dict, list, tuple)):
            text = json.dumps(obj, sort_keys=True, default=str)
        else:
            text = str(obj)
        out[prefix] = text[:MAX_PARAM_VAL_LENGTH]
    return out


def chunks(items: list, n: int):
    """``items`` in slices of at most ``n`` (MLflow's per-call limits on metrics, params, tags)."""
    for i in range(0, len(items), n):
        yield items[i : i + n]
