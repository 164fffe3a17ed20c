// The markdown table and the JSON of a PrecisionProbe report (docs/precision.md, columns).
#include "diagnostics/precision_format.h"

#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <sstream>
#include <vector>

#include "common/format.h"

namespace amp::detail {
namespace {

using Row = PrecisionProbe::Row;
using NonFinite = PrecisionProbe::NonFinite;

// A percentage for the table: "0" only when nothing was counted, so one value in a million
// still shows ("0.0001").
std::string percent(const Row& row, std::int64_t count) {
  if (row.elements == 0) return "-";  // nothing measured (no floating output, views, empty)
  if (count == 0) return "0";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", 100.0 * row.fraction(count));
  return buf;
}

std::string magnitude(double value) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", value);
  return buf;
}

std::string dtype_list(const Row& row) {
  if (row.dtypes.empty()) return "-";
  std::string out;
  for (const auto& d : row.dtypes) {
    if (!out.empty()) out += ", ";
    out += torch_dtype_name(d.dtype);
    if (row.dtypes.size() > 1) out += " x" + std::to_string(d.calls);
  }
  return out;
}

std::string op_label(const std::string& op, const std::string& node) {
  return node.empty() ? op : op + " (" + node + ")";
}

// Markdown cells must not break the table.
std::string cell(std::string s) {
  std::string out;
  for (char c : s) out += (c == '|') ? std::string("\\|") : std::string(1, c);
  return out.empty() ? "-" : out;
}

std::string table_row(const Row& r) {
  std::ostringstream out;
  out << "| " << cell(op_label(r.op, r.node)) << " | " << cell(r.scope) << " | "
      << PrecisionProbe::phase_name(r.phase) << " | " << dtype_list(r) << " | " << r.calls << " | "
      << (r.elements > 0 ? magnitude(r.max_abs) : std::string("-")) << " | "
      << percent(r, r.fp16_overflow) << " | " << percent(r, r.fp16_flush) << " | "
      << percent(r, r.bf16_overflow) << " | " << percent(r, r.bf16_flush) << " | " << r.nonfinite
      << " |\n";
  return out.str();
}

// How much a row says about lost precision: non-finite values first, then overflow, then flush,
// then any measured values (views and uninitialized buffers, measured as nothing, come last).
double trouble(const Row& r) {
  return 1e6 * static_cast<double>(r.nonfinite > 0) +
         1e3 * (r.fraction(r.fp16_overflow) + r.fraction(r.bf16_overflow)) +
         r.fraction(r.fp16_flush) + r.fraction(r.bf16_flush) +
         1e-6 * static_cast<double>(r.elements > 0);
}

// Which rows a table of `max_rows` shows: the troubled ones first, then by first call; shown
// in first-call order.
std::vector<std::size_t> shown_rows(const std::vector<Row>& rows, int max_rows) {
  std::vector<std::size_t> order(rows.size());
  std::iota(order.begin(), order.end(), 0);
  if (rows.size() > static_cast<std::size_t>(max_rows)) {
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return trouble(rows[a]) > trouble(rows[b]);
    });
    order.resize(static_cast<std::size_t>(max_rows));
    std::sort(order.begin(), order.end());  // rows are in first-call order already
  }
  return order;
}

std::string first_nonfinite_line(const NonFinite& f) {
  std::ostringstream out;
  out << "First inf/NaN: " << op_label(f.op, f.node) << ", " << PrecisionProbe::phase_name(f.phase)
      << ", scope " << (f.scope.empty() ? std::string("(none)") : "`" + f.scope + "`") << ", call "
      << f.call << " (call " << f.op_call << " of this row): " << f.count << " of " << f.elements
      << " values (" << torch_dtype_name(f.dtype) << ")"
      << (f.from_inputs ? "; no op made one: its inputs held them already (values from outside "
                          "the recorded ops, such as a corrupt batch or a mask buffer)"
                        : "")
      << "\n";
  return out.str();
}

std::string json_row(const Row& r) {
  std::ostringstream out;
  out << "{\"op\": " << json_string(r.op) << ", \"scope\": " << json_string(r.scope)
      << ", \"phase\": \"" << PrecisionProbe::phase_name(r.phase)
      << "\", \"node\": " << json_string(r.node) << ", \"calls\": " << r.calls
      << ", \"first_call\": " << r.first_call << ", \"dtypes\": {";
  for (std::size_t i = 0; i < r.dtypes.size(); ++i) {
    out << (i ? ", " : "") << json_string(torch_dtype_name(r.dtypes[i].dtype)) << ": "
        << r.dtypes[i].calls;
  }
  out << "}, \"elements\": " << r.elements << ", \"nonfinite\": " << r.nonfinite
      << ", \"max_abs\": " << number_name(r.max_abs) << ", \"fp16_overflow\": " << r.fp16_overflow
      << ", \"fp16_flush\": " << r.fp16_flush << ", \"bf16_overflow\": " << r.bf16_overflow
      << ", \"bf16_flush\": " << r.bf16_flush
      << ", \"fp16_overflow_fraction\": " << number_name(r.fraction(r.fp16_overflow))
      << ", \"fp16_flush_fraction\": " << number_name(r.fraction(r.fp16_flush))
      << ", \"bf16_overflow_fraction\": " << number_name(r.fraction(r.bf16_overflow))
      << ", \"bf16_flush_fraction\": " << number_name(r.fraction(r.bf16_flush)) << "}";
  return out.str();
}

}  // namespace

std::string precision_nonfinite_json(const std::optional<NonFinite>& f) {
  if (!f) return "null";
  std::ostringstream out;
  out << "{\"op\": " << json_string(f->op) << ", \"phase\": \""
      << PrecisionProbe::phase_name(f->phase) << "\", \"scope\": " << json_string(f->scope)
      << ", \"node\": " << json_string(f->node) << ", \"call\": " << f->call
      << ", \"op_call\": " << f->op_call
      << ", \"dtype\": " << json_string(torch_dtype_name(f->dtype)) << ", \"count\": " << f->count
      << ", \"elements\": " << f->elements
      << ", \"from_inputs\": " << (f->from_inputs ? "true" : "false") << "}";
  return out.str();
}

std::string torch_dtype_name(c10::ScalarType dtype) {
  if (dtype == c10::ScalarType::Undefined) return "-";
  return c10::getDtypeNames(dtype).first;  // torch's name ("float16", "int64"), not c10's
}

std::string precision_table(const PrecisionProbe::Report& report, int max_rows) {
  std::ostringstream out;
  out << "| op | scope | phase | dtypes | calls | max\\|x\\| | fp16 overflow % | fp16 flush % | "
         "bf16 overflow % | bf16 flush % | non-finite |\n"
         "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|\n";
  const auto shown = shown_rows(report.rows, max_rows);
  for (std::size_t i : shown) out << table_row(report.rows[i]);
  if (shown.size() < report.rows.size()) {
    // Named for both fronts: C++'s probe has json(), Python's report rows / to_dict().
    out << "\n"
        << report.rows.size() - shown.size()
        << " more rows (a larger max_rows shows them; json() in C++, rows in Python hold them "
           "all)\n";
  }
  out << "\n"
      << (report.first_nonfinite ? first_nonfinite_line(*report.first_nonfinite)
                                 : std::string("No op made an inf/NaN, and none came in from "
                                               "outside the recorded ops.\n"));
  if (report.unmeasured > 0) {
    out << report.unmeasured << " calls could not be measured (counted only)\n";
  }
  return out.str();
}

std::string precision_json(const PrecisionProbe::Report& report) {
  std::ostringstream out;
  out << "{\"calls\": " << report.calls << ", \"unmeasured\": " << report.unmeasured
      << ", \"rows\": [";
  for (std::size_t i = 0; i < report.rows.size(); ++i) {
    out << (i ? ", " : "") << json_row(report.rows[i]);
  }
  out << "], \"first_nonfinite\": " << precision_nonfinite_json(report.first_nonfinite) << "}";
  return out.str();
}

}  // namespace amp::detail
