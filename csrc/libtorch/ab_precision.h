#pragma once
// python -m optamp.ab --precision-steps N in a C++ program (docs/ab_test.md): amp::ab::opt_level
// arms the request, amp::initialize starts the probe, amp::ab::report of step N ends it and
// reports its table as one line.

namespace amp::detail {

// Called by amp::initialize: starts the probe when the runner asked for one.
void start_ab_precision_probe();

}  // namespace amp::detail
