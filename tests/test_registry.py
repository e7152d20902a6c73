"""The one registry mechanism: lookup errors, duplicates, entry-point plugins."""

from __future__ import annotations

import sys

import pytest

from rlpipe import registry as reg
from rlpipe.errors import RegistryError


def test_unknown_name_lists_known_sorted():
    r = reg.Registry("widget")
    r.add("zeta", object())
    r.add("alpha", object())
    with pytest.raises(RegistryError, match=r"unknown widget 'xyz'; known: alpha, zeta"):
        r.get("xyz")
    with pytest.raises(RegistryError, match=r"unknown widget 'alpah'; did you mean 'alpha'\?; known: alpha, zeta"):
        r.get("alpah")


def test_duplicate_name_raises_naming_both():
    r = reg.Registry("widget")

    @r.register("same")
    def first():
        pass

    with pytest.raises(RegistryError, match="duplicate widget name 'same'.*first"):

        @r.register("same")
        def second():
            pass


def test_registry_is_one_per_kind():
    assert reg.registry("test_kind_x") is reg.registry("test_kind_x")


def test_entry_point_plugin_registers_parts(tmp_path, monkeypatch):
    """A third-party package's `rlpipe.plugins` entry point is imported and registers its parts."""
    dist = tmp_path / "rlpipe_fake_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rlpipe-fake-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[rlpipe.plugins]\nfake = rlpipe_fake_plugin_mod\n")
    (tmp_path / "rlpipe_fake_plugin_mod.py").write_text(
        "from rlpipe.registry import registry\n"
        "registry('scorer').add('fake_plugin_scorer', lambda *a, **k: None)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(reg, "_loaded", False)
    reg.load_plugins()
    assert "fake_plugin_scorer" in reg.registry("scorer").names()
    del reg.registry("scorer")._items["fake_plugin_scorer"]
    sys.modules.pop("rlpipe_fake_plugin_mod", None)
