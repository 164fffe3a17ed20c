#pragma once
// Registration of optamp's kernels on its dispatch key.
#include <ATen/core/operator_name.h>

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "optamp/policy.h"

namespace amp::detail {

// "ns::op" or "ns::op.overload", as users and policy_report() write operator names.
std::string qualified(const c10::OperatorName& name);

// Once per process: conflict check, the permanent fallthrough fallback, the built-in tables.
// Throws a c10::Error naming the conflict if another library owns the key.
void ensure_registered();

// Gives CastPolicy::kOwnAutocast to the ops of libraries loaded since the last look that have
// their own autocast kernel and no policy (ensure_registered looks once; initialize again).
// Registers first where nothing is (throwing as ensure_registered does), looking once.
void register_own_autocast_ops();

// Turns casting on/off for this thread (registers first when turning on).
void activate_thread(bool on);

// amp::register_{half,float,promote}_op: the policy for every overload `qualified_name` names, in
// every table (validated first: an unknown op changes nothing).
void register_user_op(std::string_view qualified_name, CastPolicy policy);

// The registered kernels' policies, for amp::policy_report(): "name[.overload]" -> policy under
// Apex's lists (with user registrations), the rows Apex's lists have otherwise for CPU tensors,
// and "<CPU policy> | <other devices' policy>" under torch's ("-" where a table has no row); the
// table ops this LibTorch lacks.
struct PolicyRows {
  std::map<std::string, std::string> apex, apex_cpu, torch;
  std::vector<std::string> skipped;
};
PolicyRows policy_rows();

}  // namespace amp::detail
