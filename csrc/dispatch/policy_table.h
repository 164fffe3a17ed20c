#pragma once
// The built-in op lists as data: operator name + overload -> CastPolicy (docs/casting.md).
#include <vector>

#include "optamp/policy.h"

namespace amp::detail {

struct TableEntry {
  const char* name;      // "aten::mm"
  const char* overload;  // "" = the default overload
  CastPolicy policy;
  const char* message;  // kBanned: the error, naming what to use instead; else nullptr
};

// Every list, in policy order (lower, fp32, fp32 (loss), promote, banned).
const std::vector<TableEntry>& builtin_table();

}  // namespace amp::detail
