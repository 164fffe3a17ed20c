#pragma once
// The op-case table (tests/op_cases.txt), shared with the Python tests: one representative call
// of every lower / fp32 / promote entry of the policy table, as data. A case's arguments are
// built for a dtype and a device and the operator is called through the dispatcher by name.
#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace amp::testing {

struct OpCase {
  std::string policy;  // "lower", "fp32" or "promote"
  std::string name;    // "op" or "op.overload", in aten::
  // The op's result dtype whatever it computes in (comparisons: bool); Undefined = the dtype
  // the policy computes in.
  at::ScalarType result = at::ScalarType::Undefined;
  std::string arguments;  // in the file's notation (see its header)
};

// The cases of one policy, in file order.
std::vector<OpCase> op_cases(const std::string& policy);

// Builds the case's arguments in dtype `t` on `device` (fp32 where the file says so) and calls
// aten::<name> through the dispatcher; returns its first result. Throws c10::Error on a row
// the file's notation or the operator's schema does not accept.
at::Tensor run_case(const OpCase& c, at::ScalarType t, at::Device device);

}  // namespace amp::testing
