"""import optamp under a torch other than the one _C was built against: one clear ImportError."""
import os
import subprocess
import sys

import pytest
import torch

from optamp import _torch_check

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_same_release_with_another_local_tag_is_accepted():
    _torch_check.check("2.11.0+cu130", "2.11.0")
    _torch_check.check("2.11.0", "2.11.0+cpu")
    _torch_check.check("2.11.0", None)  # never built: importing _C itself reports that


@pytest.mark.parametrize("running", ["2.10.0", "2.12.0.dev20261101+cu130", "3.0.0"])
def test_another_release_is_refused_naming_both_versions(running):
    with pytest.raises(ImportError, match=rf"built against torch 2\.11\.0 but torch "
                                          rf"{running.replace('.', '[.]').replace('+', '[+]')} "
                                          r"is imported.*torch==2\.11\.0"):
        _torch_check.check(running, "2.11.0")


def test_import_under_a_mismatched_torch_fails_before_loading_the_extension():
    code = ("import sys, torch; torch.__version__ = '2.9.1'\n"
            "try:\n    import optamp\nexcept ImportError as e:\n    print(e)\n"
            "print('loaded' if 'optamp._C' in sys.modules else 'not loaded')\n")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120).stdout
    built = _torch_check._built_with()
    assert built is not None, "the in-tree build writes python/optamp/_build_info.py"
    assert f"optamp was built against torch {built} but torch 2.9.1 is imported" in out
    assert out.strip().endswith("not loaded")
    assert _torch_check._release(torch.__version__) == _torch_check._release(built)


def test_import_does_not_import_dynamo():
    # torch._dynamo costs 1.7 s of a 4.1 s `import optamp` on a 2-core EPYC; a program that never
    # compiles should not pay it (optamp/_autocast_flag.py marks its flag without it).
    code = "import sys, optamp; print('torch._dynamo' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "False"
