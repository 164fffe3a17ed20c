#!/usr/bin/env bash
# Runs every test: bootstrap, configure, build, then ctest (GoogleTest + packaging), the CMake
# compatibility check (scripts/cmake_compat.sh), the sanitizer builds (scripts/sanitize.sh), the
# type check (mypy --strict python/optamp) and pytest.
# Exits non-zero if anything fails; prints each runner's own summary.
#   OPTAMP_BUILD_DIR=<dir>  build elsewhere (default: build/)
#   OPTAMP_CMAKE_ARGS=...   extra CMake arguments (e.g. -DOPTAMP_GTEST_SOURCE_DIR=...)
#   PYTEST_ARGS=...         extra pytest arguments (e.g. --run-slow)
#   OPTAMP_SANITIZERS=...   sanitizer builds to run (default "thread"; "thread address" adds
#                           ASan+UBSan over the whole C++ suite; "" skips them)
#   OPTAMP_SKIP_MYPY=1      skip the type check (without mypy it is skipped anyway, except in CI)
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$OPTAMP_ROOT"

bash scripts/bootstrap.sh || exit 1
PY="$(optamp_python)"
BUILD="$(optamp_build_dir)"
optamp_build || { echo "test.sh: build failed"; exit 1; }

# The CUDA kernels must compile wherever they can, GPU or not (CI has nvcc and a CUDA torch):
# AUTO would silently drop them if CMake stopped finding either, so check that they were built.
if "$PY" -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null &&
   { command -v nvcc >/dev/null 2>&1 || [[ -x /usr/local/cuda/bin/nvcc ]]; } &&
   ! grep -q "^OPTAMP_WITH_CUDA:STRING=OFF" "$BUILD/CMakeCache.txt"; then
  if ! find "$BUILD/csrc" -name '*.cu.o' | grep -q .; then
    echo "test.sh: nvcc and a CUDA-enabled torch are here but the CUDA kernels were not built" \
         "(see the CUDA lines of the CMake configure output)"
    exit 1
  fi
  echo "test.sh: CUDA kernels built ($(find "$BUILD/csrc" -name '*.cu.o' | wc -l) objects)"
fi

status=0
echo "== ctest =="
ctest --test-dir "$BUILD" --output-on-failure -j "$(nproc)" || status=1
echo "== cmake compatibility =="
bash scripts/cmake_compat.sh "$BUILD" || status=1
# The sanitizer builds (docs/testing.md), each in its own build directory: by default
# ThreadSanitizer over the concurrency tests. ASan+UBSan over the whole suite doubles the time a
# fresh machine needs for them, so it runs on request (OPTAMP_SANITIZERS="thread address").
for kind in ${OPTAMP_SANITIZERS-thread}; do
  echo "== sanitizer: $kind =="
  bash scripts/sanitize.sh "$kind" || status=1
done
echo "== mypy =="
if [[ -n "${OPTAMP_SKIP_MYPY:-}" ]]; then
  echo "test.sh: type check skipped (OPTAMP_SKIP_MYPY)"
elif ! "$PY" -c "import mypy" 2>/dev/null; then
  if [[ -n "${CI:-}" ]]; then
    echo "test.sh: mypy is not installed for $PY (scripts/requirements.txt pins it)"; status=1
  else  # e.g. a GPU machine without network: bootstrap could not install it
    echo "test.sh: type check skipped: mypy is not installed for $PY (no network?)"
  fi
else
  # The cache outlives the checkout (CI clones afresh): a warm check of torch's stubs takes seconds.
  "$PY" -m mypy --strict --cache-dir "${XDG_CACHE_HOME:-$HOME/.cache}/optamp-mypy" python/optamp ||
    status=1
fi
echo "== pytest =="
PYTHONPATH="$OPTAMP_ROOT/python${PYTHONPATH:+:$PYTHONPATH}" \
  "$PY" -m pytest tests/python -q -rs ${PYTEST_ARGS:-} || status=1
[[ $status -eq 0 ]] && echo "test.sh: all tests passed" || echo "test.sh: FAILURES (see above)"
exit $status
