#!/usr/bin/env bash
# Runs every test: bootstrap, configure, build, then ctest (GoogleTest + packaging) and pytest.
# Exits non-zero if anything fails; prints each runner's own summary.
#   OPTAMP_BUILD_DIR=<dir>  build elsewhere (default: build/)
#   OPTAMP_CMAKE_ARGS=...   extra CMake arguments (e.g. -DOPTAMP_GTEST_SOURCE_DIR=...)
#   PYTEST_ARGS=...         extra pytest arguments (e.g. --run-slow)
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$OPTAMP_ROOT"

bash scripts/bootstrap.sh || exit 1
PY="$(optamp_python)"
BUILD="$(optamp_build_dir)"
optamp_build || { echo "test.sh: build failed"; exit 1; }

status=0
echo "== ctest =="
ctest --test-dir "$BUILD" --output-on-failure -j "$(nproc)" || status=1
echo "== pytest =="
PYTHONPATH="$OPTAMP_ROOT/python${PYTHONPATH:+:$PYTHONPATH}" \
  "$PY" -m pytest tests/python -q -rs ${PYTEST_ARGS:-} || status=1
[[ $status -eq 0 ]] && echo "test.sh: all tests passed" || echo "test.sh: FAILURES (see above)"
exit $status
