#pragma once
// Number formatting shared by messages and reports.
#include <string>

namespace amp::detail {

// Python's repr of a float: the shortest text that reads back exactly, with ".0" on integral
// values (16777216.0, not 1.67772e+07; "inf", "nan"). Defined in core/opt_level.cpp.
std::string number_name(double value);

}  // namespace amp::detail
