#!/usr/bin/env bash
# Prepares this machine for optamp, idempotently:
#  - Debian packages the project needs (only those missing, only where apt-get can reach them);
#  - a Python with torch >= 2.6: the current python3 if it has one (the GPU machine: no network),
#    otherwise .venv/ with the pinned scripts/requirements.txt (torch 2.11.0).
# Prints what it uses. A second run takes seconds.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$OPTAMP_ROOT"

DEBIAN_PACKAGES=(cmake ninja-build ccache zlib1g-dev googletest libgtest-dev libbenchmark-dev
                 libsimde-dev dataset-fashion-mnist)

install_debian_packages() {
  [[ -n "${OPTAMP_SKIP_APT:-}" ]] && return 0  # e.g. the GPU machine: no network, no apt
  command -v dpkg-query >/dev/null 2>&1 || return 0
  local missing=()
  for pkg in "${DEBIAN_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" ||
      missing+=("$pkg")
  done
  [[ ${#missing[@]} -eq 0 ]] && return 0
  if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    echo "bootstrap: missing Debian packages (install them yourself): ${missing[*]}" >&2
    return 0
  fi
  echo "bootstrap: installing Debian packages: ${missing[*]}"
  if ! { timeout 300 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 600 \
         apt-get install -y -qq "${missing[@]}"; } >/tmp/optamp-apt.log 2>&1; then
    echo "bootstrap: apt-get could not install ${missing[*]} (no network?); see /tmp/optamp-apt.log" >&2
  fi
}

# Exit 0 when $1 imports torch >= 2.6.
has_usable_torch() {
  "$1" - <<'PY' >/dev/null 2>&1
import torch
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
raise SystemExit(0 if (major, minor) >= (2, 6) else 1)
PY
}

select_python() {
  local system_py
  system_py="$(command -v python3 || true)"
  if [[ -n "${OPTAMP_PYTHON:-}" ]]; then
    echo "$OPTAMP_PYTHON"
  elif [[ -n "$system_py" ]] && has_usable_torch "$system_py"; then
    echo "$system_py"
  else
    local venv="$OPTAMP_ROOT/.venv" stamp
    stamp="$venv/.requirements-$(sha1sum scripts/requirements.txt | cut -c1-12)"
    if [[ ! -f "$stamp" ]]; then
      echo "bootstrap: creating $venv with torch 2.11.0 (pip's cache makes this quick)" >&2
      [[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
      "$venv/bin/python" -m pip install -q --disable-pip-version-check -r scripts/requirements.txt >&2
      touch "$stamp"
    fi
    echo "$venv/bin/python"
  fi
}

# Test tools for a reused interpreter: install only what is missing (skipped without network).
ensure_python_tools() {
  local py="$1"
  "$py" -c "import pytest, numpy, mypy, scikit_build_core, expecttest" 2>/dev/null && return 0
  local pins  # the versions scripts/requirements.txt pins, so every machine tests alike
  pins=$(grep -E '^(pytest|numpy|mypy|scikit-build-core|expecttest)==' scripts/requirements.txt |
    tr '\n' ' ')
  # shellcheck disable=SC2086
  "$py" -m pip install -q $pins >&2 ||
    echo "bootstrap: pytest/numpy/mypy/scikit-build-core/expecttest missing for $py" >&2
}

install_debian_packages
PY="$(select_python)"
ensure_python_tools "$PY"
mkdir -p "$(dirname "$OPTAMP_PYTHON_FILE")"
echo "$PY" >"$OPTAMP_PYTHON_FILE"
"$PY" - "$PY" <<'PY'
import sys, torch
cuda = torch.cuda.is_available()
print(f"bootstrap: python {sys.argv[1]} ({sys.version.split()[0]}), torch {torch.__version__}, "
      f"torch CUDA build {torch.version.cuda or 'none'}, CUDA device {'yes: ' + torch.cuda.get_device_name(0) if cuda else 'no'}")
PY
