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


MAX_MODULE_LINES = 500
"""The house limit (DESIGN.md, house style): a module that grows past it is split by concern."""


def test_no_module_of_the_package_is_over_the_house_limit():
    sizes = {str(path.relative_to(ROOT)): len(path.read_text().splitlines())
             for top in MAPPING for path in (ROOT / top).rglob("*.py")}
    assert {path: n for path, n in sizes.items() if n > MAX_MODULE_LINES} == {}
