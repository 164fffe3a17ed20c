#pragma once
// Number formatting shared by messages and reports.
#include <string>

namespace amp::detail {

// Python's repr of a float: the shortest text that reads back exactly, with ".0" on integral
// values (16777216.0, not 1.67772e+07; "inf", "nan").
std::string number_name(double value);

// A JSON string literal: quotes, backslashes and control characters escaped.
std::string json_string(const std::string& text);

}  // namespace amp::detail
