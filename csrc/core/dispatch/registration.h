#pragma once
// Registration of optamp's kernels on its dispatch key.
#include <ATen/core/operator_name.h>

#include <string>

namespace amp::detail {

// "ns::op" or "ns::op.overload", as users and policy_report() write operator names.
std::string qualified(const c10::OperatorName& name);

// Once per process: conflict check, the permanent fallthrough fallback, the built-in tables.
// Throws a c10::Error naming the conflict if another library owns the key.
void ensure_registered();

// Turns casting on/off for this thread (registers first when turning on).
void activate_thread(bool on);

}  // namespace amp::detail
