// The C ABI (optamp/c_api.h) end to end: a binding's view. The model is trained through the C
// functions only (its tensors collected into the C structs the way csrc/libtorch/initialize.cpp
// collects them, backward called on the scaled tensor, the optimizer stepped when
// optamp_step_should_skip says so) and must match the C++ API bit for bit at O1/O2/O4/O5; then the
// errors, regions, overflow skips and the state bytes.
#include "optamp/c_api.h"

#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/nn/modules/batchnorm.h>

#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "initialize_test.h"
#include "optamp/core.h"

namespace amp::testing {
namespace {

optamp_tensor* handle(at::Tensor& t) { return reinterpret_cast<optamp_tensor*>(&t); }
at::Tensor& tensor(optamp_tensor* h) { return *reinterpret_cast<at::Tensor*>(h); }

// A failing C call fails the test with the C API's own message.
void check(optamp_status status, const char* call) {
  if (status != OPTAMP_OK) {
    throw std::runtime_error(std::string(call) + " returned " + optamp_status_name(status) + ": " +
                             optamp_last_error());
  }
}
#define C_OK(call) check((call), #call)

// The status and this thread's message of a call expected to fail.
struct Failure {
  optamp_status status;
  std::string message;
};
Failure failure(optamp_status status) { return {status, optamp_last_error()}; }

bool is_batchnorm(const torch::nn::Module& m) {
  return dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&m) != nullptr ||
         dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&m) != nullptr ||
         dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&m) != nullptr;
}

// What a binding's shim builds: the model's tensors in the LibTorch front's order (each
// module's own parameters, then its floating buffers, then its children, depth first), their
// handles, and the C struct over them. Not copyable: the struct points into the vectors.
class ModelShim {
 public:
  ModelShim(torch::nn::Module& model, bool keep_batchnorm) {
    collect(model, keep_batchnorm);
    for (const auto& p : model.named_parameters(/*recurse=*/true)) {
      parameters_.push_back(p.value());
      names_.push_back(p.key());
    }
    for (auto& t : reduced_) reduced_h_.push_back(handle(t));
    for (auto& t : keep_fp32_) keep_fp32_h_.push_back(handle(t));
    for (auto& t : parameters_) parameters_h_.push_back(handle(t));
    for (const auto& n : names_) name_ptrs_.push_back(n.c_str());
    identities_.push_back(&model);
    c_.struct_size = sizeof(c_);
    c_.reduced = reduced_h_.data();
    c_.num_reduced = reduced_h_.size();
    c_.keep_fp32 = keep_fp32_h_.data();
    c_.num_keep_fp32 = keep_fp32_h_.size();
    c_.parameters = parameters_h_.data();
    c_.num_parameters = parameters_h_.size();
    c_.parameter_names = name_ptrs_.data();
    c_.identities = identities_.data();
    c_.num_identities = identities_.size();
  }
  ModelShim(const ModelShim&) = delete;
  ModelShim& operator=(const ModelShim&) = delete;
  const optamp_model_tensors* get() const { return &c_; }
  optamp_model_tensors& edit() { return c_; }
  std::vector<optamp_tensor*>& parameter_handles() { return parameters_h_; }

 private:
  void collect(const torch::nn::Module& module, bool keep_batchnorm) {
    auto& target = keep_batchnorm && is_batchnorm(module) ? keep_fp32_ : reduced_;
    for (const auto& p : module.named_parameters(/*recurse=*/false)) target.push_back(p.value());
    for (const auto& b : module.named_buffers(/*recurse=*/false)) {
      if (b.value().defined() && b.value().is_floating_point()) target.push_back(b.value());
    }
    for (const auto& child : module.children()) collect(*child, keep_batchnorm);
  }

  std::vector<at::Tensor> reduced_, keep_fp32_, parameters_;
  std::vector<std::string> names_;
  std::vector<optamp_tensor*> reduced_h_, keep_fp32_h_, parameters_h_;
  std::vector<const char*> name_ptrs_;
  std::vector<const void*> identities_;
  optamp_model_tensors c_{};
};

// One optimizer's parameters (param-group order) and its C struct.
class OptimizerShim {
 public:
  explicit OptimizerShim(torch::optim::Optimizer& opt) : identity_(&opt) {
    for (const auto& group : opt.param_groups()) {
      for (const auto& p : group.params()) params_.push_back(p);
    }
    for (auto& p : params_) handles_.push_back(handle(p));
    c_.struct_size = sizeof(c_);
    c_.identity = identity_;
    c_.description = "optimizer 0 (Adam)";
    c_.parameters = handles_.data();
    c_.num_parameters = handles_.size();
  }
  OptimizerShim(const OptimizerShim&) = delete;
  OptimizerShim& operator=(const OptimizerShim&) = delete;
  const optamp_optimizer_tensors* get() const { return &c_; }
  const void* const* identity() const { return &identity_; }
  optamp_tensor* const* params() const { return handles_.data(); }
  size_t num_params() const { return handles_.size(); }

 private:
  const void* identity_;
  std::vector<at::Tensor> params_;
  std::vector<optamp_tensor*> handles_;
  optamp_optimizer_tensors c_{};
};

const char* const kQuietKeys[] = {"verbosity"};
const char* const kQuietValues[] = {"0"};

// A model, its Adam and their shims: what a binding holds for one run. The tests bind its
// members by name (auto& [net, opt, model, optimizer] = binding).
struct Binding {
  explicit Binding(bool keep_batchnorm = false)
      : net(make_net()),
        opt(make_optimizer(net, Opt::kAdam)),
        model(*net, keep_batchnorm),
        optimizer(*opt) {}
  // optamp_initialize at `level` (quiet); a failure fails the test.
  void initialize(const char* level) {
    C_OK(optamp_initialize(model.get(), optimizer.get(), 1, level, kQuietKeys, kQuietValues, 1,
                           nullptr));
  }
  Net net;
  std::unique_ptr<torch::optim::Optimizer> opt;
  ModelShim model;
  OptimizerShim optimizer;
};

// A guard opened over one batch's loss (loss_id, no delay) with its backward run: what a binding
// does between optamp_scale_loss_begin and optamp_scale_loss_finish.
optamp_scaled_loss* backward_in_guard(Binding& binding, int loss_id = 0) {
  const auto b = make_batches(1)[0];
  at::Tensor loss = at::cross_entropy_loss(binding.net->forward(b.x, b.tag), b.y);
  optamp_scaled_loss* guard = nullptr;
  optamp_tensor* scaled = nullptr;
  C_OK(optamp_scale_loss_begin(handle(loss), binding.optimizer.identity(), 1,
                               binding.optimizer.params(), binding.optimizer.num_params(), loss_id,
                               0, &guard, &scaled));
  tensor(scaled).backward();
  optamp_tensor_free(scaled);
  return guard;
}

optamp_properties properties_struct() {
  optamp_properties p{};
  p.struct_size = sizeof(p);
  return p;
}

// Everything a run ends with: its losses, every parameter and buffer, the final loss scale and
// which steps were skipped.
struct TrainingRun {
  std::vector<at::Tensor> losses;
  std::vector<at::Tensor> state;
  std::vector<bool> skipped;
  double loss_scale = 0;
};

std::vector<at::Tensor> final_state(Net& net) {
  std::vector<at::Tensor> out;
  for (const auto& p : net->named_parameters()) out.push_back(p.value().detach().clone());
  for (const auto& b : net->named_buffers()) out.push_back(b.value().clone());
  return out;
}

// The loss of step `i`: the third overflows (an inf loss), which skips that step at every level
// (a dynamic scale backs off; a fixed one checks for overflow too).
at::Tensor training_loss(Net& net, const Batch& b, size_t i) {
  at::Tensor loss = at::cross_entropy_loss(net->forward(b.x, b.tag), b.y);
  return i == 2 ? loss * std::numeric_limits<float>::infinity() : loss;
}

// Bit for bit: same dtype, shape and bytes (NaN equals NaN with the same payload).
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || !a.sizes().equals(b.sizes())) return false;
  if (!a.is_floating_point()) return at::equal(a, b);
  const auto as_int = a.element_size() == 8   ? at::kLong
                      : a.element_size() == 4 ? at::kInt
                                              : at::kShort;
  return at::equal(a.contiguous().view(as_int), b.contiguous().view(as_int));
}

TrainingRun train_through_c_api(const std::string& level) {
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kAdam);
  optamp_properties preview = properties_struct();
  C_OK(optamp_resolve(level.c_str(), kQuietKeys, kQuietValues, 1, &preview));
  ModelShim model(*net, preview.keep_batchnorm_fp32 == 1);
  OptimizerShim optimizer(*opt);
  C_OK(optamp_initialize(model.get(), optimizer.get(), 1, level.c_str(), kQuietKeys, kQuietValues,
                         1, nullptr));
  TrainingRun run;
  const auto batches = make_batches(4);
  for (size_t i = 0; i < batches.size(); ++i) {
    opt->zero_grad();
    at::Tensor loss = training_loss(net, batches[i], i);
    optamp_scaled_loss* guard = nullptr;
    optamp_tensor* scaled = nullptr;
    C_OK(optamp_scale_loss_begin(handle(loss), optimizer.identity(), 1, optimizer.params(),
                                 optimizer.num_params(), /*loss_id=*/0, /*delay_unscale=*/0, &guard,
                                 &scaled));
    tensor(scaled).backward();  // autograd is the binding's business
    optamp_tensor_free(scaled);
    int skipped = -1;
    C_OK(optamp_scale_loss_finish(guard, &skipped));
    int skip = -1;
    C_OK(optamp_step_should_skip(optimizer.params(), optimizer.num_params(), &skip));
    EXPECT_EQ(skip, skipped);
    if (skip == 0) opt->step();
    run.losses.push_back(loss.detach().clone());
    run.skipped.push_back(skip != 0);
  }
  C_OK(optamp_loss_scale(0, &run.loss_scale));
  run.state = final_state(net);
  C_OK(optamp_reset());
  return run;
}

TrainingRun train_through_cpp_api(const std::string& level) {
  Net net = make_net();
  auto opt = make_optimizer(net, Opt::kAdam);
  initialize(net, *opt, level.c_str(), quiet());
  TrainingRun run;
  const auto batches = make_batches(4);
  for (size_t i = 0; i < batches.size(); ++i) {
    opt->zero_grad();
    at::Tensor loss = training_loss(net, batches[i], i);
    {
      auto scaled = scale_loss(loss, *opt);
      scaled.backward();
    }
    const bool stepped = step(*opt);
    run.losses.push_back(loss.detach().clone());
    run.skipped.push_back(!stepped);
  }
  run.loss_scale = loss_scaler(0).loss_scale();
  run.state = final_state(net);
  reset();
  return run;
}

class CApi : public Initialize {};

class CApiTraining : public Initialize, public ::testing::WithParamInterface<const char*> {};

TEST_P(CApiTraining, MatchesTheCppApiBitForBit) {
  const TrainingRun c = train_through_c_api(GetParam());
  const TrainingRun cpp = train_through_cpp_api(GetParam());
  ASSERT_EQ(c.losses.size(), cpp.losses.size());
  for (size_t i = 0; i < c.losses.size(); ++i) {
    EXPECT_TRUE(same_bits(c.losses[i], cpp.losses[i]))
        << "loss of step " << i << ": " << c.losses[i] << " vs " << cpp.losses[i];
  }
  EXPECT_EQ(c.skipped, cpp.skipped);
  EXPECT_EQ(c.skipped, (std::vector<bool>{false, false, true, false}));
  EXPECT_EQ(c.loss_scale, cpp.loss_scale);
  ASSERT_EQ(c.state.size(), cpp.state.size());
  for (size_t i = 0; i < c.state.size(); ++i) {
    EXPECT_TRUE(same_bits(c.state[i], cpp.state[i])) << "tensor " << i << " differs";
    EXPECT_TRUE(c.state[i].isfinite().all().item<bool>()) << "tensor " << i;
  }
  // Training changed the weights at all (the comparison is not of two untouched models).
  Net untouched = make_net();
  EXPECT_FALSE(at::equal(c.state[0], untouched->parameters()[0]));
}

INSTANTIATE_TEST_SUITE_P(Levels, CApiTraining, ::testing::Values("O1", "O2", "O4", "O5"),
                         [](const auto& info) { return std::string(info.param); });

TEST_F(CApi, AbiVersionAndStatusNames) {
  EXPECT_EQ(optamp_abi_version(), static_cast<uint32_t>(OPTAMP_ABI_VERSION));
  EXPECT_STREQ(optamp_status_name(OPTAMP_OK), "OPTAMP_OK");
  EXPECT_STREQ(optamp_status_name(OPTAMP_ERROR_NULL_ARGUMENT), "OPTAMP_ERROR_NULL_ARGUMENT");
  EXPECT_STREQ(optamp_status_name(static_cast<optamp_status>(77)), "OPTAMP_ERROR_UNKNOWN");
  EXPECT_STREQ(optamp_status_name(OPTAMP_STATUS_MAX_ENUM), "OPTAMP_ERROR_UNKNOWN");
}

TEST_F(CApi, OptionsTakePythonsSpellings) {
  optamp_properties p = properties_struct();
  {
    const char* keys[] = {"loss_scale",        "keep_batchnorm_fp32", "master_weights",
                          "num_losses",        "min_loss_scale",      "op_lists",
                          "cast_model_outputs"};
    const char* values[] = {"128.0", "False", "true", "2", "None", "torch", "torch.bfloat16"};
    C_OK(optamp_resolve("O2", keys, values, 7, &p));
    EXPECT_EQ(p.opt_level, 2);
    EXPECT_EQ(p.loss_scale_dynamic, 0);
    EXPECT_EQ(p.loss_scale, 128.0);
    EXPECT_EQ(p.keep_batchnorm_fp32, 0);
    EXPECT_EQ(p.master_weights, 1);
    EXPECT_EQ(p.num_losses, 2);
    EXPECT_EQ(p.low_dtype, OPTAMP_DTYPE_FLOAT16);
    EXPECT_EQ(p.model_cast, 1);
    EXPECT_EQ(p.cast_model_type, OPTAMP_DTYPE_FLOAT16);
  }
  for (const char* none : {"None", "False"}) {  // "do not cast the model"
    const char* keys[] = {"cast_model_type"};
    const char* values[] = {none};
    C_OK(optamp_resolve("O2", keys, values, 1, &p));
    EXPECT_EQ(p.cast_model_type, OPTAMP_DTYPE_UNDEFINED) << none;
    EXPECT_EQ(p.model_cast, 0) << none;
    EXPECT_EQ(p.casts, 0) << none;
  }
  {
    const char* keys[] = {"loss_scale", "enabled", "patch_torch_functions_type"};
    const char* values[] = {"dynamic", "1", "half"};
    C_OK(optamp_resolve("O1", keys, values, 3, &p));
    EXPECT_EQ(p.loss_scale_dynamic, 1);
    EXPECT_EQ(p.enabled, 1);
    EXPECT_EQ(p.patch_torch_functions, 1);
    EXPECT_EQ(p.low_dtype, OPTAMP_DTYPE_FLOAT16);
    EXPECT_EQ(p.keep_batchnorm_fp32, -1);  // None at O1
  }
  {
    const char* keys[] = {"cast_model_type", "loss_scale"};
    const char* values[] = {"bfloat16", nullptr};  // NULL: not overridden
    C_OK(optamp_resolve("O5", keys, values, 2, &p));
    EXPECT_EQ(p.low_dtype, OPTAMP_DTYPE_BFLOAT16);
    EXPECT_EQ(p.loss_scale, 1.0);
  }
  // A caller whose struct has grown beyond version 1: the known fields are written, no more.
  struct Grown {
    optamp_properties p;
    int later_field;
  } grown{};
  grown.p.struct_size = sizeof(grown);
  grown.later_field = 1234;
  C_OK(optamp_resolve("O4", nullptr, nullptr, 0, &grown.p));
  EXPECT_EQ(grown.p.low_dtype, OPTAMP_DTYPE_BFLOAT16);
  EXPECT_EQ(grown.later_field, 1234);
}

TEST_F(CApi, BadOptionsAreValueErrorsNamingTheOption) {
  optamp_properties p = properties_struct();
  auto refused = [&](const char* key, const char* value) {
    const char* keys[] = {key};
    const char* values[] = {value};
    const optamp_status status = optamp_resolve("O1", keys, values, 1, &p);
    return failure(status);
  };
  Failure f = refused("loss_scal", "128");
  EXPECT_EQ(f.status, OPTAMP_ERROR_VALUE);
  EXPECT_NE(f.message.find("option_keys[0] must be one of enabled, cast_model_type"),
            std::string::npos)
      << f.message;
  EXPECT_NE(f.message.find("got \"loss_scal\""), std::string::npos) << f.message;
  EXPECT_EQ(f.message.rfind("optamp_resolve: ", 0), 0u) << f.message;

  f = refused("loss_scale", "128x");
  EXPECT_EQ(f.status, OPTAMP_ERROR_VALUE);
  EXPECT_NE(f.message.find("option \"loss_scale\" (option_keys[0]) must be a number"),
            std::string::npos)
      << f.message;
  EXPECT_NE(f.message.find("got \"128x\""), std::string::npos) << f.message;

  f = refused("loss_scale", "-1");  // read, then refused by resolve's rule
  EXPECT_EQ(f.status, OPTAMP_ERROR_VALUE);
  EXPECT_NE(f.message.find("loss_scale"), std::string::npos) << f.message;

  f = refused("enabled", "yes");
  EXPECT_EQ(f.status, OPTAMP_ERROR_VALUE);
  EXPECT_NE(f.message.find("option \"enabled\" (option_keys[0]) must be \"True\", \"False\""),
            std::string::npos)
      << f.message;

  f = refused("num_losses", "2.5");
  EXPECT_EQ(f.status, OPTAMP_ERROR_VALUE);
  EXPECT_NE(f.message.find("must be a decimal integer, got \"2.5\""), std::string::npos)
      << f.message;

  f = refused("patch_torch_functions_type", "int8");
  EXPECT_EQ(f.status, OPTAMP_ERROR_VALUE);
  EXPECT_NE(f.message.find("must be a dtype name"), std::string::npos) << f.message;

  f = refused("op_lists", "native");
  EXPECT_EQ(f.status, OPTAMP_ERROR_VALUE);
  EXPECT_NE(f.message.find("must be \"apex\" or \"torch\", got \"native\""), std::string::npos)
      << f.message;

  {
    const char* keys[] = {"verbosity", "verbosity"};
    const char* values[] = {"0", "1"};
    f = failure(optamp_resolve("O1", keys, values, 2, &p));
    EXPECT_EQ(f.status, OPTAMP_ERROR_VALUE);
    EXPECT_NE(f.message.find("option \"verbosity\" (option_keys[1]) must be given once, got it "
                             "also as option_keys[0]"),
              std::string::npos)
        << f.message;
  }
  f = failure(optamp_resolve("o1", nullptr, nullptr, 0, &p));
  EXPECT_EQ(f.status, OPTAMP_ERROR_VALUE);
  EXPECT_NE(f.message.find("opt_level must be one of"), std::string::npos) << f.message;

  optamp_properties small{};
  small.struct_size = sizeof(size_t) + sizeof(int);
  f = failure(optamp_resolve("O1", nullptr, nullptr, 0, &small));
  EXPECT_EQ(f.status, OPTAMP_ERROR_VALUE);
  EXPECT_NE(f.message.find("out->struct_size must be at least"), std::string::npos) << f.message;

  // A success clears the message.
  C_OK(optamp_resolve("O1", nullptr, nullptr, 0, &p));
  EXPECT_STREQ(optamp_last_error(), "");
}

TEST_F(CApi, InitializeErrorsLeaveAmpUninitialized) {
  Binding binding{true};
  auto& [net, opt, model, optimizer] = binding;

  Failure f =
      failure(optamp_initialize(nullptr, optimizer.get(), 1, "O1", nullptr, nullptr, 0, nullptr));
  EXPECT_EQ(f.status, OPTAMP_ERROR_NULL_ARGUMENT);
  EXPECT_EQ(f.message, "optamp_initialize: model must not be NULL");

  f = failure(optamp_initialize(model.get(), nullptr, 1, "O1", nullptr, nullptr, 0, nullptr));
  EXPECT_EQ(f.status, OPTAMP_ERROR_NULL_ARGUMENT);
  EXPECT_EQ(f.message, "optamp_initialize: optimizers must not be NULL when num_optimizers is 1");

  f = failure(
      optamp_initialize(model.get(), optimizer.get(), 1, nullptr, nullptr, nullptr, 0, nullptr));
  EXPECT_EQ(f.status, OPTAMP_ERROR_NULL_ARGUMENT);
  EXPECT_NE(f.message.find("opt_level must not be NULL"), std::string::npos) << f.message;

  {
    const char* keys[] = {"loss_scale", nullptr};
    const char* values[] = {"1", "1"};
    f = failure(optamp_initialize(model.get(), optimizer.get(), 1, "O1", keys, values, 2, nullptr));
    EXPECT_EQ(f.status, OPTAMP_ERROR_NULL_ARGUMENT);
    EXPECT_NE(f.message.find("option_keys[1] must not be NULL"), std::string::npos) << f.message;
  }
  {
    optamp_tensor* saved = model.parameter_handles()[1];
    model.parameter_handles()[1] = nullptr;
    f = failure(
        optamp_initialize(model.get(), optimizer.get(), 1, "O1", nullptr, nullptr, 0, nullptr));
    model.parameter_handles()[1] = saved;
    EXPECT_EQ(f.status, OPTAMP_ERROR_NULL_ARGUMENT);
    EXPECT_NE(f.message.find("model->parameters[1] must not be NULL"), std::string::npos)
        << f.message;
  }
  {
    const size_t size = model.edit().struct_size;
    model.edit().struct_size = 8;
    f = failure(
        optamp_initialize(model.get(), optimizer.get(), 1, "O1", nullptr, nullptr, 0, nullptr));
    model.edit().struct_size = size;
    EXPECT_EQ(f.status, OPTAMP_ERROR_VALUE);
    EXPECT_NE(f.message.find("model->struct_size must be at least"), std::string::npos)
        << f.message;
  }
  {
    const char* keys[] = {"verbosity", "loss_scale"};
    const char* values[] = {"0", "dynamc"};
    f = failure(optamp_initialize(model.get(), optimizer.get(), 1, "O2", keys, values, 2, nullptr));
    EXPECT_EQ(f.status, OPTAMP_ERROR_VALUE);
    EXPECT_NE(f.message.find("option \"loss_scale\" (option_keys[1])"), std::string::npos)
        << f.message;
  }
  {
    const char* keys[] = {"verbosity", "keep_batchnorm_fp32"};  // Apex's rule 7 at O1
    const char* values[] = {"0", "True"};
    f = failure(optamp_initialize(model.get(), optimizer.get(), 1, "O1", keys, values, 2, nullptr));
    EXPECT_EQ(f.status, OPTAMP_ERROR_VALUE);
    EXPECT_NE(f.message.find("keep_batchnorm_fp32 should be None"), std::string::npos) << f.message;
  }
  EXPECT_EQ(optamp_is_initialized(), 0);
  EXPECT_FALSE(is_initialized());
  EXPECT_FALSE(is_casting_enabled());
  for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
}

TEST_F(CApi, InitializingTwiceIsRefusedAndChangesNothing) {
  Binding binding{true};
  auto& [net, opt, model, optimizer] = binding;
  const char* keys[] = {"verbosity", "loss_scale"};
  const char* first[] = {"0", "128"};
  optamp_properties p = properties_struct();
  C_OK(optamp_initialize(model.get(), optimizer.get(), 1, "O2", keys, first, 2, &p));
  EXPECT_EQ(p.opt_level, 2);
  EXPECT_EQ(p.loss_scale, 128.0);
  EXPECT_EQ(optamp_is_initialized(), 1);

  const char* second[] = {"0", "256"};
  const Failure f =
      failure(optamp_initialize(model.get(), optimizer.get(), 1, "O1", keys, second, 2, nullptr));
  EXPECT_EQ(f.status, OPTAMP_ERROR_VALUE);
  EXPECT_NE(f.message.find("optimizer 0 (Adam) was already passed to amp::initialize"),
            std::string::npos)
      << f.message;
  double scale = 0;
  C_OK(optamp_loss_scale(0, &scale));
  EXPECT_EQ(scale, 128.0);
  EXPECT_EQ(optamp_is_initialized(), 1);

  C_OK(optamp_reset());
  EXPECT_EQ(optamp_is_initialized(), 0);
  EXPECT_EQ(failure(optamp_loss_scale(0, &scale)).status, OPTAMP_ERROR_RUNTIME);
  EXPECT_NE(std::string(optamp_last_error()).find("optamp_loss_scale: "), std::string::npos);
}

TEST_F(CApi, ScaleLossNullArgumentsAndUnknownOptimizers) {
  Binding binding{};
  auto& [net, opt, model, optimizer] = binding;
  binding.initialize("O1");
  const auto b = make_batches(1)[0];
  at::Tensor loss = at::cross_entropy_loss(net->forward(b.x, b.tag), b.y);
  optamp_scaled_loss* guard = nullptr;
  optamp_tensor* scaled = nullptr;

  Failure f = failure(optamp_scale_loss_begin(nullptr, optimizer.identity(), 1, optimizer.params(),
                                              optimizer.num_params(), 0, 0, &guard, &scaled));
  EXPECT_EQ(f.status, OPTAMP_ERROR_NULL_ARGUMENT);
  EXPECT_EQ(f.message, "optamp_scale_loss_begin: loss must not be NULL");
  f = failure(optamp_scale_loss_begin(handle(loss), optimizer.identity(), 1, nullptr, 3, 0, 0,
                                      &guard, &scaled));
  EXPECT_EQ(f.status, OPTAMP_ERROR_NULL_ARGUMENT);
  EXPECT_NE(f.message.find("params must not be NULL when num_params is 3"), std::string::npos)
      << f.message;
  f = failure(optamp_scale_loss_begin(handle(loss), optimizer.identity(), 1, optimizer.params(),
                                      optimizer.num_params(), 0, 0, nullptr, &scaled));
  EXPECT_EQ(f.status, OPTAMP_ERROR_NULL_ARGUMENT);
  f = failure(optamp_scale_loss_begin(handle(loss), optimizer.identity(), 1, optimizer.params(), 0,
                                      0, 0, &guard, &scaled));
  EXPECT_EQ(f.status, OPTAMP_ERROR_VALUE);
  EXPECT_NE(f.message.find("num_params must be at least 1"), std::string::npos) << f.message;

  const int other = 0;  // an optimizer initialize was not given
  const void* ids[] = {&other};
  f = failure(optamp_scale_loss_begin(handle(loss), ids, 1, optimizer.params(),
                                      optimizer.num_params(), 0, 0, &guard, &scaled));
  EXPECT_EQ(f.status, OPTAMP_ERROR_VALUE);
  EXPECT_NE(f.message.find("optimizer_identities[0] must be an optimizer passed to "
                           "amp::initialize"),
            std::string::npos)
      << f.message;
  f = failure(optamp_scale_loss_begin(handle(loss), optimizer.identity(), 1, optimizer.params(),
                                      optimizer.num_params(), /*loss_id=*/3, 0, &guard, &scaled));
  EXPECT_NE(f.status, OPTAMP_OK);
  EXPECT_NE(f.message.find("loss_id"), std::string::npos) << f.message;
  EXPECT_EQ(guard, nullptr);
  EXPECT_EQ(scaled, nullptr);

  EXPECT_EQ(failure(optamp_scale_loss_finish(nullptr, nullptr)).status, OPTAMP_ERROR_NULL_ARGUMENT);
  EXPECT_EQ(failure(optamp_scale_loss_abandon(nullptr)).status, OPTAMP_ERROR_NULL_ARGUMENT);
  int skip = 0;
  EXPECT_EQ(
      failure(optamp_step_should_skip(optimizer.params(), optimizer.num_params(), nullptr)).status,
      OPTAMP_ERROR_NULL_ARGUMENT);
  EXPECT_EQ(failure(optamp_loss_scale(0, nullptr)).status, OPTAMP_ERROR_NULL_ARGUMENT);
  EXPECT_EQ(failure(optamp_state_save(nullptr, nullptr)).status, OPTAMP_ERROR_NULL_ARGUMENT);
  EXPECT_EQ(failure(optamp_state_load(nullptr, 4)).status, OPTAMP_ERROR_NULL_ARGUMENT);
  EXPECT_EQ(failure(optamp_autocast_enter(1, OPTAMP_DTYPE_FLOAT16, nullptr)).status,
            OPTAMP_ERROR_NULL_ARGUMENT);
  C_OK(optamp_step_should_skip(optimizer.params(), optimizer.num_params(), &skip));
  EXPECT_EQ(skip, 0);
}

TEST_F(CApi, AnInfGradientSkipsTheStepAndHalvesTheScale) {
  Binding binding{};
  auto& [net, opt, model, optimizer] = binding;
  binding.initialize("O1");
  double before = 0;
  C_OK(optamp_loss_scale(0, &before));
  std::vector<at::Tensor> weights;  // the parameters (a forward changes batch-norm's buffers)
  for (const auto& p : net->parameters()) weights.push_back(p.detach().clone());

  const auto b = make_batches(1)[0];
  at::Tensor loss = at::cross_entropy_loss(net->forward(b.x, b.tag), b.y);
  optamp_scaled_loss* guard = nullptr;
  optamp_tensor* scaled = nullptr;
  C_OK(optamp_scale_loss_begin(handle(loss), optimizer.identity(), 1, optimizer.params(),
                               optimizer.num_params(), 0, 0, &guard, &scaled));
  EXPECT_TRUE(at::equal(tensor(scaled), loss.detach().to(at::kFloat) * before));
  tensor(scaled).backward();
  optamp_tensor_free(scaled);
  net->parameters()[0].mutable_grad()[0][0][0][0] = std::numeric_limits<float>::infinity();
  int skipped = -1;
  C_OK(optamp_scale_loss_finish(guard, &skipped));
  EXPECT_EQ(skipped, 1);
  int skip = -1;
  C_OK(optamp_step_should_skip(optimizer.params(), optimizer.num_params(), &skip));
  EXPECT_EQ(skip, 1);
  for (const auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined());
  // Asked once: the overflow is forgotten after the step it skipped.
  C_OK(optamp_step_should_skip(optimizer.params(), optimizer.num_params(), &skip));
  EXPECT_EQ(skip, 0);
  double after = 0;
  C_OK(optamp_loss_scale(0, &after));
  EXPECT_EQ(after, before / 2);
  const auto params = net->parameters();
  for (size_t i = 0; i < weights.size(); ++i) EXPECT_TRUE(at::equal(weights[i], params[i])) << i;
}

TEST_F(CApi, UnscaledGradientsEqualThePlainLosssAndDelayUnscaleIsRefusedAtTheStep) {
  Binding binding{};
  auto& [net, opt, model, optimizer] = binding;
  const char* keys[] = {"verbosity", "loss_scale"};
  const char* values[] = {"0", "1024"};  // a power of two: unscaling is exact
  C_OK(optamp_initialize(model.get(), optimizer.get(), 1, "O0", keys, values, 2, nullptr));
  const auto b = make_batches(1)[0];
  // Structured bindings are captured by name only from C++20 (Clang refuses it in C++17).
  auto plain_grads = [&b, &net = net, &opt = opt] {
    opt->zero_grad();
    at::cross_entropy_loss(net->forward(b.x, b.tag), b.y).backward();
    std::vector<at::Tensor> g;
    for (const auto& p : net->parameters()) g.push_back(p.grad().clone());
    return g;
  };
  const auto expected = plain_grads();
  opt->zero_grad();

  // Two micro-batches: the first delayed (grads stay scaled), the second finishes both.
  for (int delay : {1, 0}) {
    at::Tensor loss = at::cross_entropy_loss(net->forward(b.x, b.tag), b.y) / 2;
    optamp_scaled_loss* guard = nullptr;
    optamp_tensor* scaled = nullptr;
    C_OK(optamp_scale_loss_begin(handle(loss), optimizer.identity(), 1, optimizer.params(),
                                 optimizer.num_params(), 0, delay, &guard, &scaled));
    tensor(scaled).backward();
    optamp_tensor_free(scaled);
    int skipped = -1;
    C_OK(optamp_scale_loss_finish(guard, &skipped));
    EXPECT_EQ(skipped, 0);
    if (delay) {
      int skip = -1;
      const Failure f =
          failure(optamp_step_should_skip(optimizer.params(), optimizer.num_params(), &skip));
      EXPECT_EQ(f.status, OPTAMP_ERROR_RUNTIME);
      EXPECT_NE(f.message.find("still holds scaled gradients"), std::string::npos) << f.message;
      EXPECT_NE(f.message.find("params[0]"), std::string::npos) << f.message;
      EXPECT_EQ(skip, -1);
    }
  }
  int skip = -1;
  C_OK(optamp_step_should_skip(optimizer.params(), optimizer.num_params(), &skip));
  EXPECT_EQ(skip, 0);
  const auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(all_close(params[i].grad(), expected[i], {1e-6, 1e-7})) << i;
  }
}

TEST_F(CApi, AbandonRestoresTheGradientsFromBefore) {
  Binding binding{};
  auto& [net, opt, model, optimizer] = binding;
  binding.initialize("O1");
  std::vector<at::Tensor> before;
  for (auto& p : net->parameters()) {
    p.mutable_grad() = at::full_like(p, 0.25);
    before.push_back(p.grad());
  }
  C_OK(optamp_scale_loss_abandon(backward_in_guard(binding)));
  const auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(params[i].grad().is_same(before[i])) << i;
  }
  int skip = -1;
  C_OK(optamp_step_should_skip(optimizer.params(), optimizer.num_params(), &skip));
  EXPECT_EQ(skip, 0);
}

// A binding that steps its optimizer between begin and finish updates with scaled gradients:
// finish names it (an error, *skipped_out 1, the guard freed and its gradients dropped).
TEST_F(CApi, FinishRefusesAGuardInsideWhichTheOptimizerStepped) {
  Binding binding{};
  auto& [net, opt, model, optimizer] = binding;
  binding.initialize("O1");
  optamp_scaled_loss* guard = backward_in_guard(binding);
  opt->step();
  int skipped = -1;
  const Failure f = failure(optamp_scale_loss_finish(guard, &skipped));
  EXPECT_EQ(f.status, OPTAMP_ERROR_RUNTIME);
  EXPECT_NE(f.message.find("were changed in place inside the scale_loss guard"), std::string::npos)
      << f.message;
  EXPECT_EQ(skipped, 1);
  for (const auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined());
  int skip = -1;  // the parameters are free again
  C_OK(optamp_step_should_skip(optimizer.params(), optimizer.num_params(), &skip));
  EXPECT_EQ(skip, 0);
}

TEST_F(CApi, RegionsCastAndExitRestoresFp32) {
  const at::Tensor a = at::randn({4, 4});
  const at::Tensor b = at::randn({4, 4});
  for (auto [dtype, type] : {std::pair{OPTAMP_DTYPE_FLOAT16, at::kHalf},
                             std::pair{OPTAMP_DTYPE_BFLOAT16, at::kBFloat16}}) {
    optamp_region* region = nullptr;
    C_OK(optamp_autocast_enter(1, dtype, &region));
    EXPECT_EQ(at::mm(a, b).scalar_type(), type);
    {
      at::NoGradGuard no_grad;  // regions cast under no_grad too
      EXPECT_EQ(at::mm(a, b).scalar_type(), type);
    }
    optamp_region* off = nullptr;
    C_OK(optamp_disable_casts_enter(&off));
    EXPECT_EQ(at::mm(a, b).scalar_type(), at::kFloat);
    const Failure f = failure(optamp_autocast_exit(off));  // the wrong kind: nothing ends
    EXPECT_EQ(f.status, OPTAMP_ERROR_TYPE);
    EXPECT_NE(f.message.find("region must be a region of optamp_autocast_enter"), std::string::npos)
        << f.message;
    C_OK(optamp_disable_casts_exit(off));
    EXPECT_EQ(at::mm(a, b).scalar_type(), type);
    C_OK(optamp_autocast_exit(region));
    EXPECT_EQ(at::mm(a, b).scalar_type(), at::kFloat);
  }
  optamp_region* region = nullptr;
  const Failure f = failure(optamp_autocast_enter(1, OPTAMP_DTYPE_FLOAT32, &region));
  EXPECT_EQ(f.status, OPTAMP_ERROR_VALUE);
  EXPECT_NE(f.message.find("dtype must be torch.float16 or torch.bfloat16"), std::string::npos)
      << f.message;
  EXPECT_EQ(region, nullptr);
  EXPECT_EQ(failure(optamp_autocast_enter(1, static_cast<optamp_dtype>(9), &region)).status,
            OPTAMP_ERROR_VALUE);
  EXPECT_EQ(failure(optamp_autocast_enter(1, OPTAMP_DTYPE_MAX_ENUM, &region)).status,
            OPTAMP_ERROR_VALUE);
  EXPECT_NE(std::string(optamp_last_error()).find("dtype must be an optamp_dtype"),
            std::string::npos);
}

TEST_F(CApi, DisableCastsTurnsAnInitializedLevelOff) {
  Binding binding{};
  auto& [net, opt, model, optimizer] = binding;
  binding.initialize("O4");
  const at::Tensor a = at::randn({4, 4}, at::requires_grad());
  EXPECT_EQ(at::mm(a, a).scalar_type(), at::kBFloat16);
  optamp_region* off = nullptr;
  C_OK(optamp_disable_casts_enter(&off));
  EXPECT_EQ(at::mm(a, a).scalar_type(), at::kFloat);
  C_OK(optamp_disable_casts_exit(off));
  EXPECT_EQ(at::mm(a, a).scalar_type(), at::kBFloat16);
  // A region with the level's dtype (UNDEFINED): bf16 at O4.
  optamp_region* region = nullptr;
  C_OK(optamp_autocast_enter(1, OPTAMP_DTYPE_UNDEFINED, &region));
  {
    at::NoGradGuard no_grad;
    EXPECT_EQ(at::mm(a, a).scalar_type(), at::kBFloat16);
  }
  C_OK(optamp_autocast_exit(region));
}

TEST_F(CApi, ModelBoundaryOfTheInitializedModel) {
  Binding binding{true};
  auto& [net, opt, model, optimizer] = binding;
  optamp_dtype inputs = OPTAMP_DTYPE_FLOAT64, outputs = OPTAMP_DTYPE_FLOAT64;
  C_OK(optamp_model_boundary(nullptr, &inputs, &outputs));
  EXPECT_EQ(inputs, OPTAMP_DTYPE_UNDEFINED);  // not initialized
  EXPECT_EQ(outputs, OPTAMP_DTYPE_UNDEFINED);
  C_OK(optamp_initialize(model.get(), optimizer.get(), 1, "O2", kQuietKeys, kQuietValues, 1,
                         nullptr));
  const ModelBoundary expected = core::model_boundary(net.get());
  C_OK(optamp_model_boundary(static_cast<torch::nn::Module*>(net.get()), &inputs, &outputs));
  EXPECT_EQ(inputs, OPTAMP_DTYPE_FLOAT16);
  EXPECT_EQ(outputs, OPTAMP_DTYPE_FLOAT32);
  EXPECT_EQ(expected.inputs, at::kHalf);
  const int stranger = 0;
  C_OK(optamp_model_boundary(&stranger, &inputs, &outputs));
  EXPECT_EQ(inputs, OPTAMP_DTYPE_UNDEFINED);
  EXPECT_EQ(outputs, OPTAMP_DTYPE_UNDEFINED);
  EXPECT_EQ(failure(optamp_model_boundary(nullptr, nullptr, &outputs)).status,
            OPTAMP_ERROR_NULL_ARGUMENT);
  // cast_model_inputs=False: the inputs as given, the outputs still fp32.
  C_OK(optamp_reset());
  const char* keys[] = {"verbosity", "cast_model_inputs"};
  const char* values[] = {"0", "False"};
  C_OK(optamp_initialize(model.get(), optimizer.get(), 1, "O2", keys, values, 2, nullptr));
  C_OK(optamp_model_boundary(static_cast<torch::nn::Module*>(net.get()), &inputs, &outputs));
  EXPECT_EQ(inputs, OPTAMP_DTYPE_UNDEFINED);
  EXPECT_EQ(outputs, OPTAMP_DTYPE_FLOAT32);
}

TEST_F(CApi, CastModelOutputLetsALossReadTheReducedOutput) {
  // A binding's boundary casts its model's outputs through the core, as amp::forward does: at O2
  // the fp32 logits' loss then reads the fp16 output (test_fused_casts.cpp has the values).
  Binding binding{true};
  auto& [net, opt, model, optimizer] = binding;
  C_OK(optamp_initialize(model.get(), optimizer.get(), 1, "O2", kQuietKeys, kQuietValues, 1,
                         nullptr));
  at::Tensor output = at::randn({4, 300}).to(at::kHalf).requires_grad_();
  optamp_tensor* wide = nullptr;
  C_OK(optamp_cast_model_output(handle(output), OPTAMP_DTYPE_FLOAT32, &wide));
  const at::Tensor logits = *reinterpret_cast<at::Tensor*>(wide);
  optamp_tensor_free(wide);
  EXPECT_EQ(logits.scalar_type(), at::kFloat);
  const auto read = first_input_dtypes("optamp::widened_log_softmax", [&] {
    at::cross_entropy_loss(logits, at::zeros({4}, at::kLong)).backward();
  });
  EXPECT_EQ(read, std::vector<at::ScalarType>{at::kHalf});
  EXPECT_TRUE(output.grad().defined());
  C_OK(optamp_cast_model_output(handle(output), OPTAMP_DTYPE_UNDEFINED, &wide));
  EXPECT_TRUE(reinterpret_cast<at::Tensor*>(wide)->is_same(output));  // left as it is
  optamp_tensor_free(wide);
  EXPECT_EQ(failure(optamp_cast_model_output(nullptr, OPTAMP_DTYPE_FLOAT32, &wide)).status,
            OPTAMP_ERROR_NULL_ARGUMENT);
  EXPECT_EQ(failure(optamp_cast_model_output(handle(output), OPTAMP_DTYPE_FLOAT32, nullptr)).status,
            OPTAMP_ERROR_NULL_ARGUMENT);
}

// The bytes' entries: name -> tensor, in order.
std::vector<std::pair<std::string, at::Tensor>> entries(const uint8_t* data, size_t size) {
  const c10::IValue value = torch::jit::pickle_load(std::vector<char>(data, data + size));
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& e : value.toGenericDict()) {
    out.emplace_back(e.key().toStringRef(), e.value().toTensor());
  }
  return out;
}

void expect_same(const std::vector<std::pair<std::string, at::Tensor>>& actual,
                 const StateDict& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_EQ(actual[i].first, expected.items()[i].first);
    EXPECT_EQ(actual[i].second.scalar_type(), expected.items()[i].second.scalar_type());
    EXPECT_TRUE(at::equal(actual[i].second, expected.items()[i].second)) << actual[i].first;
  }
}

TEST_F(CApi, StateBytesRoundTripBitExactly) {
  Binding binding{};
  auto& [net, opt, model, optimizer] = binding;
  const char* keys[] = {"verbosity", "num_losses"};
  const char* values[] = {"0", "2"};
  C_OK(optamp_initialize(model.get(), optimizer.get(), 1, "O1", keys, values, 2, nullptr));
  // Move the state off its start: an overflow on loss 1.
  optamp_scaled_loss* guard = backward_in_guard(binding, /*loss_id=*/1);
  net->parameters()[1].mutable_grad()[0] = std::numeric_limits<float>::quiet_NaN();
  C_OK(optamp_scale_loss_finish(guard, nullptr));

  const StateDict saved = state_dict();
  uint8_t* data = nullptr;
  size_t size = 0;
  C_OK(optamp_state_save(&data, &size));
  ASSERT_NE(data, nullptr);
  expect_same(entries(data, size), saved);
  EXPECT_EQ(saved.at("loss_scaler1.skipped").item<int64_t>(), 1);

  // Change it, then load the bytes back.
  loss_scaler(0).load(saved, "loss_scaler1.");  // scaler 0 now holds scaler 1's state
  ASSERT_FALSE(at::equal(state_dict().at("loss_scaler0.scale"), saved.at("loss_scaler0.scale")));
  C_OK(optamp_state_load(data, size));
  expect_same(entries(data, size), state_dict());

  // Bytes that are not a state: refused, nothing changed.
  const uint8_t garbage[] = {1, 2, 3, 4};
  Failure f = failure(optamp_state_load(garbage, sizeof(garbage)));
  EXPECT_EQ(f.status, OPTAMP_ERROR_VALUE);
  EXPECT_NE(f.message.find("data must be the bytes of optamp_state_save"), std::string::npos)
      << f.message;
  c10::Dict<std::string, at::Tensor> one;
  one.insert("loss_scaler0.scale", at::scalar_tensor(8.0, at::kFloat));
  const auto partial = torch::jit::pickle_save(c10::IValue(one));
  f = failure(optamp_state_load(reinterpret_cast<const uint8_t*>(partial.data()), partial.size()));
  EXPECT_EQ(f.status, OPTAMP_ERROR_VALUE);
  EXPECT_NE(f.message.find("state dict must hold num_losses=2"), std::string::npos) << f.message;
  expect_same(entries(data, size), state_dict());
  optamp_buffer_free(data);
}

}  // namespace
}  // namespace amp::testing
