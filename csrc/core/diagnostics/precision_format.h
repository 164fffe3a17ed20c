#pragma once
// Internal: the text forms of a PrecisionProbe report (markdown table, JSON).
#include <c10/core/ScalarType.h>

#include <optional>
#include <string>

#include "optamp/precision_probe.h"

namespace amp::detail {

// torch's spelling: "float16", "bfloat16", "float32", "float64".
std::string torch_dtype_name(c10::ScalarType dtype);
std::string precision_table(const PrecisionProbe::Report& report, int max_rows);
std::string precision_json(const PrecisionProbe::Report& report);
// The first inf/NaN as a JSON object, or null.
std::string precision_nonfinite_json(const std::optional<PrecisionProbe::NonFinite>& first);

}  // namespace amp::detail
