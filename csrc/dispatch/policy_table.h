#pragma once
// The op lists (ARCHITECTURE §2) as data: operator name + overload -> category.
#include <cstdint>
#include <vector>

namespace amp::detail {

enum class Category : std::uint8_t {
  kLower,     // whitelist: run in the low dtype
  kFp32,      // blacklist: run in fp32 (O1/O4)
  kFp32Loss,  // losses and their softmaxes: fp32 at every casting level, O2/O5 included
  kPromote,   // mixed widths -> widest
  kBanned,    // O1/O4: refuse with a replacement; O2/O5: treated as an fp32 loss
};

struct TableEntry {
  const char* name;      // "aten::mm"
  const char* overload;  // "" = the default overload
  Category category;
};

const std::vector<TableEntry>& builtin_table();

// The category as policy_report() prints it ("lower", "fp32 (loss)", ...).
const char* category_name(Category c);

// Error text for a banned op (what to use instead).
const char* banned_message(const char* name);

}  // namespace amp::detail
