#!/usr/bin/env bash
# The TSan build (scripts/sanitize.sh thread) runs thread_filter.txt on optamp_concurrency_tests, a
# part of the suite: the filter must select there exactly the tests it selects in optamp_tests.
#   check_thread_filter.sh OPTAMP_TESTS OPTAMP_CONCURRENCY_TESTS
set -uo pipefail
filter="$(cat "$(dirname "${BASH_SOURCE[0]}")/thread_filter.txt")"
# Full names (Suite.Test, without gtest's "# GetParam() = ..." notes), sorted.
list() {
  "$1" --gtest_filter="$filter" --gtest_list_tests |
    awk '/^[^ ]/ {suite = $1} /^  / {print suite $1}' | sort
}
whole="$(list "$1")" || exit 1
part="$(list "$2")" || exit 1
if [[ -z "$whole" || "$whole" != "$part" ]]; then
  echo "thread_filter.txt selects other tests in optamp_concurrency_tests than in optamp_tests" \
       "(add the file that holds them to OPTAMP_CONCURRENCY_TEST_SOURCES in tests/cpp/CMakeLists.txt):"
  diff <(echo "$whole") <(echo "$part")
  exit 1
fi
echo "thread_filter.txt: the same $(wc -l <<<"$whole") tests in both binaries"
