#!/usr/bin/env bash
# Prepares this machine for optamp, idempotently:
#  - Debian packages the project needs (only those missing, only where apt-get can reach them);
#  - a Python with torch >= 2.6: the current python3 if it has one (the GPU machine: no network),
#    otherwise .venv/ with the pinned scripts/requirements.txt (torch 2.11.0);
#  - PyPI's newest CMake in .tools/cmake-pypi and the oldest supported (3.22) in
#    .tools/cmake-oldest, the other CMakes scripts/cmake_compat.sh checks.
# Without network (or with OPTAMP_OFFLINE=1) it installs nothing from PyPI and does not retry:
# what is missing is named, and the tests that need it skip. Prints what it uses. A second run
# takes seconds.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$OPTAMP_ROOT"

DEBIAN_PACKAGES=(cmake ninja-build ccache zlib1g-dev googletest libgtest-dev libbenchmark-dev
                 libsimde-dev dataset-fashion-mnist)

install_debian_packages() {
  # e.g. the GPU machine: no network, no apt
  [[ -n "${OPTAMP_SKIP_APT:-}" || -n "${OPTAMP_OFFLINE:-}" ]] && return 0
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
  local no_retries=(-o Acquire::Retries=0 -o Acquire::http::Timeout=15)
  if ! { timeout 300 apt-get update -qq "${no_retries[@]}" && DEBIAN_FRONTEND=noninteractive \
         timeout 600 apt-get install -y -qq "${no_retries[@]}" "${missing[@]}"; } \
       >/tmp/optamp-apt.log 2>&1; then
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
      "$venv/bin/python" -m pip install "${PIP_FLAGS[@]}" -r scripts/requirements.txt >&2
      touch "$stamp"
    fi
    echo "$venv/bin/python"
  fi
}

# PyPI's newest CMake (at the time of writing) and the oldest the project supports (its
# cmake_minimum_required): the CMakes scripts/cmake_compat.sh checks besides the system's.
PYPI_CMAKE="cmake==4.4.5"
OLDEST_CMAKE="cmake==3.22.6"
PIP_FLAGS=(-q --disable-pip-version-check --retries 0 --timeout 15)

# Exit 0 when pip can reach its index (asked once; OPTAMP_OFFLINE=1 says no without asking, and
# CI, which has the registries, is not asked: a slow answer there must not skip an install).
pip_online() {
  [[ -n "${OPTAMP_OFFLINE:-}" ]] && return 1
  [[ -n "${CI:-}" ]] && return 0
  if [[ -z "${_optamp_online:-}" ]]; then
    if timeout 60 "$1" -m pip download "${PIP_FLAGS[@]}" --no-deps -d "$(mktemp -d)" \
         pip >/dev/null 2>&1; then
      _optamp_online=yes
    else
      _optamp_online=no
      echo "bootstrap: pip cannot reach its index (no network?): nothing is installed from PyPI" >&2
    fi
  fi
  [[ "$_optamp_online" == yes ]]
}

# Test tools for a reused interpreter: install only what is missing. Without network they stay
# missing, and the tests that need them skip with a reason (mypy: scripts/test.sh; expecttest,
# numpy: the pytest modules that use them).
ensure_python_tools() {
  local py="$1" missing=() mod
  for mod in pytest numpy mypy scikit_build_core expecttest; do
    "$py" -c "import $mod" 2>/dev/null || missing+=("$mod")
  done
  [[ ${#missing[@]} -eq 0 ]] && return 0
  if ! pip_online "$py"; then
    echo "bootstrap: not installed for $py: ${missing[*]} (the tests that need them skip)" >&2
    return 0
  fi
  # The versions scripts/requirements.txt pins, so every machine tests alike; a line may end in
  # an environment marker (`; python_version < "3.11"`), so each is one argument.
  local pins=()
  mapfile -t pins < <(grep -E '^(pytest|numpy|mypy|scikit-build-core|expecttest)==' \
    scripts/requirements.txt)
  "$py" -m pip install "${PIP_FLAGS[@]}" "${pins[@]}" >&2 ||
    echo "bootstrap: could not install ${missing[*]} for $py" >&2
}

# ensure_pypi_cmake PY SPEC DIR: PyPI's cmake SPEC in .tools/DIR (nothing without network).
ensure_pypi_cmake() {
  local py="$1" spec="$2" dir="$OPTAMP_ROOT/.tools/$3"
  [[ -x "$dir/cmake/data/bin/cmake" && -f "$dir/.${spec}" ]] && return 0
  pip_online "$py" || return 0
  rm -rf "$dir"
  if "$py" -m pip install "${PIP_FLAGS[@]}" --target "$dir" "$spec" >&2; then
    touch "$dir/.${spec}"
  else
    echo "bootstrap: could not install $spec into $dir" >&2
  fi
}

install_debian_packages
PY="$(select_python)"
ensure_python_tools "$PY"
ensure_pypi_cmake "$PY" "$PYPI_CMAKE" cmake-pypi
ensure_pypi_cmake "$PY" "$OLDEST_CMAKE" cmake-oldest
mkdir -p "$(dirname "$OPTAMP_PYTHON_FILE")"
echo "$PY" >"$OPTAMP_PYTHON_FILE"
"$PY" - "$PY" <<'PY'
import sys, torch
cuda = torch.cuda.is_available()
print(f"bootstrap: python {sys.argv[1]} ({sys.version.split()[0]}), torch {torch.__version__}, "
      f"torch CUDA build {torch.version.cuda or 'none'}, CUDA device {'yes: ' + torch.cuda.get_device_name(0) if cuda else 'no'}")
PY
