#!/usr/bin/env bash
# Test discovery under every CMake at hand (scripts/test.sh runs it after ctest):
#  1. the suite in BUILD: ctest lists every test optamp_tests has (a broken discovery file lists
#     none, as CMake 4.4 once did, and ctest then "passes" with 0 tests);
#  2. tests/cmake_compat, the suite's own discovery call on a GoogleTest binary with the suite's
#     kinds of test, configured, built and listed with Debian's cmake, the newest cmake from PyPI
#     and the oldest supported (bootstrap.sh puts them in .tools/cmake-pypi and
#     .tools/cmake-oldest; OPTAMP_EXTRA_CMAKES adds others): the names must agree, and the last
#     one runs it.
# Usage: scripts/cmake_compat.sh [BUILD]
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
BUILD="${1:-$(optamp_build_dir)}"
status=0

# 1. The suite: every test optamp_tests lists (the CUDA ones too, which ctest lists and skips
#    without a GPU) is one of ctest's.
cmake_bin="$(sed -n 's/^CMAKE_COMMAND:INTERNAL=//p' "$BUILD/CMakeCache.txt")"
ctest_bin="$(dirname "$cmake_bin")/ctest"
# The names `ctest -N` lists in build directory $2 with ctest $1, sorted. A parametrized test's
# name ends in a comment with its parameter: "  # GetParam() = 3" (CMake 3.25, 4.4), and CMake
# 3.22 writes it without the spaces ("#GetParam()=3"); GoogleTest names never contain '#'.
ctest_names() {
  "$1" --test-dir "$2" -N | sed -n 's/^ *Test *#[0-9]*: //p' | sed 's/ *#.*//' | sort
}
scratch="$(mktemp -d)"
"$BUILD/tests/cpp/optamp_tests" --gtest_list_tests |
  awk '/^[^ ]/ { suite = $1 } /^  / { print suite $1 }' | sort >"$scratch/binary"
ctest_names "$ctest_bin" "$BUILD" >"$scratch/ctest"
listed=$(wc -l <"$scratch/binary")
missing=$(comm -23 "$scratch/binary" "$scratch/ctest")
echo "cmake_compat: $BUILD ($("$cmake_bin" --version | head -1)): optamp_tests has $listed" \
     "tests, ctest lists $(( listed - $(grep -c . <<<"$missing") )) of them" \
     "($(wc -l <"$scratch/ctest") tests in all)"
if [[ "$listed" -eq 0 || -n "$missing" ]]; then
  echo "cmake_compat: FAILED: ctest does not list these tests of optamp_tests:"
  head -n 20 <<<"$missing"
  status=1
fi

# 2. tests/cmake_compat under each CMake.
cmakes=("$(command -v cmake)")
for tool in cmake-pypi cmake-oldest; do
  [[ -x "$OPTAMP_ROOT/.tools/$tool/cmake/data/bin/cmake" ]] &&
    cmakes+=("$OPTAMP_ROOT/.tools/$tool/cmake/data/bin/cmake")
done
for extra in ${OPTAMP_EXTRA_CMAKES:-}; do cmakes+=("$extra"); done
# One of each version (where PyPI's cmake is the only one, as on the GPU machine, it is twice).
declare -A version_of=()
distinct=()
for cm in "${cmakes[@]}"; do
  version="$("$cm" --version | head -1 | awk '{print $3}')"
  [[ " ${version_of[*]} " == *" $version "* ]] && continue
  version_of[$cm]=$version
  distinct+=("$cm")
done
cmakes=("${distinct[@]}")
if [[ ${#cmakes[@]} -lt 2 ]]; then
  if [[ -n "${CI:-}" ]]; then
    echo "cmake_compat: FAILED: no second CMake (bootstrap.sh installs PyPI's into .tools/)"
    status=1
  else
    echo "cmake_compat: only one CMake here (no network for PyPI's?): the second check is skipped"
  fi
fi
gen=()
command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
counts=()
for cm in "${cmakes[@]}"; do
  version="${version_of[$cm]}"
  dir="$BUILD/cmake_compat/$version"
  rm -rf "$dir"; mkdir -p "$dir"
  if ! { "$cm" -S "$OPTAMP_ROOT/tests/cmake_compat" -B "$dir" "${gen[@]}" \
           -DOPTAMP_GTEST_SOURCE_DIR="${OPTAMP_GTEST_SOURCE_DIR:-}" ${OPTAMP_CMAKE_ARGS:-} &&
         "$cm" --build "$dir"; } >"$dir.log" 2>&1; then
    echo "cmake_compat: FAILED: cmake $version could not configure/build tests/cmake_compat" \
         "(log: $dir.log)"; status=1; continue
  fi
  ctest_names "$(dirname "$cm")/ctest" "$dir" >"$scratch/$version"
  n=$(wc -l <"$scratch/$version")
  echo "cmake_compat: cmake $version lists $n tests of tests/cmake_compat"
  counts+=("$n")
  if [[ -z "${first_names:-}" ]]; then
    first_names="$scratch/$version"
  elif ! cmp -s "$first_names" "$scratch/$version"; then
    echo "cmake_compat: FAILED: cmake $version names them differently from" \
         "cmake $(basename "$first_names"):"
    diff "$first_names" "$scratch/$version" | head -n 10
    status=1
  fi
  last=("$(dirname "$cm")/ctest" --test-dir "$dir")
done
if [[ ${#counts[@]} -gt 0 ]]; then
  if [[ $(printf '%s\n' "${counts[@]}" | sort -u | wc -l) -ne 1 || ${counts[0]} -ne 5 ]]; then
    echo "cmake_compat: FAILED: the CMakes list different counts (${counts[*]}), expected 5 each"
    status=1
  fi
  "${last[@]}" --output-on-failure | tail -n 6 || status=1
fi
rm -rf "$scratch"
[[ $status -eq 0 ]] && echo "cmake_compat: passed" || echo "cmake_compat: FAILED"
exit $status
