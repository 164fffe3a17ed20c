// Opt levels: the defaults table, override processing and Apex's validation rules.
#include "optamp/opt_level.h"

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "common/dtypes.h"
#include "common/format.h"

namespace amp {

namespace detail {}  // namespace detail

namespace {

using detail::is_reduced_float;
using detail::number_name;

using c10::ScalarType;
constexpr ScalarType kNone = ScalarType::Undefined;
constexpr double kFloatMax = 3.4028234663852886e38;  // float32's largest finite value

constexpr std::array<const char*, 6> kLevelNames = {"O0", "O1", "O2", "O3", "O4", "O5"};

struct LevelDefaults {
  const char* brief;
  ScalarType cast_model_type;
  bool patch_torch_functions;
  ScalarType patch_torch_functions_type;
  int keep_batchnorm_fp32;  // -1 = None
  int master_weights;       // -1 = None
  bool dynamic_loss_scale;
};

// The opt-level table (docs/opt_levels.md, Defaults), as data. Apex's own values for O0-O3;
// O4/O5 are the bf16 analogues of O1/O2, which need no loss scaling (bf16 has fp32's exponent
// range).
constexpr std::array<LevelDefaults, 6> kLevelTable = {{
    {"Pure FP32 training.", ScalarType::Float, false, kNone, -1, 0, false},
    {"Insert automatic casts around Pytorch functions and Tensor methods.", kNone, true,
     ScalarType::Half, -1, -1, true},
    {"FP16 training with FP32 batchnorm and FP32 master weights.", ScalarType::Half, false, kNone,
     1, 1, true},
    {"Pure FP16 training.", ScalarType::Half, false, kNone, 0, 0, false},
    {"Insert automatic BFloat16 casts around Pytorch functions and Tensor methods.", kNone, true,
     ScalarType::BFloat16, -1, -1, false},
    {"BFloat16 training with FP32 batchnorm and FP32 master weights.", ScalarType::BFloat16, false,
     kNone, 1, 1, false},
}};

std::optional<bool> tristate(int value) {
  if (value < 0) return std::nullopt;
  return value != 0;
}

std::string bool_name(bool value) { return value ? "True" : "False"; }

std::string optional_bool_name(const std::optional<bool>& value) {
  return value ? bool_name(*value) : "None";
}

// One line per option, aligned the way Apex prints them.
std::string format_options(const Properties& p) {
  std::ostringstream out;
  auto row = [&out](const char* name, const std::string& value) {
    const std::size_t length = std::string_view(name).size();
    constexpr std::size_t kWidth = 27;  // "patch_torch_functions_type" and a space
    out << name << std::string(length < kWidth ? kWidth - length : 1, ' ') << ": " << value << "\n";
  };
  row("enabled", bool_name(p.enabled));
  row("opt_level", to_string(p.opt_level));
  row("cast_model_type", dtype_name(p.cast_model_type));
  row("patch_torch_functions", bool_name(p.patch_torch_functions));
  row("patch_torch_functions_type", dtype_name(p.patch_torch_functions_type));
  row("keep_batchnorm_fp32", optional_bool_name(p.keep_batchnorm_fp32));
  row("master_weights", optional_bool_name(p.master_weights));
  row("loss_scale", p.loss_scale.to_string());
  row("num_losses", std::to_string(p.num_losses));
  row("min_loss_scale", p.min_loss_scale ? number_name(*p.min_loss_scale) : "None");
  row("max_loss_scale", number_name(p.max_loss_scale));
  row("verbosity", std::to_string(p.verbosity));
  if (!p.loss_scale.is_dynamic()) row("overflow_check", bool_name(p.overflow_check));
  row("rules_under_no_grad", bool_name(p.rules_under_no_grad));
  row("op_lists", to_string(p.op_lists));
  row("cast_model_outputs", p.cast_model_outputs ? dtype_name(*p.cast_model_outputs) : "None");
  row("cast_model_inputs", bool_name(p.cast_model_inputs));
  if (p.loss_scale.is_dynamic()) {
    row("init_scale", number_name(p.init_scale));
    row("growth_factor", number_name(p.growth_factor));
    row("backoff_factor", number_name(p.backoff_factor));
    row("growth_interval", std::to_string(p.growth_interval));
    row("hysteresis", std::to_string(p.hysteresis));
  }
  return out.str();
}

// Records "name=value" for the overrides report.
class OverrideLog {
 public:
  void add(const char* name, const std::string& value) {
    out_ << (empty_ ? "" : ", ") << name << "=" << value;
    empty_ = false;
  }
  std::string str() const { return empty_ ? "(none)" : out_.str(); }

 private:
  std::ostringstream out_;
  bool empty_ = true;
};

void check_model_types(const Properties& p, const Options& o) {
  const std::string level = to_string(p.opt_level);
  if (o.cast_model_type) {
    const ScalarType t = *o.cast_model_type;
    TORCH_CHECK_VALUE(t == kNone || t == ScalarType::Float || is_reduced_float(t),
                      "cast_model_type must be torch.float16, torch.bfloat16, torch.float32 or "
                      "None, got ",
                      dtype_name(t));
    const bool op_level = p.opt_level == OptLevel::O1 || p.opt_level == OptLevel::O4;
    TORCH_CHECK_VALUE(!op_level || t == kNone || t == ScalarType::Float, "opt_level ", level,
                      " inserts casts around Torch functions rather than casting model weights, "
                      "so the model weights themselves should remain FP32 (cast_model_type must "
                      "be None, False or torch.float32, got ",
                      dtype_name(t),
                      "). To cast the model use opt_level='O2'/'O3' (fp16) or "
                      "'O5' (bf16).");
  }
  if (o.cast_model_outputs) {
    const ScalarType t = *o.cast_model_outputs;
    TORCH_CHECK_VALUE(t == ScalarType::Float || t == ScalarType::Double || is_reduced_float(t),
                      "cast_model_outputs must be a floating type (torch.float32, torch.float16, "
                      "torch.bfloat16, torch.float64) or None, got ",
                      dtype_name(t));
  }
  if (o.patch_torch_functions_type) {
    const ScalarType t = *o.patch_torch_functions_type;
    TORCH_CHECK_VALUE(t == kNone || is_reduced_float(t),
                      "patch_torch_functions_type must be torch.float16, torch.bfloat16 or None, "
                      "got ",
                      dtype_name(t));
  }
  if (is_bf16_level(p.opt_level)) {
    TORCH_CHECK_VALUE(
        p.cast_model_type != ScalarType::Half && p.patch_torch_functions_type != ScalarType::Half,
        "opt_level ", level,
        " is a bfloat16 level, but torch.float16 was requested "
        "(cast_model_type=",
        dtype_name(p.cast_model_type),
        ", patch_torch_functions_type=", dtype_name(p.patch_torch_functions_type),
        "). Use opt_level='O1'/'O2'/'O3' for float16, or torch.bfloat16 here.");
  }
}

void check_level_conflicts(const Properties& p, const Options& o) {
  const std::string level = to_string(p.opt_level);
  const bool op_level = p.opt_level == OptLevel::O1 || p.opt_level == OptLevel::O4;
  TORCH_CHECK_VALUE(!(o.patch_torch_functions.value_or(false) && !op_level),
                    "patch_torch_functions=True is only valid with opt_level 'O1' or 'O4' (got "
                    "opt_level ",
                    level,
                    "). Select opt_level='O1' (fp16) or 'O4' (bf16) instead "
                    "of setting patch_torch_functions.");
  TORCH_CHECK_VALUE(!(o.keep_batchnorm_fp32 && op_level), "With opt_level ", level,
                    ", batchnorm functions are automatically run in FP32, so keep_batchnorm_fp32 "
                    "should be None (got ",
                    bool_name(*o.keep_batchnorm_fp32),
                    "). Remove the override, or use opt_level 'O2'/'O3'/'O5'.");
  TORCH_CHECK_VALUE(!(o.master_weights && op_level),
                    "It doesn't make sense to use "
                    "master_weights with opt_level ",
                    level, " (got master_weights=", bool_name(*o.master_weights),
                    "): the model weights themselves stay FP32. "
                    "Remove the override, or use opt_level 'O2' or 'O5'.");
  TORCH_CHECK_VALUE(!(p.patch_torch_functions && p.patch_torch_functions_type == kNone),
                    "patch_torch_functions=True needs patch_torch_functions_type torch.float16 or "
                    "torch.bfloat16, got None");
}

// The model levels (O0, O2, O3, O5) cast ops to the model's type, so a different patch type
// would be silently ignored. Everything else Apex accepted is accepted: cast_model_type fp32,
// None or False (the model is not cast and no op is: Apex cast nothing then either), and
// master_weights either way (ModelCast: O2 without masters casts the model in place, O3 with
// them keeps fp32 masters and working copies).
void check_model_level_overrides(const Properties& p) {
  if (p.opt_level == OptLevel::O1 || p.opt_level == OptLevel::O4) return;
  const std::string level = to_string(p.opt_level);
  const ScalarType cast = is_reduced_float(p.cast_model_type) ? p.cast_model_type : kNone;
  TORCH_CHECK_VALUE(p.patch_torch_functions_type == kNone || p.patch_torch_functions_type == cast,
                    "opt_level ", level, " runs ops in the model's type (cast_model_type=",
                    dtype_name(p.cast_model_type), "), so patch_torch_functions_type must be None",
                    cast == kNone ? std::string() : " or " + dtype_name(cast), ", got ",
                    dtype_name(p.patch_torch_functions_type),
                    ". To change the type, set cast_model_type instead.");
}

// Inputs left as given meet the model's weights as they are: fp32 masters (O2/O5) take them,
// widening where an op cannot mix widths; a model cast in place (O3, O2/O5 without master
// weights) has no fp32 weights, and its first layer norm would refuse fp32 inputs.
void check_model_inputs(const Properties& p) {
  TORCH_CHECK_VALUE(p.cast_model_inputs || p.model_cast() != ModelCast::kInPlace,
                    "cast_model_inputs=False needs fp32 master weights (O2, O5): opt_level ",
                    to_string(p.opt_level), " casts the model itself to ",
                    dtype_name(p.cast_model_type),
                    ", whose ops would meet fp32 inputs with its reduced weights. Leave "
                    "cast_model_inputs at True there, or use a level with master weights.");
}

void check_scaler_knobs(const Properties& p, const Options& o) {
  // Scales live in float32 and are inverted for unscaling: keep both finite.
  auto in_float_range = [](double v) {
    return std::isfinite(v) && v >= 0x1p-126 && v <= kFloatMax;
  };
  if (!p.loss_scale.is_dynamic()) {
    const double v = p.loss_scale.value();
    TORCH_CHECK_VALUE(in_float_range(v),
                      "loss_scale must be \"dynamic\" or a number within [2^-126, 3.4e38] "
                      "(float32's normal range, so that 1/loss_scale is finite), got ",
                      v);
  }
  TORCH_CHECK_VALUE(!(p.loss_scale.is_dynamic() && o.overflow_check && !*o.overflow_check),
                    "overflow_check=False turns off the inf/NaN check of a fixed loss scale, "
                    "but loss_scale is \"dynamic\", which needs the check to adjust the scale; "
                    "set a fixed loss_scale too, or leave overflow_check unset");
  TORCH_CHECK_VALUE(p.num_losses >= 1, "num_losses must be >= 1, got ", p.num_losses);
  TORCH_CHECK_VALUE(p.verbosity >= 0 && p.verbosity <= 2, "verbosity must be 0, 1 or 2, got ",
                    p.verbosity);
  TORCH_CHECK_VALUE(std::isfinite(p.max_loss_scale) && p.max_loss_scale > 0,
                    "max_loss_scale must be a positive, finite number, got ", p.max_loss_scale);
  if (p.min_loss_scale) {
    const double lo = *p.min_loss_scale;
    TORCH_CHECK_VALUE(in_float_range(lo),
                      "min_loss_scale must be None or a number within [2^-126, 3.4e38] "
                      "(float32's normal range), got ",
                      lo);
    TORCH_CHECK_VALUE(lo <= p.max_loss_scale, "min_loss_scale (", lo,
                      ") must not exceed max_loss_scale (", p.max_loss_scale, ")");
  }
  TORCH_CHECK_VALUE(in_float_range(p.init_scale),
                    "init_scale must be a number within [2^-126, 3.4e38] (float32's normal "
                    "range), got ",
                    p.init_scale);
  if (o.init_scale) {
    TORCH_CHECK_VALUE(
        p.init_scale <= p.max_loss_scale && p.init_scale >= p.min_loss_scale.value_or(0.0),
        "init_scale (", p.init_scale,
        ") must lie within [min_loss_scale, "
        "max_loss_scale] = [",
        p.min_loss_scale.value_or(0.0), ", ", p.max_loss_scale, "]");
  }
  TORCH_CHECK_VALUE(std::isfinite(p.growth_factor) && p.growth_factor > 1.0,
                    "growth_factor must be a finite number > 1, got ", p.growth_factor);
  TORCH_CHECK_VALUE(p.backoff_factor > 0.0 && p.backoff_factor < 1.0,
                    "backoff_factor must lie in (0, 1), got ", p.backoff_factor);
  TORCH_CHECK_VALUE(p.growth_interval >= 1, "growth_interval must be >= 1, got ",
                    p.growth_interval);
  TORCH_CHECK_VALUE(p.hysteresis >= 1, "hysteresis must be >= 1, got ", p.hysteresis);
}

// Applies each set override to `p` and logs it, shown the way describe() shows it.
void apply_overrides(Properties& p, const Options& o, OverrideLog& log) {
  auto take = [&log](const char* name, auto& field, const auto& value, auto show) {
    if (value) {
      field = *value;
      log.add(name, show(*value));
    }
  };
  auto as_int = [](auto v) { return std::to_string(v); };
  auto as_scale = [](const LossScale& v) { return v.to_string(); };
  take("enabled", p.enabled, o.enabled, bool_name);
  take("cast_model_type", p.cast_model_type, o.cast_model_type, dtype_name);
  take("patch_torch_functions", p.patch_torch_functions, o.patch_torch_functions, bool_name);
  take("patch_torch_functions_type", p.patch_torch_functions_type, o.patch_torch_functions_type,
       dtype_name);
  take("keep_batchnorm_fp32", p.keep_batchnorm_fp32, o.keep_batchnorm_fp32, bool_name);
  take("master_weights", p.master_weights, o.master_weights, bool_name);
  take("loss_scale", p.loss_scale, o.loss_scale, as_scale);
  take("num_losses", p.num_losses, o.num_losses, as_int);
  take("min_loss_scale", p.min_loss_scale, o.min_loss_scale, number_name);
  take("max_loss_scale", p.max_loss_scale, o.max_loss_scale, number_name);
  take("verbosity", p.verbosity, o.verbosity, as_int);
  take("init_scale", p.init_scale, o.init_scale, number_name);
  take("growth_factor", p.growth_factor, o.growth_factor, number_name);
  take("backoff_factor", p.backoff_factor, o.backoff_factor, number_name);
  take("growth_interval", p.growth_interval, o.growth_interval, as_int);
  take("hysteresis", p.hysteresis, o.hysteresis, as_int);
  take("overflow_check", p.overflow_check, o.overflow_check, bool_name);
  take("rules_under_no_grad", p.rules_under_no_grad, o.rules_under_no_grad, bool_name);
  take("op_lists", p.op_lists, o.op_lists, [](OpLists v) { return to_string(v); });
  take("cast_model_outputs", p.cast_model_outputs, o.cast_model_outputs, dtype_name);
  take("cast_model_inputs", p.cast_model_inputs, o.cast_model_inputs, bool_name);
  // Apex: the initial scale never exceeds the ceiling unless the user asked for it explicitly.
  if (!o.init_scale && p.init_scale > p.max_loss_scale) p.init_scale = p.max_loss_scale;
}

}  // namespace

OpLists parse_op_lists(std::string_view text) {
  if (text == "apex") return OpLists::kApex;
  if (text == "torch") return OpLists::kTorch;
  C10_THROW_ERROR(ValueError, c10::str("op_lists must be \"apex\" (Apex's O1 lists) or \"torch\" "
                                       "(torch.autocast's lists for the tensor's device), got \"",
                                       text, "\""));
}

std::string to_string(OpLists lists) { return lists == OpLists::kTorch ? "torch" : "apex"; }

OptLevel parse_opt_level(std::string_view text) {
  for (std::size_t i = 0; i < kLevelNames.size(); ++i) {
    if (text == kLevelNames[i]) return static_cast<OptLevel>(i);
  }
  C10_THROW_ERROR(ValueError,
                  c10::str("opt_level must be one of \"O0\", \"O1\", \"O2\", \"O3\", \"O4\", "
                           "\"O5\" (the prefix is the capital letter O, not the number zero), "
                           "got \"",
                           std::string(text), "\""));
}

namespace {

// The table row of `level`; an OptLevel made from an integer outside O0..O5 is a ValueError.
std::size_t level_index(OptLevel level) {
  const auto index = static_cast<std::size_t>(level);
  TORCH_CHECK_VALUE(index < kLevelNames.size(),
                    "opt_level must be one of OptLevel::O0 .. OptLevel::O5, got OptLevel(",
                    static_cast<int>(level), ")");
  return index;
}

}  // namespace

std::string to_string(OptLevel level) { return kLevelNames[level_index(level)]; }

bool is_bf16_level(OptLevel level) { return level == OptLevel::O4 || level == OptLevel::O5; }

LossScale::LossScale(const std::string& text) : dynamic_(text == "dynamic"), value_(1.0) {
  if (dynamic_) return;
  char* end = nullptr;
  value_ = std::strtod(text.c_str(), &end);
  TORCH_CHECK_VALUE(!text.empty() && end == text.c_str() + text.size(),
                    "loss_scale must be \"dynamic\" or a positive, finite number, got \"", text,
                    "\"");
}

LossScale::LossScale(const char* text) : LossScale(std::string(text ? text : "")) {}

std::string LossScale::to_string() const { return dynamic_ ? "dynamic" : number_name(value_); }

std::string dtype_name(c10::ScalarType type) {
  if (type == ScalarType::Undefined) return "None";
  return "torch." + c10::getDtypeNames(type).first;  // torch's name ("torch.int32"), not "Int"
}

ModelCast Properties::model_cast() const {
  if (!enabled || !is_reduced_float(cast_model_type)) return ModelCast::kNone;
  return master_weights.value_or(false) ? ModelCast::kWorkingCopies : ModelCast::kInPlace;
}

bool Properties::casts() const {
  if (!enabled) return false;
  if (opt_level == OptLevel::O1 || opt_level == OptLevel::O4) return patch_torch_functions;
  return model_cast() != ModelCast::kNone;
}

ModelBoundary Properties::model_boundary() const {
  ModelBoundary boundary;
  if (!enabled) return boundary;
  if (model_cast() != ModelCast::kNone) {
    if (cast_model_inputs) boundary.inputs = cast_model_type;
    boundary.outputs = cast_model_outputs.value_or(ScalarType::Float);
  } else if (cast_model_outputs) {
    boundary.outputs = *cast_model_outputs;
  }
  return boundary;
}

c10::ScalarType Properties::low_dtype() const {
  if (!casts()) return kNone;
  if (patch_torch_functions_type != kNone) return patch_torch_functions_type;
  if (is_reduced_float(cast_model_type)) return cast_model_type;
  return is_bf16_level(opt_level) ? ScalarType::BFloat16 : ScalarType::Half;
}

std::string to_string(ModelCast cast) {
  switch (cast) {
    case ModelCast::kWorkingCopies:
      return "working copies";
    case ModelCast::kInPlace:
      return "cast in place";
    case ModelCast::kNone:
      break;
  }
  return "not cast";
}

std::string Properties::describe() const {
  const auto& row = kLevelTable[level_index(opt_level)];
  std::ostringstream out;
  out << "Selected optimization level " << to_string(opt_level) << ":  " << row.brief << "\n\n"
      << "Defaults for this optimization level are:\n"
      << defaults_description
      << "Processing user overrides (additional kwargs that are not None)...\n"
      << "Overrides applied: " << overrides_description << "\n"
      << "After processing overrides, optimization options are:\n"
      << format_options(*this);
  return out.str();
}

std::string Properties::summary() const {
  const auto& row = kLevelTable[level_index(opt_level)];
  std::string brief = row.brief;
  if (!brief.empty() && brief.back() == '.') brief.pop_back();
  // Overrides that change what happens to the model (cast_model_type, master_weights) are
  // named, since the level's brief no longer describes the run.
  std::string model;
  if (enabled && model_cast() != level_defaults(opt_level).model_cast()) {
    model = ", model " + to_string(model_cast()) + (casts() ? "" : ", no op cast");
  }
  return "optamp: opt_level " + to_string(opt_level) + (enabled ? "" : " (disabled)") + " (" +
         brief + ")" + model + ", loss scale " + loss_scale.to_string() +
         " (verbosity=2 prints the full report)\n";
}

Properties level_defaults(OptLevel level) {
  const auto& row = kLevelTable[level_index(level)];
  Properties p;
  p.opt_level = level;
  p.cast_model_type = row.cast_model_type;
  p.patch_torch_functions = row.patch_torch_functions;
  p.patch_torch_functions_type = row.patch_torch_functions_type;
  p.keep_batchnorm_fp32 = tristate(row.keep_batchnorm_fp32);
  p.master_weights = tristate(row.master_weights);
  p.loss_scale = row.dynamic_loss_scale ? LossScale::dynamic() : LossScale::fixed(1.0);
  p.defaults_description = format_options(p);
  return p;
}

Properties resolve(OptLevel level, const Options& options) {
  Properties p = level_defaults(level);
  OverrideLog log;
  apply_overrides(p, options, log);
  p.overrides_description = log.str();
  check_model_types(p, options);
  check_level_conflicts(p, options);
  check_model_level_overrides(p);
  check_model_inputs(p);
  check_scaler_knobs(p, options);
  return p;
}

Properties resolve(std::string_view level, const Options& options) {
  return resolve(parse_opt_level(level), options);
}

}  // namespace amp
