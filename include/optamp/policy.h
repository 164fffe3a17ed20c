#pragma once
// Casting policies and user registration of operators (ARCHITECTURE §2).
//
// Policies are applied by kernels on optamp's dispatch key, so they hold for every ATen call,
// from C++ or Python. Names are "namespace::op" or "namespace::op.overload"; without an
// overload, every overload of the op gets the policy.

#include <cstdint>
#include <string>
#include <string_view>

namespace amp {

enum class CastPolicy : std::uint8_t {
  kLower,    // cast floating (non-double) inputs to the level's low dtype (fp16 / bf16)
  kFp32,     // cast fp16/bf16 inputs to fp32 (or set the op's dtype argument)
  kPromote,  // if floating inputs mix widths, cast all to the widest
  kBanned,   // refuse, naming the replacement
};

const char* to_string(CastPolicy policy);

// Apex's register_half_function / register_float_function / register_promote_function for
// dispatcher ops (ATen or custom TORCH_LIBRARY ops). Usable before or after amp::initialize;
// the newest registration of an op wins. Unknown ops: ValueError naming the op.
void register_half_op(std::string_view qualified_name);
void register_float_op(std::string_view qualified_name);
void register_promote_op(std::string_view qualified_name);

// Debug listing: every table entry with its policy, and the overloads this LibTorch lacks.
std::string policy_report();

// Number of tensor casts optamp performed (cache hits excluded), for tests and diagnostics.
std::int64_t cast_count();

}  // namespace amp
