"""The distribution ships every package (pyproject lists them explicitly; see its comment)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[1]
MAPPING = {"rlpipe": "rlpipe", "stages": "rlpipe.stages", "schemas": "rlpipe.schemas"}


def test_every_package_folder_is_listed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for top, dotted in MAPPING.items():
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top).parts
            found.add(".".join((dotted, *rel)))
    assert found == listed


def test_console_script_points_at_cli_main():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["rlpipe"] == "rlpipe.cli:main"
    from rlpipe.cli import main

    assert callable(main)
