"""The package's own metadata, read from pyproject.toml and the Makefile.

``make dist-check`` reads what the built wheel says; these catch, without building, a
declared Python that ``make test-pythons`` would not test, or an extra that repeats
another's requirement instead of naming it.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_declared_pythons_are_the_ones_make_test_pythons_builds() -> None:
    classifiers = [
        c.rsplit(" :: ", 1)[1]
        for c in PROJECT["classifiers"]
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    ]
    makefile = (ROOT / "Makefile").read_text()
    found = re.search(r"^PYTHONS \?= (.+)$", makefile, re.MULTILINE)
    assert found is not None
    assert found.group(1).split() == classifiers == ["3.11", "3.12", "3.13"]
    assert PROJECT["requires-python"] == f">={classifiers[0]}"
    assert "make test-pythons" in (ROOT / ".ci" / "run").read_text()
    assert "make dist-check" in (ROOT / ".ci" / "run").read_text()


def test_the_license_is_an_spdx_expression_with_its_file() -> None:
    assert PROJECT["license"] == "Apache-2.0"
    assert PROJECT["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert not any(c.startswith("License ::") for c in PROJECT["classifiers"])  # PEP 639
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert any(re.fullmatch(r"setuptools>=(7[7-9]|[89]\d)(\.\d+)*", r) for r in build), build


def test_no_extra_repeats_a_requirement_of_another() -> None:
    extras: dict[str, list[str]] = PROJECT["optional-dependencies"]
    owner: dict[str, str] = {}
    for extra, requirements in extras.items():
        for requirement in requirements:
            if requirement.startswith("velomux_quic["):
                named = requirement[len("velomux_quic[") : -1]
                assert named in extras, f"{extra} names an extra that does not exist: {named}"
                continue
            name = re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower()
            assert name not in owner, f"{name} is in both {owner.get(name)} and {extra}"
            owner[name] = extra


def test_the_changelog_has_an_unreleased_section_and_this_version() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in text
    assert f"## [{PROJECT['version']}] - " in text
