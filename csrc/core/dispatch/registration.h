#pragma once
// Registration of optamp's kernels on its dispatch key.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/operator_name.h>

#include <optional>
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

// The kernel a call of `qualified_name` reaches, with its operator: "ns::op.overload" names one
// overload; "ns::op" (a torch function's name: torch.compile's working-copy mode asks by name,
// python/optamp/_compile.py) the overload a call with tensors most likely takes, of those with a
// kernel: a listed one, ".Tensor" (add, mul, ...) before the default before the others by name.
// nullopt where none has a kernel (the op is in no table).
class CastKernel;
struct KernelOfCall {
  c10::OperatorHandle op;
  const CastKernel* kernel;
};
std::optional<KernelOfCall> kernel_of_call(const std::string& qualified_name);

// The registered kernels' policies (amp::policy_rows(), ordered by op, then list) and the table
// ops this LibTorch lacks, for amp::policy_report().
struct RegisteredPolicies {
  std::vector<PolicyRow> rows;
  std::vector<std::string> skipped;
};
RegisteredPolicies registered_policies();

}  // namespace amp::detail
