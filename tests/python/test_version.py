"""optamp's version is set once, by project(optamp VERSION ...) in CMakeLists.txt: CMake writes it
into optamp/_build_info.py (optamp.__version__), and scikit-build-core reads the wheel's version
from the same line (the regex provider of pyproject.toml's [[tool.dynamic-metadata]])."""
import os
import re

import pytest

import optamp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cmake_project_version():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        return re.search(r"project\(optamp\s+VERSION\s+([0-9.]+)", f.read()).group(1)


def test_version_is_the_cmake_project_version():
    assert optamp.__version__ == _cmake_project_version()


def test_the_wheel_metadata_reads_the_same_line():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        pyproject = tomllib.load(f)
    assert "version" not in pyproject["project"]
    assert "version" in pyproject["project"]["dynamic"]
    [settings] = [entry for entry in pyproject["tool"]["dynamic-metadata"]
                  if entry.get("field") == "version"]
    assert settings["provider"] == "scikit_build_core.metadata.regex"
    with open(os.path.join(ROOT, settings["input"])) as f:
        match = re.search(settings["regex"], f.read(), re.MULTILINE)
    assert match is not None and match.group("value") == optamp.__version__
