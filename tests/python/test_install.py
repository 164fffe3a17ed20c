"""`pip install --no-build-isolation .` into a fresh venv, then `import optamp` from outside the
repository: the wheel must carry optamp/_C and optamp/liboptamp and import on its own."""
import os
import subprocess
import sys
import sysconfig
import textwrap

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.mark.slow
def test_pip_install_into_a_fresh_venv_and_import(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True)
    py = venv / "bin" / "python"
    # The test's interpreter may itself be a venv (torch lives there, not in the base Python
    # that --system-site-packages exposes): make its site-packages visible through a .pth so
    # torch and the build tools are reused, not downloaded.
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(site, "_torch_env.pth"), "w") as f:
        f.write(sysconfig.get_path("purelib") + "\n")
    env = dict(os.environ, PIP_NO_INDEX="1")  # nothing may be downloaded
    env.pop("PYTHONPATH", None)  # the installed package, not python/ of the checkout
    subprocess.run([str(py), "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-q",
                    ROOT], check=True, env=env, timeout=3000)
    check = textwrap.dedent("""
        import os, torch, optamp
        pkg = os.path.dirname(optamp.__file__)
        names = os.listdir(pkg)
        assert not pkg.startswith(%r), pkg
        assert any(n.startswith("_C") and n.endswith(".so") for n in names), names
        assert any(n.startswith("liboptamp") for n in names), names
        from optamp import _build_info  # the version check has what it needs in a wheel
        assert _build_info.torch_version == torch.__version__.split("+")[0], _build_info
        from importlib.metadata import version  # the wheel's version: CMakeLists.txt's
        assert version("optamp") == optamp.__version__, (version("optamp"), optamp.__version__)
        m = torch.nn.Linear(2, 2)
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        m, o = optamp.initialize(m, o, opt_level="O4", verbosity=0)
        assert m(torch.ones(1, 2)).dtype == torch.bfloat16
        print("ok", pkg)
    """ % os.path.join(ROOT, "python"))
    out = subprocess.run([str(py), "-c", check], check=True, capture_output=True, text=True,
                         cwd=str(tmp_path), env=env)
    assert out.stdout.startswith("ok")
