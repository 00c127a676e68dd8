"""What `pip install .` puts in a wheel: every package of the tree. An editable install
(make setup, CI) maps the source folders and would hide a package missing from
pyproject's list; the images (`pip install .`) would not start."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def packages_in_tree(config: dict) -> set[str]:
    found = set()
    for package, folder in config["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *rel.parts]))
    return found


def test_every_package_folder_is_in_the_wheel():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    missing = packages_in_tree(config) - listed
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {sorted(missing)}"
    assert not listed - packages_in_tree(config), "pyproject lists packages the tree does not have"


def test_the_check_sees_a_package_left_out():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "diffq.core.brokers" in packages_in_tree(config) - (set(config["packages"]) - {"diffq.core.brokers"})
