# Sourced by the scripts: repository paths and the Python chosen by bootstrap.sh.
OPTAMP_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OPTAMP_PYTHON_FILE="$OPTAMP_ROOT/.venv/.optamp-python"
# ccache keys on relative paths below the checkout, so fresh clones (CI) reuse earlier builds.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$OPTAMP_ROOT}"
# The sanitizer builds compile with -g, for which ccache also hashes the build directory unless
# told not to: without this a fresh clone would rebuild them from scratch.
export CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"

# Prints the interpreter bootstrap.sh selected (and bootstraps first if it has not run).
optamp_python() {
  if [[ -n "${OPTAMP_PYTHON:-}" ]]; then
    echo "$OPTAMP_PYTHON"
  elif [[ -f "$OPTAMP_PYTHON_FILE" ]]; then
    cat "$OPTAMP_PYTHON_FILE"
  else
    bash "$OPTAMP_ROOT/scripts/bootstrap.sh" >&2 && cat "$OPTAMP_PYTHON_FILE"
  fi
}

optamp_build_dir() { echo "${OPTAMP_BUILD_DIR:-$OPTAMP_ROOT/build}"; }

# Configures (once) and builds the project with the chosen Python.
optamp_build() {
  local py build gen=()
  py="$(optamp_python)"
  build="$(optamp_build_dir)"
  command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
  if [[ ! -f "$build/CMakeCache.txt" ]]; then
    cmake -S "$OPTAMP_ROOT" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
      -DPython3_EXECUTABLE="$py" ${OPTAMP_CMAKE_ARGS:-}
  fi
  cmake --build "$build" -j "$(nproc)"
}
