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

# Configures the build directory once. When CMake refuses the compiler because it links libstdc++
# statically into shared libraries (cmake/OptampCxxRuntime.cmake: torch's libraries use the shared
# one, and two copies in one process crash), it names a system compiler that links it shared:
# configure again with that one (as C++ and CUDA host compiler), and say so.
optamp_configure() {
  local build fix configure
  build="$(optamp_build_dir)"
  [[ -f "$build/CMakeCache.txt" ]] && return 0
  configure=(cmake -S "$OPTAMP_ROOT" -B "$build" -DCMAKE_BUILD_TYPE=Release
             -DPython3_EXECUTABLE="$(optamp_python)")
  command -v ninja >/dev/null 2>&1 && configure+=(-G Ninja)
  # shellcheck disable=SC2086
  "${configure[@]}" ${OPTAMP_CMAKE_ARGS:-} && return 0
  fix="$(cat "$build/optamp_cxx_runtime_fix.txt" 2>/dev/null || true)"
  [[ -n "$fix" ]] || return 1
  echo "optamp: the default C++ compiler (or CUDA host compiler) links libstdc++ statically into" \
       "shared libraries; configuring with $fix instead (set CXX to choose another)" >&2
  rm -rf "$build/CMakeCache.txt" "$build/CMakeFiles"
  # shellcheck disable=SC2086
  "${configure[@]}" -DCMAKE_CXX_COMPILER="$fix" -DCMAKE_CUDA_HOST_COMPILER="$fix" \
    ${OPTAMP_CMAKE_ARGS:-}
}

# Configures (once) and builds the project with the chosen Python.
optamp_build() {
  optamp_configure || return 1
  cmake --build "$(optamp_build_dir)" -j "$(nproc)"
}
