# Sourced by scripts/gpu_check.sh: runner_counts LOG RC prints "PASSED FAILED SKIPPED" for one
# phase, read from its runner's own closing line when it has one (ctest, pytest), else from its
# exit status (one check). tests/python/test_gpu_check.py holds it to the runners' real lines.
runner_counts() {
  local log="$1" rc="$2" p=0 f=0 s=0 line
  # ctest: "100% tests passed, 0 tests failed out of N" (CMake 3) or "100% tests passed out of
  # N" (CMake 4), "90% tests passed, 3 tests failed out of N" (both). Skipped and disabled tests
  # count as passed there: they are listed under "The following tests did not run".
  if line=$(grep -E '[0-9]+% tests passed(, [0-9]+ tests failed)? out of [0-9]+' "$log" |
              tail -1) && [[ -n "$line" ]]; then
    [[ "$line" =~ ([0-9]+)\ tests\ failed ]] && f=${BASH_REMATCH[1]}
    p=$(( $(sed -E 's/.*out of ([0-9]+).*/\1/' <<<"$line") - f ))
    s=$(grep -c -E '^[[:space:]]+[0-9]+ - .* \((Skipped|Disabled)\)$' "$log")
    p=$(( p - s < 0 ? 0 : p - s ))
  # pytest: "1 failed, 5 passed, 3 skipped, 2 warnings in 1.2s" (also between "=" rules).
  elif line=$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error)' "$log" | tail -1) &&
       [[ -n "$line" ]]; then
    [[ "$line" =~ ([0-9]+)\ passed ]] && p=${BASH_REMATCH[1]}
    [[ "$line" =~ ([0-9]+)\ failed ]] && f=${BASH_REMATCH[1]}
    [[ "$line" =~ ([0-9]+)\ errors? ]] && f=$(( f + BASH_REMATCH[1] ))
    [[ "$line" =~ ([0-9]+)\ skipped ]] && s=${BASH_REMATCH[1]}
  elif [[ $rc -eq 0 ]]; then
    p=1
  fi
  # A runner that failed without counting a failure is one failure; one stopped at the time
  # budget (timeout's 124, or 137 where it had to kill: pytest prints what it finished) is not.
  [[ $rc -ne 0 && $rc -ne 124 && $rc -ne 137 && $f -eq 0 ]] && f=1
  echo "$p $f $s"
}
