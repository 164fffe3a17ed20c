#pragma once
// Opt levels and their properties: the Apex vocabulary (O0..O3) plus the bf16 levels O4/O5.
//
// resolve() turns an opt level and the user's overrides into the final Properties, with Apex's
// validation rules. Every later component reads Properties, never the raw Options.

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "optamp/export.h"

namespace amp {

enum class OptLevel : std::uint8_t { O0 = 0, O1, O2, O3, O4, O5 };

// Accepts exactly "O0".."O5" (capital letter O). Anything else is a ValueError that lists the
// valid levels.
OPTAMP_API OptLevel parse_opt_level(std::string_view text);
OPTAMP_API std::string to_string(OptLevel level);

// True for the levels whose reduced type is bfloat16 (O4, O5).
OPTAMP_API bool is_bf16_level(OptLevel level);

// The op lists O1/O4 and amp::autocast regions cast by (docs/casting.md, Op lists):
//  kApex   Apex's O1 lists (the default): what an Apex user's model was trained with.
//  kTorch  torch.autocast's own lists for the tensor's device (CPU's, or CUDA's for every other
//          device), as this LibTorch registers them: native autocast's output dtypes, op for op.
enum class OpLists : std::uint8_t { kApex, kTorch };
// Accepts "apex" or "torch"; anything else is a ValueError naming both.
OPTAMP_API OpLists parse_op_lists(std::string_view text);
OPTAMP_API std::string to_string(OpLists lists);

// A loss scale setting: "dynamic" or a fixed positive, finite number.
class OPTAMP_API LossScale {
 public:
  static LossScale dynamic() { return LossScale(true, 1.0); }
  static LossScale fixed(double value) { return LossScale(false, value); }
  LossScale(double value) : LossScale(false, value) {}  // NOLINT(google-explicit-constructor)
  // "dynamic" or a decimal number such as "128.0"; validated by resolve().
  LossScale(const char* text);         // NOLINT(google-explicit-constructor)
  LossScale(const std::string& text);  // NOLINT(google-explicit-constructor)

  bool is_dynamic() const { return dynamic_; }
  double value() const { return value_; }  // the fixed scale; 1.0 when dynamic
  std::string to_string() const;
  bool operator==(const LossScale& other) const {
    return dynamic_ == other.dynamic_ && (dynamic_ || value_ == other.value_);
  }

 private:
  LossScale(bool dynamic, double value) : dynamic_(dynamic), value_(value) {}
  bool dynamic_;
  double value_;
};

// What initialize does to the model's floating tensors, as Apex decided it: from
// cast_model_type (a reduced type casts, fp32/None leaves the model alone) and master_weights
// (fp32 masters, or the reduced tensors are stepped directly). Properties::model_cast().
enum class ModelCast : std::uint8_t {
  kNone,           // the model is not cast (O0, O1, O4; O2/O3/O5 with cast_model_type fp32/None)
  kWorkingCopies,  // O2/O5 (and O3 with master_weights=True): the fp32 parameters stay in the
                   // model as master weights; ops see cached reduced-precision working copies
  kInPlace,        // O3 (and O2/O5 with master_weights=False): the model itself is cast and its
                   // reduced-precision parameters are stepped directly
};
OPTAMP_API std::string to_string(ModelCast cast);

// User overrides, Apex names. Unset fields take the level's default.
//
// For the two type fields, c10::ScalarType::Undefined stands for Python's `None`
// ("do not cast the model" / "no patch type").
struct OPTAMP_API Options {
  std::optional<bool> enabled;
  std::optional<c10::ScalarType> cast_model_type;
  std::optional<bool> patch_torch_functions;
  std::optional<c10::ScalarType> patch_torch_functions_type;
  std::optional<bool> keep_batchnorm_fp32;
  std::optional<bool> master_weights;
  std::optional<LossScale> loss_scale;
  std::optional<int> num_losses;
  std::optional<double> min_loss_scale;
  std::optional<double> max_loss_scale;
  std::optional<int> verbosity;
  // Beyond Apex: the dynamic scaler's knobs (torch.amp.GradScaler names).
  std::optional<double> init_scale;
  std::optional<double> growth_factor;
  std::optional<double> backoff_factor;
  std::optional<int> growth_interval;
  std::optional<int> hysteresis;
  // Beyond Apex: check the gradients for inf/NaN and skip the step with a fixed loss scale too
  // (default true; false is Apex's behaviour, where a fixed scale never skips a step).
  std::optional<bool> overflow_check;
  // Beyond Apex: apply the level's rules under no_grad / inference mode too (default false).
  std::optional<bool> rules_under_no_grad;
  // Beyond Apex: the op lists (default OpLists::kApex).
  std::optional<OpLists> op_lists;
  // The dtype the model's floating outputs are cast to at its boundary (Apex's initialize
  // argument; see ModelBoundary). Unset: fp32 wherever the model is cast (O2, O3, O5), left as
  // they are elsewhere. A floating type.
  std::optional<c10::ScalarType> cast_model_outputs;
  // Beyond Apex: false leaves the model's inputs as they are given at its boundary (default
  // true: Apex's cast of every floating input to the model's dtype at O2/O3/O5). For forwards
  // that take tensors which must stay fp32: a float timestep or noise level whose sinusoidal
  // embedding fp16/bf16 would round, a detection model's target boxes and keypoints. The
  // outputs are cast as before; O2/O5's ops still cast their own inputs.
  std::optional<bool> cast_model_inputs;
};

// The casts at a model's boundary, Apex's patched forward: floating inputs to `inputs`, floating
// outputs to `outputs`; Undefined leaves them as they are. Python applies it to the models given
// to initialize (their forward is wrapped); C++ through amp::forward(model, inputs...).
struct OPTAMP_API ModelBoundary {
  c10::ScalarType inputs = c10::ScalarType::Undefined;
  c10::ScalarType outputs = c10::ScalarType::Undefined;
  bool casts() const {
    return inputs != c10::ScalarType::Undefined || outputs != c10::ScalarType::Undefined;
  }
};

// The resolved, validated settings for one initialize() call.
struct OPTAMP_API Properties {
  OptLevel opt_level = OptLevel::O0;
  bool enabled = true;
  // Undefined = None (model tensors keep their dtype).
  c10::ScalarType cast_model_type = c10::ScalarType::Float;
  bool patch_torch_functions = false;
  // Undefined = None (no op-level casting).
  c10::ScalarType patch_torch_functions_type = c10::ScalarType::Undefined;
  // nullopt = None (not applicable at this level).
  std::optional<bool> keep_batchnorm_fp32;
  // nullopt = None.
  std::optional<bool> master_weights;
  LossScale loss_scale = LossScale::fixed(1.0);
  int num_losses = 1;
  std::optional<double> min_loss_scale;  // nullopt = no floor
  double max_loss_scale = 16777216.0;    // 2^24
  int verbosity = 1;
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int growth_interval = 2000;
  int hysteresis = 1;
  // A fixed loss scale (O0, O3, O4, O5, or loss_scale=<number>) still checks every step for
  // inf/NaN and skips the steps that have them; false turns that off (Apex). Dynamic scaling
  // always checks.
  bool overflow_check = true;
  // optamp's gate: the level's rules apply while autograd records, so validation under no_grad
  // runs in the dtypes it is given (fp32). True lifts the gate for the whole process: inference
  // under no_grad runs in reduced precision, as with Apex and torch.amp. (O3 and amp::autocast
  // regions apply their rules under no_grad anyway.)
  bool rules_under_no_grad = false;
  // Which lists decide the casts at O1/O4 (and the loss/softmax entries at O2/O5).
  OpLists op_lists = OpLists::kApex;
  // nullopt = None: Apex's default (see model_boundary()).
  std::optional<c10::ScalarType> cast_model_outputs;
  // False: the boundary leaves inputs as given (Options::cast_model_inputs).
  bool cast_model_inputs = true;

  // The reduced-precision type the dispatcher casts to at this level: Half (O1/O2/O3),
  // BFloat16 (O4/O5), or Undefined when casts() is false.
  c10::ScalarType low_dtype() const;
  // What initialize does to the model (see ModelCast); kNone when disabled.
  ModelCast model_cast() const;
  // Whether initialize turns casting on at all: O1/O4 with patch_torch_functions, or a model
  // level whose model is cast. False at O0, with enabled=False, and for O2/O3/O5 with
  // cast_model_type fp32/None (Apex's "cast nothing").
  bool casts() const;
  // The boundary of the models initialize is given, as Apex set it: where the model is cast
  // (model_cast() != kNone: O2/O3's fp16, O5's bf16), floating inputs are cast to
  // cast_model_type and floating outputs to cast_model_outputs (fp32 when None); elsewhere only
  // an explicit cast_model_outputs applies (O0 changes nothing, unlike Apex's O0, which cast
  // model and inputs to fp32). Nothing when disabled. At O2/O5 the inputs are cast to the low
  // type only where ops see the working copies (core::model_boundary). cast_model_inputs=false
  // leaves the inputs out.
  ModelBoundary model_boundary() const;

  // Apex-style report: the level's defaults, the overrides applied, and the final options.
  std::string describe() const;
  // One line: "optamp: opt_level O1 (<what it does>), loss scale dynamic". What initialize
  // prints at verbosity 1 (the default); verbosity 2 prints describe().
  std::string summary() const;

  // Filled by resolve(): the level's defaults and "name=value" for each override.
  std::string defaults_description;
  std::string overrides_description;
};

// The defaults of a level (the table in docs/opt_levels.md), without overrides.
OPTAMP_API Properties level_defaults(OptLevel level);

// Level defaults, then overrides, with Apex's validation. Throws c10::ValueError naming the
// conflicting option and level and what to do instead; never returns partially applied state.
OPTAMP_API Properties resolve(OptLevel level, const Options& options = {});
OPTAMP_API Properties resolve(std::string_view level, const Options& options = {});

// Human-readable names used in messages: "torch.float16", "None", "True", "dynamic".
OPTAMP_API std::string dtype_name(c10::ScalarType type);

}  // namespace amp
