// The C API's key/value options -> amp::Options, with the value spellings of the Python front.
#include "c_api/options.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace amp::c_api {
namespace {

// `option_keys[3] "loss_scale"`: how a message names the option it refuses.
std::string where(const std::string& key, size_t index) {
  return "option \"" + key + "\" (option_keys[" + std::to_string(index) + "])";
}

// "True"/"False" (Apex's keep_batchnorm_fp32 spelling), "true"/"false", "1"/"0".
bool read_bool(std::string_view text, const std::string& at) {
  if (text == "True" || text == "true" || text == "1") return true;
  if (text == "False" || text == "false" || text == "0") return false;
  C10_THROW_ERROR(ValueError, c10::str(at, " must be \"True\", \"False\", \"true\", \"false\", ",
                                       "\"1\" or \"0\", got \"", text, "\""));
}

// A decimal number strtod reads whole (no trailing characters).
double read_double(const std::string& text, const std::string& at) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  TORCH_CHECK_VALUE(!text.empty() && end == text.c_str() + text.size(), at,
                    " must be a number (such as \"128.0\" or \"1e-4\"), got \"", text, "\"");
  return value;
}

// A decimal integer within the range of a C int.
int read_int(const std::string& text, const std::string& at) {
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  TORCH_CHECK_VALUE(!text.empty() && end == text.c_str() + text.size(), at,
                    " must be a decimal integer, got \"", text, "\"");
  TORCH_CHECK_VALUE(errno != ERANGE && value >= INT_MIN && value <= INT_MAX, at,
                    " must be an integer within [", INT_MIN, ", ", INT_MAX, "], got \"", text,
                    "\"");
  return static_cast<int>(value);
}

// "float16", "torch.float16", "half", ...; "None" is Undefined where `none_allowed`.
c10::ScalarType read_dtype(std::string_view text, const std::string& at, bool none_allowed) {
  std::string_view name = text;
  if (name.substr(0, 6) == "torch.") name.remove_prefix(6);
  if (name == "float16" || name == "half") return c10::ScalarType::Half;
  if (name == "bfloat16") return c10::ScalarType::BFloat16;
  if (name == "float32" || name == "float") return c10::ScalarType::Float;
  if (name == "float64" || name == "double") return c10::ScalarType::Double;
  if (none_allowed && text == "None") return c10::ScalarType::Undefined;
  C10_THROW_ERROR(ValueError,
                  c10::str(at, " must be a dtype name (\"float16\", \"bfloat16\", \"float32\", ",
                           "\"float64\", also as \"torch.float16\", \"half\", \"float\", "
                           "\"double\")",
                           none_allowed ? " or \"None\"" : "", ", got \"", text, "\""));
}

using Setter = std::function<void(Options&, const std::string& value, const std::string& at)>;

const std::vector<std::pair<std::string, Setter>>& setters() {
  static const auto* table = new std::vector<std::pair<std::string, Setter>>{
      {"enabled", [](Options& o, const std::string& v,
                     const std::string& at) { o.enabled = read_bool(v, at); }},
      {"cast_model_type",
       [](Options& o, const std::string& v, const std::string& at) {
         // "False" is Apex's spelling of "do not cast the model", as None is C++'s.
         o.cast_model_type =
             v == "False" || v == "false" ? c10::ScalarType::Undefined : read_dtype(v, at, true);
       }},
      {"patch_torch_functions", [](Options& o, const std::string& v,
                                   const std::string& at) { o.patch_torch_functions = read_bool(v, at); }},
      {"patch_torch_functions_type",
       [](Options& o, const std::string& v, const std::string& at) {
         o.patch_torch_functions_type = read_dtype(v, at, true);
       }},
      {"keep_batchnorm_fp32", [](Options& o, const std::string& v,
                                 const std::string& at) { o.keep_batchnorm_fp32 = read_bool(v, at); }},
      {"master_weights", [](Options& o, const std::string& v,
                            const std::string& at) { o.master_weights = read_bool(v, at); }},
      {"loss_scale",
       [](Options& o, const std::string& v, const std::string& at) {
         o.loss_scale = v == "dynamic" ? LossScale::dynamic() : LossScale(read_double(v, at));
       }},
      {"num_losses", [](Options& o, const std::string& v,
                        const std::string& at) { o.num_losses = read_int(v, at); }},
      {"min_loss_scale", [](Options& o, const std::string& v,
                            const std::string& at) { o.min_loss_scale = read_double(v, at); }},
      {"max_loss_scale", [](Options& o, const std::string& v,
                            const std::string& at) { o.max_loss_scale = read_double(v, at); }},
      {"verbosity", [](Options& o, const std::string& v,
                       const std::string& at) { o.verbosity = read_int(v, at); }},
      {"init_scale", [](Options& o, const std::string& v,
                        const std::string& at) { o.init_scale = read_double(v, at); }},
      {"growth_factor", [](Options& o, const std::string& v,
                           const std::string& at) { o.growth_factor = read_double(v, at); }},
      {"backoff_factor", [](Options& o, const std::string& v,
                            const std::string& at) { o.backoff_factor = read_double(v, at); }},
      {"growth_interval", [](Options& o, const std::string& v,
                             const std::string& at) { o.growth_interval = read_int(v, at); }},
      {"hysteresis", [](Options& o, const std::string& v,
                        const std::string& at) { o.hysteresis = read_int(v, at); }},
      {"overflow_check", [](Options& o, const std::string& v,
                            const std::string& at) { o.overflow_check = read_bool(v, at); }},
      {"rules_under_no_grad", [](Options& o, const std::string& v,
                                 const std::string& at) { o.rules_under_no_grad = read_bool(v, at); }},
      {"op_lists",
       [](Options& o, const std::string& v, const std::string& at) {
         try {
           o.op_lists = parse_op_lists(v);
         } catch (const c10::ValueError&) {
           C10_THROW_ERROR(ValueError,
                           c10::str(at, " must be \"apex\" or \"torch\", got \"", v, "\""));
         }
       }},
      {"cast_model_outputs",
       [](Options& o, const std::string& v, const std::string& at) {
         o.cast_model_outputs = read_dtype(v, at, false);
       }},
      {"cast_model_inputs", [](Options& o, const std::string& v,
                               const std::string& at) { o.cast_model_inputs = read_bool(v, at); }},
  };
  return *table;
}

std::string key_list() {
  std::string out;
  for (const auto& [name, setter] : setters()) out += (out.empty() ? "" : ", ") + name;
  return out;
}

}  // namespace

Options options_from_strings(const char* const* keys, const char* const* values, size_t count) {
  Options o;
  std::unordered_map<std::string, size_t> seen;
  for (size_t i = 0; i < count; ++i) {
    const std::string key = keys[i];
    const Setter* setter = nullptr;
    for (const auto& [name, s] : setters()) {
      if (name == key) setter = &s;
    }
    TORCH_CHECK_VALUE(setter != nullptr, "option_keys[", i, "] must be one of ", key_list(),
                      ", got \"", key, "\"");
    const auto [it, fresh] = seen.emplace(key, i);
    TORCH_CHECK_VALUE(fresh, where(key, i), " must be given once, got it also as option_keys[",
                      it->second, "]");
    if (values == nullptr || values[i] == nullptr) continue;  // not overridden
    // "None" is Python's "not overridden" too, except for the two type fields, where it is C++'s
    // Undefined ("do not cast the model" / "no patch type"), as amp::Options reads it.
    const bool type_field = key == "cast_model_type" || key == "patch_torch_functions_type";
    if (!type_field && std::string_view(values[i]) == "None") continue;
    (*setter)(o, values[i], where(key, i));
  }
  return o;
}

c10::ScalarType from_c_dtype(int dtype, const char* arg) {
  switch (dtype) {
    case OPTAMP_DTYPE_UNDEFINED:
      return c10::ScalarType::Undefined;
    case OPTAMP_DTYPE_FLOAT32:
      return c10::ScalarType::Float;
    case OPTAMP_DTYPE_FLOAT16:
      return c10::ScalarType::Half;
    case OPTAMP_DTYPE_BFLOAT16:
      return c10::ScalarType::BFloat16;
    case OPTAMP_DTYPE_FLOAT64:
      return c10::ScalarType::Double;
    default:
      C10_THROW_ERROR(ValueError,
                      c10::str(arg,
                               " must be an optamp_dtype (OPTAMP_DTYPE_UNDEFINED=0, FLOAT32=1, "
                               "FLOAT16=2, BFLOAT16=3, FLOAT64=4), got ",
                               dtype));
  }
}

optamp_dtype to_c_dtype(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float:
      return OPTAMP_DTYPE_FLOAT32;
    case c10::ScalarType::Half:
      return OPTAMP_DTYPE_FLOAT16;
    case c10::ScalarType::BFloat16:
      return OPTAMP_DTYPE_BFLOAT16;
    case c10::ScalarType::Double:
      return OPTAMP_DTYPE_FLOAT64;
    default:
      return OPTAMP_DTYPE_UNDEFINED;
  }
}

}  // namespace amp::c_api
