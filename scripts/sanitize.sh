#!/usr/bin/env bash
# Builds optamp and its C++ tests with a sanitizer and runs them (docs/testing.md):
#   bash scripts/sanitize.sh thread    # ThreadSanitizer: the concurrency tests
#   bash scripts/sanitize.sh address   # AddressSanitizer + UBSan: the whole C++ suite
#   bash scripts/sanitize.sh KIND 'Gtest.Filter*'   # another gtest filter
# Builds in build-tsan/ or build-asan/ (CUDA, Python bindings and examples off). Exits non-zero on a report.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$OPTAMP_ROOT"

KIND="${1:-}"
# The default thread filter (the concurrency tests) selects tests of optamp_concurrency_tests
# only (tests/cpp/CMakeLists.txt), a part of optamp_tests that builds in about 60% of the time;
# ctest checks that it selects the same tests there. Any other filter builds the whole suite.
TARGET=optamp_tests
case "$KIND" in
  thread) FILTER="${2:-$(cat tests/cpp/sanitizers/thread_filter.txt)}"
          [[ -z "${2:-}" ]] && TARGET=optamp_concurrency_tests
          BUILD="$OPTAMP_ROOT/build-tsan" ;;
  address) FILTER="${2:-*}"; BUILD="$OPTAMP_ROOT/build-asan" ;;
  *) echo "usage: bash scripts/sanitize.sh thread|address [gtest filter]" >&2; exit 2 ;;
esac

bash scripts/bootstrap.sh >/dev/null || exit 1
PY="$(optamp_python)"
gen=()
command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
  cmake -S . -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPython3_EXECUTABLE="$PY" \
    -DOPTAMP_SANITIZE="$KIND" -DOPTAMP_WITH_CUDA=OFF -DOPTAMP_BUILD_PYTHON=OFF \
    -DOPTAMP_BUILD_EXAMPLES=OFF >/dev/null || exit 1
fi
cmake --build "$BUILD" -j "$(nproc)" --target "$TARGET" || { echo "sanitize.sh: build failed"; exit 1; }

SUPP="$OPTAMP_ROOT/tests/cpp/sanitizers"
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 report_mutex_bugs=0 suppressions=$SUPP/tsan.supp"
# LibTorch's registries are process-lifetime allocations by design: no leak checking.
export ASAN_OPTIONS="detect_leaks=0 halt_on_error=1 abort_on_error=0"
export UBSAN_OPTIONS="print_stacktrace=1 halt_on_error=1"
echo "== $KIND sanitizer: $TARGET --gtest_filter='$FILTER' =="
"$BUILD/tests/cpp/$TARGET" --gtest_filter="$FILTER" --gtest_brief=1
status=$?
[[ $status -eq 0 ]] && echo "sanitize.sh: $KIND: no reports, all tests passed" ||
  echo "sanitize.sh: $KIND: FAILED (exit $status)"
exit $status
