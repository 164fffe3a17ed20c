// The built-in op lists. Start: Apex's O1 lists (FP16_FUNCS, FP32_FUNCS, CASTS/promote, BANNED),
// mapped from Python functions to the ATen operators they call, plus modern ops users hit.
// Overloads missing from the running LibTorch are skipped at registration (see policy_report()).
#include "dispatch/policy_table.h"

#include <cstring>

namespace amp::detail {
namespace {

struct OpName {
  const char* name;      // "aten::mm"
  const char* overload;  // "" = the default overload
};

// lower: Apex's FP16_FUNCS, plus newer ops users hit.
constexpr OpName kLowerOps[] = {
    {"aten::conv1d", ""},
    {"aten::conv1d", "padding"},
    {"aten::conv2d", ""},
    {"aten::conv2d", "padding"},
    {"aten::conv3d", ""},
    {"aten::conv3d", "padding"},
    {"aten::conv_transpose1d", ""},
    {"aten::conv_transpose2d", "input"},
    {"aten::conv_transpose3d", "input"},
    {"aten::conv_tbc", ""},
    {"aten::convolution", ""},
    {"aten::_convolution", ""},
    {"aten::linear", ""},
    {"aten::prelu", ""},
    {"aten::addmm", ""},
    {"aten::_addmm_activation", ""},  // addmm + relu/gelu, fused (native CPU lists it)
    {"aten::addmv", ""},
    {"aten::addr", ""},
    {"aten::matmul", ""},
    {"aten::mm", ""},
    {"aten::mv", ""},
    {"aten::addbmm", ""},
    {"aten::baddbmm", ""},
    {"aten::bmm", ""},
    {"aten::chain_matmul", ""},
    {"aten::linalg_multi_dot", ""},
    {"aten::einsum", ""},
    {"aten::scaled_dot_product_attention", ""},
    {"aten::_native_multi_head_attention", ""},
    {"aten::lstm_cell", ""},
    {"aten::gru_cell", ""},
    {"aten::rnn_tanh_cell", ""},
    {"aten::rnn_relu_cell", ""},
    // Whole RNN layers (nn.LSTM/GRU/RNN; ".data" is the PackedSequence form), as Apex's O1
    // (its RNN casts) and native autocast (AutocastCPU's mkldnn_rnn_layer, AutocastCUDA's
    // _cudnn_rnn) cast them. Without these, nn.RNN came out fp16 through its listed inner ops
    // while nn.LSTM/GRU, whose kernels call none, stayed fp32.
    {"aten::lstm", "input"},
    {"aten::lstm", "data"},
    {"aten::gru", "input"},
    {"aten::gru", "data"},
    {"aten::rnn_tanh", "input"},
    {"aten::rnn_tanh", "data"},
    {"aten::rnn_relu", "input"},
    {"aten::rnn_relu", "data"},
};

// fp32 (O1/O4 and regions): Apex's FP32_FUNCS.
constexpr OpName kFp32Ops[] = {
    {"aten::upsample_nearest1d", ""},
    {"aten::upsample_nearest1d", "vec"},
    {"aten::upsample_nearest2d", ""},
    {"aten::upsample_nearest2d", "vec"},
    {"aten::upsample_nearest3d", ""},
    {"aten::upsample_nearest3d", "vec"},
    {"aten::upsample_linear1d", ""},
    {"aten::upsample_linear1d", "vec"},
    {"aten::upsample_bilinear2d", ""},
    {"aten::upsample_bilinear2d", "vec"},
    {"aten::upsample_bicubic2d", ""},
    {"aten::upsample_bicubic2d", "vec"},
    {"aten::upsample_trilinear3d", ""},
    {"aten::upsample_trilinear3d", "vec"},
    // interpolate(mode="nearest-exact") and antialias=True (newer than Apex's lists)
    {"aten::_upsample_nearest_exact1d", ""},
    {"aten::_upsample_nearest_exact1d", "vec"},
    {"aten::_upsample_nearest_exact2d", ""},
    {"aten::_upsample_nearest_exact2d", "vec"},
    {"aten::_upsample_nearest_exact3d", ""},
    {"aten::_upsample_nearest_exact3d", "vec"},
    {"aten::_upsample_bilinear2d_aa", ""},
    {"aten::_upsample_bilinear2d_aa", "vec"},
    {"aten::_upsample_bicubic2d_aa", ""},
    {"aten::_upsample_bicubic2d_aa", "vec"},
    {"aten::grid_sampler", ""},
    // Apex's local_response_norm: F.local_response_norm (and torch::nn::functional's) pools
    // the squared input with avg_pool3d for 4-D/5-D input (avg_pool2d for 3-D), and CPU has
    // no fp16/bf16 avg_pool3d kernel. avg_pool2d stays uncast: its result is raised to fp32 by
    // the pow that follows, and it runs in fp16/bf16 everywhere.
    {"aten::avg_pool3d", ""},
    {"aten::softplus", ""},
    {"aten::gelu", ""},
    {"aten::layer_norm", ""},
    {"aten::group_norm", ""},
    {"aten::cosine_similarity", ""},
    {"aten::acos", ""},
    {"aten::asin", ""},
    {"aten::cosh", ""},
    {"aten::erfinv", ""},
    {"aten::exp", ""},
    {"aten::expm1", ""},
    {"aten::log", ""},
    {"aten::log10", ""},
    {"aten::log2", ""},
    {"aten::log1p", ""},
    {"aten::reciprocal", ""},
    {"aten::rsqrt", ""},
    {"aten::sinh", ""},
    {"aten::tan", ""},
    {"aten::pow", "Tensor_Scalar"},
    {"aten::pow", "Tensor_Tensor"},
    {"aten::pow", "Scalar"},
    {"aten::cumprod", ""},
    {"aten::cumsum", ""},
    {"aten::dist", ""},
    {"aten::norm", "Scalar"},
    {"aten::norm", "ScalarOpt_dim"},
    {"aten::norm", "ScalarOpt_dim_dtype"},
    {"aten::norm", "ScalarOpt_dtype"},
    {"aten::linalg_vector_norm", ""},
    {"aten::prod", ""},
    {"aten::prod", "dim_int"},
    {"aten::std", ""},
    {"aten::std", "dim"},
    {"aten::std", "correction"},
    {"aten::sum", ""},
    {"aten::sum", "dim_IntList"},
    {"aten::var", ""},
    {"aten::var", "dim"},
    {"aten::var", "correction"},
    {"aten::renorm", ""},
};

// fp32 (loss): softmaxes and every loss, fp32 at every casting level (O2/O5 included).
constexpr OpName kFp32LossOps[] = {
    {"aten::softmax", "int"},
    {"aten::log_softmax", "int"},
    {"aten::nll_loss", ""},
    {"aten::nll_loss2d", ""},
    {"aten::nll_loss_nd", ""},
    {"aten::cross_entropy_loss", ""},
    {"aten::mse_loss", ""},
    {"aten::l1_loss", ""},
    {"aten::smooth_l1_loss", ""},
    {"aten::huber_loss", ""},
    {"aten::kl_div", ""},
    {"aten::binary_cross_entropy_with_logits", ""},
    {"aten::soft_margin_loss", ""},
    {"aten::multi_margin_loss", ""},
    {"aten::multilabel_margin_loss", ""},
    {"aten::hinge_embedding_loss", ""},
    {"aten::margin_ranking_loss", ""},
    {"aten::cosine_embedding_loss", ""},
    {"aten::poisson_nll_loss", ""},
    {"aten::triplet_margin_loss", ""},
    {"aten::ctc_loss", "IntList"},
    {"aten::ctc_loss", "Tensor"},
};

// promote: Apex's CASTS.
constexpr OpName kPromoteOps[] = {
    {"aten::addcdiv", ""},   {"aten::addcmul", ""},       {"aten::atan2", ""},
    {"aten::cross", ""},     {"aten::linalg_cross", ""},  {"aten::bilinear", ""},
    {"aten::dot", ""},       {"aten::vdot", ""},          {"aten::add", "Tensor"},
    {"aten::sub", "Tensor"}, {"aten::mul", "Tensor"},     {"aten::div", "Tensor"},
    {"aten::eq", "Tensor"},  {"aten::ne", "Tensor"},      {"aten::lt", "Tensor"},
    {"aten::le", "Tensor"},  {"aten::gt", "Tensor"},      {"aten::ge", "Tensor"},
    {"aten::cat", ""},       {"aten::stack", ""},         {"aten::index_put", ""},
    {"aten::tensordot", ""}, {"aten::embedding_bag", ""}, {"aten::embedding_bag", "padding_idx"},
};

// banned: refused at O1/O4 and in regions with the message (what to use instead); at O2/O5 an
// fp32 loss.
struct BannedOp {
  OpName op;
  const char* message;
};
constexpr BannedOp kBannedOps[] = {
    {{"aten::binary_cross_entropy", ""},
     "amp does not work out-of-the-box with binary_cross_entropy (torch::nn::BCELoss, "
     "F.binary_cross_entropy): it is unsafe to autocast because sigmoid outputs in "
     "reduced precision lose the accuracy the loss needs. Use "
     "binary_cross_entropy_with_logits (torch::nn::BCEWithLogitsLoss), which fuses the "
     "sigmoid and is safe, or run the loss in fp32 inside an amp::disable_casts() scope. "
     "(Refused at O1/O4 and in amp::autocast regions, as Apex's O1 did; at O2/O5 it runs "
     "as an fp32 loss, and at O0/O3 it is not cast.)"},
};

template <std::size_t N>
void append(std::vector<TableEntry>& table, const OpName (&ops)[N], CastPolicy policy) {
  for (const OpName& op : ops) table.push_back({op.name, op.overload, policy, nullptr});
}

}  // namespace

const std::vector<TableEntry>& builtin_table() {
  static const std::vector<TableEntry> table = [] {
    std::vector<TableEntry> t;
    append(t, kLowerOps, CastPolicy::kLower);
    append(t, kFp32Ops, CastPolicy::kFp32);
    append(t, kFp32LossOps, CastPolicy::kFp32Loss);
    append(t, kPromoteOps, CastPolicy::kPromote);
    for (const BannedOp& b : kBannedOps) {
      t.push_back({b.op.name, b.op.overload, CastPolicy::kBanned, b.message});
    }
    return t;
  }();
  return table;
}

}  // namespace amp::detail

namespace amp {

const char* to_string(CastPolicy policy) {
  switch (policy) {
    case CastPolicy::kLower:
      return "lower";
    case CastPolicy::kFp32:
      return "fp32";
    case CastPolicy::kFp32Loss:
      return "fp32 (loss)";
    case CastPolicy::kPromote:
      return "promote";
    case CastPolicy::kBanned:
      return "banned";
  }
  return "?";
}

const char* to_string(RuleSet rules) {
  switch (rules) {
    case RuleSet::kNone:
      return "none";
    case RuleSet::kFullLists:
      return "full lists";
    case RuleSet::kMasterWeights:
      return "master weights";
    case RuleSet::kPureLow:
      return "pure low";
  }
  return "?";
}

bool policy_applies(CastPolicy policy, RuleSet rules) {
  switch (rules) {
    case RuleSet::kFullLists:
      return true;
    case RuleSet::kMasterWeights:
      return policy == CastPolicy::kLower || policy == CastPolicy::kFp32Loss ||
             policy == CastPolicy::kBanned;
    case RuleSet::kPureLow:
      return policy == CastPolicy::kLower;
    case RuleSet::kNone:
      break;
  }
  return false;
}

}  // namespace amp
