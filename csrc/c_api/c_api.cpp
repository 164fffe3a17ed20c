// optamp's C ABI (optamp/c_api.h): a front like csrc/libtorch/ and python/, whose "framework
// objects" are arrays of at::Tensor* a foreign binding collects itself. Every entry point
// catches everything: an error becomes a status code and this thread's message.
#include "optamp/c_api.h"

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "c_api/options.h"
#include "optamp/autocast.h"
#include "optamp/core.h"
#include "optamp/opt_level.h"
#include "optamp/scale_loss.h"
#include "optamp/state_dict.h"

// The opaque handles of the header, completed here.
struct optamp_region {
  std::unique_ptr<amp::autocast> autocast;       // set by optamp_autocast_enter
  std::unique_ptr<amp::disable_casts> disabled;  // set by optamp_disable_casts_enter
};

struct optamp_scaled_loss {
  amp::ScaledLoss guard;
};

namespace amp::c_api {
namespace {

// A required pointer was NULL (OPTAMP_ERROR_NULL_ARGUMENT).
struct NullArgument : std::runtime_error {
  using std::runtime_error::runtime_error;
};

thread_local std::string t_message;  // this thread's last error ("" after a success)
thread_local bool t_message_lost = false;

void set_message(const char* function, const char* what) {
  try {
    t_message = std::string(function) + ": " + what;
    t_message_lost = false;
  } catch (...) {  // no memory for the message: a static one instead
    t_message_lost = true;
  }
}

optamp_status fail(optamp_status status, const char* function, const char* what) {
  set_message(function, what);
  return status;
}

// Runs `body`, mapping what it throws to a status (the C++ -> Python mapping of
// python/bindings/module.cpp, plus NULL arguments).
template <typename Body>
optamp_status guarded(const char* function, Body&& body) noexcept {
  try {
    body();
    t_message.clear();
    t_message_lost = false;
    return OPTAMP_OK;
  } catch (const NullArgument& e) {
    return fail(OPTAMP_ERROR_NULL_ARGUMENT, function, e.what());
  } catch (const c10::ValueError& e) {
    return fail(OPTAMP_ERROR_VALUE, function, e.what_without_backtrace());
  } catch (const c10::TypeError& e) {
    return fail(OPTAMP_ERROR_TYPE, function, e.what_without_backtrace());
  } catch (const c10::IndexError& e) {
    return fail(OPTAMP_ERROR_INDEX, function, e.what_without_backtrace());
  } catch (const c10::Error& e) {
    return fail(OPTAMP_ERROR_RUNTIME, function, e.what_without_backtrace());
  } catch (const std::exception& e) {
    return fail(OPTAMP_ERROR_RUNTIME, function, e.what());
  } catch (...) {
    return fail(OPTAMP_ERROR_RUNTIME, function, "an unknown C++ exception");
  }
}

void require(const void* pointer, const std::string& name) {
  if (pointer == nullptr) throw NullArgument(name + " must not be NULL");
}

// An array of `count` entries: NULL only when count is 0.
void require_array(const void* items, size_t count, const std::string& name,
                   const std::string& count_name) {
  if (items == nullptr && count > 0) {
    throw NullArgument(name + " must not be NULL when " + count_name + " is " +
                       std::to_string(count));
  }
}

const at::Tensor& tensor_of(const optamp_tensor* handle) {
  return *reinterpret_cast<const at::Tensor*>(handle);
}

// The tensors of a handle array (each handle non-NULL; `defined`: each tensor defined).
std::vector<at::Tensor> tensors(optamp_tensor* const* items, size_t count, const std::string& name,
                                const std::string& count_name, bool defined = true) {
  require_array(items, count, name, count_name);
  std::vector<at::Tensor> out;
  out.reserve(count);
  // The element's name is built only for a message: scale_loss_begin passes every parameter
  // on every step.
  auto item = [&name](size_t i) { return name + "[" + std::to_string(i) + "]"; };
  for (size_t i = 0; i < count; ++i) {
    if (items[i] == nullptr) require(items[i], item(i));
    const at::Tensor& t = tensor_of(items[i]);
    TORCH_CHECK_VALUE(!defined || t.defined(), item(i),
                      " must be a defined tensor, got an undefined one");
    out.push_back(t);
  }
  return out;
}

// The fields of version 1 of each struct: a caller's struct_size must cover them (later fields
// are read or written only where struct_size covers them).
constexpr size_t kModelTensorsV1 = offsetof(optamp_model_tensors, num_identities) + sizeof(size_t);
constexpr size_t kOptimizerTensorsV1 =
    offsetof(optamp_optimizer_tensors, steps_through_closure) + sizeof(int);
constexpr size_t kPropertiesV1 = offsetof(optamp_properties, patch_torch_functions) + sizeof(int);

void check_struct_size(size_t given, size_t v1, const std::string& name) {
  TORCH_CHECK_VALUE(given >= v1, name, " must be at least ", v1,
                    " (the size of its fields in ABI version 1; set it to sizeof the struct), got ",
                    given);
}

core::ModelTensors model_tensors(const optamp_model_tensors& m) {
  core::ModelTensors out;
  out.reduced = tensors(m.reduced, m.num_reduced, "model->reduced", "model->num_reduced");
  out.keep_fp32 = tensors(m.keep_fp32, m.num_keep_fp32, "model->keep_fp32", "model->num_keep_fp32");
  out.parameters =
      tensors(m.parameters, m.num_parameters, "model->parameters", "model->num_parameters");
  if (m.parameter_names != nullptr) {
    for (size_t i = 0; i < m.num_parameters; ++i) {
      require(m.parameter_names[i], "model->parameter_names[" + std::to_string(i) + "]");
      out.names.emplace_back(m.parameter_names[i]);
    }
  }
  require_array(m.identities, m.num_identities, "model->identities", "model->num_identities");
  out.identities.assign(m.identities, m.identities + m.num_identities);
  return out;
}

std::vector<core::OptimizerTensors> optimizer_tensors(const optamp_optimizer_tensors* opts,
                                                      size_t count) {
  require_array(opts, count, "optimizers", "num_optimizers");
  std::vector<core::OptimizerTensors> out;
  for (size_t k = 0; k < count; ++k) {
    const optamp_optimizer_tensors& o = opts[k];
    const std::string name = "optimizers[" + std::to_string(k) + "]";
    check_struct_size(o.struct_size, kOptimizerTensorsV1, name + ".struct_size");
    core::OptimizerTensors t;
    t.identity = o.identity;
    t.description = o.description != nullptr ? std::string(o.description) : name;
    t.parameters =
        tensors(o.parameters, o.num_parameters, name + ".parameters", name + ".num_parameters");
    t.state = tensors(o.state, o.num_state, name + ".state", name + ".num_state");
    t.state_owners =
        tensors(o.state_owners, o.num_state, name + ".state_owners", name + ".num_state");
    t.smallest_eps = o.smallest_eps;
    t.steps_through_closure = o.steps_through_closure != 0;
    out.push_back(std::move(t));
  }
  return out;
}

Options options(const char* const* keys, const char* const* values, size_t count) {
  require_array(keys, count, "option_keys", "num_options");
  require_array(values, count, "option_values", "num_options");
  for (size_t i = 0; i < count; ++i) require(keys[i], "option_keys[" + std::to_string(i) + "]");
  return options_from_strings(keys, values, count);
}

int optional_flag(const std::optional<bool>& flag) { return flag ? (*flag ? 1 : 0) : -1; }

// Writes the fields `out->struct_size` covers (checked against kPropertiesV1 beforehand).
void fill(const Properties& p, optamp_properties* out) {
  const size_t size = out->struct_size;
#define OPTAMP_SET(field, value)                                         \
  if (offsetof(optamp_properties, field) + sizeof(out->field) <= size) { \
    out->field = (value);                                                \
  }
  OPTAMP_SET(opt_level, static_cast<int>(p.opt_level));
  OPTAMP_SET(enabled, p.enabled ? 1 : 0);
  OPTAMP_SET(loss_scale_dynamic, p.loss_scale.is_dynamic() ? 1 : 0);
  OPTAMP_SET(loss_scale, p.loss_scale.value());
  OPTAMP_SET(low_dtype, to_c_dtype(p.low_dtype()));
  OPTAMP_SET(num_losses, p.num_losses);
  OPTAMP_SET(casts, p.casts() ? 1 : 0);
  OPTAMP_SET(model_cast, static_cast<int>(p.model_cast()));
  OPTAMP_SET(cast_model_type, to_c_dtype(p.cast_model_type));
  OPTAMP_SET(keep_batchnorm_fp32, optional_flag(p.keep_batchnorm_fp32));
  OPTAMP_SET(master_weights, optional_flag(p.master_weights));
  OPTAMP_SET(patch_torch_functions, p.patch_torch_functions ? 1 : 0);
#undef OPTAMP_SET
}

void check_properties_out(const optamp_properties* out) {
  if (out != nullptr) check_struct_size(out->struct_size, kPropertiesV1, "out->struct_size");
}

// torch::jit::pickle_save's archive (the zip torch.save writes) without its TorchScript type tags:
// torch.load reads a tagged dict only with weights_only=False, this one with the default.
std::vector<char> pickle_untagged(const c10::IValue& value) {
  std::vector<char> pickled;
  torch::jit::Pickler pickler(
      [&pickled](const char* bytes, size_t n) { pickled.insert(pickled.end(), bytes, bytes + n); },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  std::vector<char> archive;
  {
    caffe2::serialize::PyTorchStreamWriter writer([&archive](const void* bytes, size_t n) {
      const char* begin = static_cast<const char*>(bytes);
      archive.insert(archive.end(), begin, begin + n);
      return n;
    });
    torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(), pickler.tensorData(),
                                       writer);
  }  // the writer's destructor writes the zip's end records
  return archive;
}

std::string index_name(const char* name, size_t i) {
  return std::string(name) + "[" + std::to_string(i) + "]";
}

}  // namespace
}  // namespace amp::c_api

using namespace amp;         // NOLINT(google-build-using-namespace): this file's vocabulary
using namespace amp::c_api;  // NOLINT(google-build-using-namespace)

extern "C" {

const char* optamp_last_error(void) {
  if (t_message_lost) return "optamp: out of memory while recording the error message";
  return t_message.c_str();
}

const char* optamp_status_name(optamp_status status) {
  switch (status) {
    case OPTAMP_OK:
      return "OPTAMP_OK";
    case OPTAMP_ERROR_VALUE:
      return "OPTAMP_ERROR_VALUE";
    case OPTAMP_ERROR_TYPE:
      return "OPTAMP_ERROR_TYPE";
    case OPTAMP_ERROR_INDEX:
      return "OPTAMP_ERROR_INDEX";
    case OPTAMP_ERROR_RUNTIME:
      return "OPTAMP_ERROR_RUNTIME";
    case OPTAMP_ERROR_NULL_ARGUMENT:
      return "OPTAMP_ERROR_NULL_ARGUMENT";
    case OPTAMP_STATUS_MAX_ENUM:  // not a status (the header says why it is there)
      break;
  }
  return "OPTAMP_ERROR_UNKNOWN";
}

uint32_t optamp_abi_version(void) { return OPTAMP_ABI_VERSION; }

optamp_status optamp_initialize(const optamp_model_tensors* model,
                                const optamp_optimizer_tensors* optimizers, size_t num_optimizers,
                                const char* opt_level, const char* const* option_keys,
                                const char* const* option_values, size_t num_options,
                                optamp_properties* out) {
  return guarded("optamp_initialize", [&] {
    require(model, "model");
    require(opt_level, "opt_level");
    check_struct_size(model->struct_size, kModelTensorsV1, "model->struct_size");
    check_properties_out(out);
    const core::ModelTensors tensors = model_tensors(*model);
    const auto opts = optimizer_tensors(optimizers, num_optimizers);
    const Options o = options(option_keys, option_values, num_options);
    const OptLevel level = parse_opt_level(opt_level);
    const Properties p = core::initialize(tensors, opts, level, o);
    if (out != nullptr) fill(p, out);
  });
}

optamp_status optamp_resolve(const char* opt_level, const char* const* option_keys,
                             const char* const* option_values, size_t num_options,
                             optamp_properties* out) {
  return guarded("optamp_resolve", [&] {
    require(opt_level, "opt_level");
    require(out, "out");
    check_properties_out(out);
    const Options o = options(option_keys, option_values, num_options);
    fill(resolve(parse_opt_level(opt_level), o), out);
  });
}

optamp_status optamp_reset(void) {
  return guarded("optamp_reset", [] { core::reset(); });
}

int optamp_is_initialized(void) {
  try {
    return core::is_initialized() ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

optamp_status optamp_model_boundary(const void* model, optamp_dtype* inputs_out,
                                    optamp_dtype* outputs_out) {
  return guarded("optamp_model_boundary", [&] {
    require(inputs_out, "inputs_out");
    require(outputs_out, "outputs_out");
    const ModelBoundary b = core::model_boundary(model);
    *inputs_out = to_c_dtype(b.inputs);
    *outputs_out = to_c_dtype(b.outputs);
  });
}

optamp_status optamp_cast_model_output(const optamp_tensor* output, optamp_dtype dtype,
                                       optamp_tensor** out) {
  return guarded("optamp_cast_model_output", [&] {
    require(output, "output");
    require(out, "out");
    *out = nullptr;
    const c10::ScalarType type = from_c_dtype(dtype, "dtype");
    auto cast = std::make_unique<at::Tensor>(core::cast_model_output(tensor_of(output), type));
    *out = reinterpret_cast<optamp_tensor*>(cast.release());
  });
}

optamp_status optamp_autocast_enter(int enabled, optamp_dtype dtype, optamp_region** out) {
  return guarded("optamp_autocast_enter", [&] {
    require(out, "out");
    *out = nullptr;
    const c10::ScalarType type = from_c_dtype(dtype, "dtype");
    auto region = std::make_unique<optamp_region>();
    region->autocast = std::make_unique<amp::autocast>(enabled != 0, type);
    *out = region.release();
  });
}

optamp_status optamp_autocast_exit(optamp_region* region) {
  return guarded("optamp_autocast_exit", [&] {
    require(region, "region");
    TORCH_CHECK_TYPE(region->autocast != nullptr,
                     "region must be a region of optamp_autocast_enter, got one of "
                     "optamp_disable_casts_enter (end it with optamp_disable_casts_exit)");
    delete region;
  });
}

optamp_status optamp_disable_casts_enter(optamp_region** out) {
  return guarded("optamp_disable_casts_enter", [&] {
    require(out, "out");
    *out = nullptr;
    auto region = std::make_unique<optamp_region>();
    region->disabled = std::make_unique<amp::disable_casts>();
    *out = region.release();
  });
}

optamp_status optamp_disable_casts_exit(optamp_region* region) {
  return guarded("optamp_disable_casts_exit", [&] {
    require(region, "region");
    TORCH_CHECK_TYPE(region->disabled != nullptr,
                     "region must be a region of optamp_disable_casts_enter, got one of "
                     "optamp_autocast_enter (end it with optamp_autocast_exit)");
    delete region;
  });
}

optamp_status optamp_scale_loss_begin(const optamp_tensor* loss,
                                      const void* const* optimizer_identities,
                                      size_t num_optimizers, optamp_tensor* const* params,
                                      size_t num_params, int loss_id, int delay_unscale,
                                      optamp_scaled_loss** guard_out, optamp_tensor** scaled_out) {
  return guarded("optamp_scale_loss_begin", [&] {
    require(guard_out, "guard_out");
    require(scaled_out, "scaled_out");
    *guard_out = nullptr;
    *scaled_out = nullptr;
    require(loss, "loss");
    require_array(optimizer_identities, num_optimizers, "optimizer_identities", "num_optimizers");
    TORCH_CHECK_VALUE(num_params > 0,
                      "num_params must be at least 1 (the parameters of the optimizers the loss "
                      "steps), got 0");
    std::vector<at::Tensor> ps = tensors(params, num_params, "params", "num_params");
    if (num_optimizers > 0) {
      std::vector<const void*> ids(optimizer_identities, optimizer_identities + num_optimizers);
      std::vector<std::string> descriptions;
      for (size_t k = 0; k < num_optimizers; ++k) {
        descriptions.push_back(index_name("optimizer_identities", k));
      }
      core::check_optimizers_allowed(ids, descriptions);
    }
    core::ParamLabeler labels = [](size_t i) { return index_name("params", i); };
    auto guard = std::unique_ptr<optamp_scaled_loss>(new optamp_scaled_loss{
        core::scale_loss(tensor_of(loss), std::move(ps), std::move(labels),
                         ScaleLossOptions{loss_id, delay_unscale != 0}, "optimizer")});
    // Should this allocation fail, the guard ends as on an exception (nothing unscaled).
    auto scaled = std::make_unique<at::Tensor>(guard->guard.loss());
    *scaled_out = reinterpret_cast<optamp_tensor*>(scaled.release());
    *guard_out = guard.release();
  });
}

optamp_status optamp_scale_loss_finish(optamp_scaled_loss* guard, int* skipped_out) {
  // Freed whatever happens: core::finish marks the guard finished before its work, so the
  // destructor has nothing left to do.
  std::unique_ptr<optamp_scaled_loss> owned(guard);
  return guarded("optamp_scale_loss_finish", [&] {
    require(guard, "guard");
    if (skipped_out != nullptr) *skipped_out = 1;  // an error: do not step
    const bool skipped = core::finish(owned->guard, /*unwinding=*/false);
    if (skipped_out != nullptr) *skipped_out = skipped ? 1 : 0;
  });
}

optamp_status optamp_scale_loss_abandon(optamp_scaled_loss* guard) {
  std::unique_ptr<optamp_scaled_loss> owned(guard);
  return guarded("optamp_scale_loss_abandon", [&] {
    require(guard, "guard");
    core::finish(owned->guard, /*unwinding=*/true);
  });
}

optamp_status optamp_step_should_skip(optamp_tensor* const* params, size_t num_params,
                                      int* skip_out) {
  return guarded("optamp_step_should_skip", [&] {
    require(skip_out, "skip_out");
    std::vector<at::Tensor> ps = tensors(params, num_params, "params", "num_params");
    const bool skip =
        core::take_step_overflows(ps, [](size_t i) { return index_name("params", i); });
    // amp::step: after an overflow every gradient is reset and the optimizer does not step.
    if (skip) {
      for (auto& p : ps) p.mutable_grad() = at::Tensor();
    }
    *skip_out = skip ? 1 : 0;
  });
}

optamp_status optamp_loss_scale(int loss_id, double* out) {
  return guarded("optamp_loss_scale", [&] {
    require(out, "out");
    *out = core::loss_scaler_ptr(loss_id)->loss_scale();
  });
}

optamp_status optamp_state_save(uint8_t** data_out, size_t* size_out) {
  return guarded("optamp_state_save", [&] {
    require(data_out, "data_out");
    require(size_out, "size_out");
    *data_out = nullptr;
    *size_out = 0;
    const StateDict state = state_dict();
    c10::Dict<std::string, at::Tensor> dict;  // ordered: the entries keep state_dict's order
    for (const auto& [name, tensor] : state.items()) dict.insert(name, tensor);
    const std::vector<char> bytes = pickle_untagged(c10::IValue(dict));
    auto* buffer = static_cast<uint8_t*>(std::malloc(bytes.empty() ? 1 : bytes.size()));
    if (buffer == nullptr) throw std::bad_alloc();
    std::memcpy(buffer, bytes.data(), bytes.size());
    *data_out = buffer;
    *size_out = bytes.size();
  });
}

optamp_status optamp_state_load(const uint8_t* data, size_t size) {
  return guarded("optamp_state_load", [&] {
    require(data, "data");
    c10::IValue value;
    try {
      value = torch::jit::pickle_load(std::vector<char>(data, data + size));
    } catch (const c10::Error& e) {
      C10_THROW_ERROR(ValueError,
                      c10::str("data must be the bytes of optamp_state_save (torch's pickle "
                               "format), got ",
                               size, " bytes it could not read: ", e.what_without_backtrace()));
    }
    TORCH_CHECK_VALUE(value.isGenericDict(),
                      "data must hold a dict of name -> tensor (from optamp_state_save), got a ",
                      value.tagKind());
    StateDict state;
    for (const auto& entry : value.toGenericDict()) {
      TORCH_CHECK_VALUE(entry.key().isString() && entry.value().isTensor(),
                        "data must hold a dict of name -> tensor (from optamp_state_save), got "
                        "an entry of ",
                        entry.key().tagKind(), " -> ", entry.value().tagKind());
      state.insert(entry.key().toStringRef(), entry.value().toTensor());
    }
    load_state_dict(state);
  });
}

void optamp_buffer_free(uint8_t* data) { std::free(data); }

void optamp_tensor_free(optamp_tensor* tensor) {
  delete reinterpret_cast<at::Tensor*>(tensor);  // at::Tensor's destructor does not throw
}

}  // extern "C"
