"""The wheel, as README installs it: `pip install --no-build-isolation .` (on every run; the
build reuses build-<wheel tag>/ and, through ccache, the scripts' build: pyproject.toml), then
`import optamp` from outside the checkout. The wheel must carry optamp/_C, optamp/liboptamp,
the type stub and py.typed, and require exactly the torch release it was built against. The
isolated build (`pip install .`, torch 2.11.0 from the index) runs with --run-slow."""
import os
import re
import subprocess
import sys
import textwrap

import pytest

from common_utils import BUILD, ROOT

CHECK = textwrap.dedent("""
    import os, sys, torch, optamp
    from importlib.metadata import requires, version
    pkg = os.path.dirname(optamp.__file__)
    names = os.listdir(pkg)
    assert not pkg.startswith(sys.argv[1]), pkg
    assert any(n.startswith("_C") and n.endswith(".so") for n in names), names
    assert any(n.startswith("liboptamp") for n in names), names
    assert {"_C.pyi", "py.typed"} <= set(names), names
    from optamp import _build_info  # the version check has what it needs in a wheel
    release = torch.__version__.split("+")[0]
    assert _build_info.torch_version == release, _build_info
    assert version("optamp") == optamp.__version__, (version("optamp"), optamp.__version__)
    assert requires("optamp") == ["torch==" + release], requires("optamp")
    m = torch.nn.Linear(2, 2)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    m, o = optamp.initialize(m, o, opt_level="O4", verbosity=0)
    assert m(torch.ones(1, 2)).dtype == torch.bfloat16
    print("ok", pkg)
""")


def _scripts_compiler():
    """The C++ compiler the scripts' build uses. Where the default one links libstdc++
    statically, configure refuses it and scripts/common.sh chooses another; pip's build must
    be told the same (CXX), as the refusal message says."""
    try:
        with open(os.path.join(BUILD, "CMakeCache.txt")) as f:
            for line in f:
                if line.startswith("CMAKE_CXX_COMPILER:"):
                    return line.split("=", 1)[1].strip()
    except OSError:
        pass
    return None


def _env(**extra):
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the installed package, not python/ of the checkout
    cxx = _scripts_compiler()
    if cxx and "CXX" not in env:
        env.update(CXX=cxx, CUDAHOSTCXX=cxx)
    env.update(extra)
    return env


def _install_and_check(tmp_path, *pip_args, **env):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q",
                    "--disable-pip-version-check", "--target", str(target), *pip_args, ROOT],
                   check=True, env=_env(**env), timeout=3000)
    out = subprocess.run([sys.executable, "-c", CHECK, os.path.join(ROOT, "python")],
                         capture_output=True, text=True, cwd=str(tmp_path),
                         env=_env(PYTHONPATH=str(target)))
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr


def test_pip_install_no_build_isolation_and_import(tmp_path):
    """README's command: reuses this interpreter's torch and build tools, downloads nothing."""
    pytest.importorskip("scikit_build_core",
                        reason="the build backend is not installed (scripts/bootstrap.sh installs "
                               "it; a machine without network cannot)")
    _install_and_check(tmp_path, "--no-build-isolation", PIP_NO_INDEX="1")


@pytest.mark.slow
def test_pip_install_with_build_isolation_and_import(tmp_path):
    """Plain `pip install .`: pip builds in a fresh environment with [build-system]'s requires
    (torch 2.11.0 and scikit-build-core from the index, or pip's cache). Its own build
    directory: the test above's stays configured."""
    _install_and_check(tmp_path, "--config-settings", f"build-dir={tmp_path / 'build'}")


def _pin(text, where):
    pins = re.findall(r"torch==([0-9][^\"'\s,]*)", text)
    assert len(pins) == 1, (where, pins)
    return pins[0]


def test_the_build_pins_the_torch_release_the_scripts_install():
    """[build-system] builds against the torch scripts/requirements.txt installs, so both install
    forms give a wheel requiring the same release."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        build_system = f.read().split("[project]")[0]
    with open(os.path.join(ROOT, "scripts", "requirements.txt")) as f:
        requirements = f.read()
    assert _pin(build_system, "pyproject.toml") == _pin(requirements, "requirements.txt")
