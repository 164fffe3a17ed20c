// The built-in op lists. Start: Apex's O1 lists (FP16_FUNCS, FP32_FUNCS, CASTS/promote, BANNED),
// mapped from Python functions to the ATen operators they call, plus modern ops users hit.
// Overloads missing from the running LibTorch are skipped at registration (see policy_report()).
#include "dispatch/policy_table.h"

#include <cstring>

namespace amp::detail {
namespace {

constexpr Category L = Category::kLower;
constexpr Category F = Category::kFp32;
constexpr Category S = Category::kFp32Loss;
constexpr Category P = Category::kPromote;
constexpr Category B = Category::kBanned;

}  // namespace

const std::vector<TableEntry>& builtin_table() {
  static const std::vector<TableEntry> table = {
      // ---- lower (Apex FP16_FUNCS + modern) ----------------------------------------------
      {"aten::conv1d", "", L},
      {"aten::conv1d", "padding", L},
      {"aten::conv2d", "", L},
      {"aten::conv2d", "padding", L},
      {"aten::conv3d", "", L},
      {"aten::conv3d", "padding", L},
      {"aten::conv_transpose1d", "", L},
      {"aten::conv_transpose2d", "input", L},
      {"aten::conv_transpose3d", "input", L},
      {"aten::conv_tbc", "", L},
      {"aten::convolution", "", L},
      {"aten::_convolution", "", L},
      {"aten::linear", "", L},
      {"aten::prelu", "", L},
      {"aten::addmm", "", L},
      {"aten::_addmm_activation", "", L},  // addmm + relu/gelu, fused (native CPU lists it)
      {"aten::addmv", "", L},
      {"aten::addr", "", L},
      {"aten::matmul", "", L},
      {"aten::mm", "", L},
      {"aten::mv", "", L},
      {"aten::addbmm", "", L},
      {"aten::baddbmm", "", L},
      {"aten::bmm", "", L},
      {"aten::chain_matmul", "", L},
      {"aten::linalg_multi_dot", "", L},
      {"aten::einsum", "", L},
      {"aten::scaled_dot_product_attention", "", L},
      {"aten::_native_multi_head_attention", "", L},
      {"aten::lstm_cell", "", L},
      {"aten::gru_cell", "", L},
      {"aten::rnn_tanh_cell", "", L},
      {"aten::rnn_relu_cell", "", L},
      // Whole RNN layers (nn.LSTM/GRU/RNN; ".data" is the PackedSequence form), as Apex's O1
      // (its RNN casts) and native autocast (AutocastCPU's mkldnn_rnn_layer, AutocastCUDA's
      // _cudnn_rnn) cast them. Without these, nn.RNN came out fp16 through its listed inner ops
      // while nn.LSTM/GRU, whose kernels call none, stayed fp32.
      {"aten::lstm", "input", L},
      {"aten::lstm", "data", L},
      {"aten::gru", "input", L},
      {"aten::gru", "data", L},
      {"aten::rnn_tanh", "input", L},
      {"aten::rnn_tanh", "data", L},
      {"aten::rnn_relu", "input", L},
      {"aten::rnn_relu", "data", L},
      // ---- fp32 (Apex FP32_FUNCS) ---------------------------------------------------------
      {"aten::upsample_nearest1d", "", F},
      {"aten::upsample_nearest1d", "vec", F},
      {"aten::upsample_nearest2d", "", F},
      {"aten::upsample_nearest2d", "vec", F},
      {"aten::upsample_nearest3d", "", F},
      {"aten::upsample_nearest3d", "vec", F},
      {"aten::upsample_linear1d", "", F},
      {"aten::upsample_linear1d", "vec", F},
      {"aten::upsample_bilinear2d", "", F},
      {"aten::upsample_bilinear2d", "vec", F},
      {"aten::upsample_bicubic2d", "", F},
      {"aten::upsample_bicubic2d", "vec", F},
      {"aten::upsample_trilinear3d", "", F},
      {"aten::upsample_trilinear3d", "vec", F},
      // interpolate(mode="nearest-exact") and antialias=True (newer than Apex's lists)
      {"aten::_upsample_nearest_exact1d", "", F},
      {"aten::_upsample_nearest_exact1d", "vec", F},
      {"aten::_upsample_nearest_exact2d", "", F},
      {"aten::_upsample_nearest_exact2d", "vec", F},
      {"aten::_upsample_nearest_exact3d", "", F},
      {"aten::_upsample_nearest_exact3d", "vec", F},
      {"aten::_upsample_bilinear2d_aa", "", F},
      {"aten::_upsample_bilinear2d_aa", "vec", F},
      {"aten::_upsample_bicubic2d_aa", "", F},
      {"aten::_upsample_bicubic2d_aa", "vec", F},
      {"aten::grid_sampler", "", F},
      // Apex's local_response_norm: F.local_response_norm (and torch::nn::functional's) pools
      // the squared input with avg_pool3d for 4-D/5-D input (avg_pool2d for 3-D), and CPU has
      // no fp16/bf16 avg_pool3d kernel. avg_pool2d stays uncast: its result is raised to fp32 by
      // the pow that follows, and it runs in fp16/bf16 everywhere.
      {"aten::avg_pool3d", "", F},
      {"aten::softplus", "", F},
      {"aten::gelu", "", F},
      {"aten::layer_norm", "", F},
      {"aten::group_norm", "", F},
      {"aten::cosine_similarity", "", F},
      {"aten::acos", "", F},
      {"aten::asin", "", F},
      {"aten::cosh", "", F},
      {"aten::erfinv", "", F},
      {"aten::exp", "", F},
      {"aten::expm1", "", F},
      {"aten::log", "", F},
      {"aten::log10", "", F},
      {"aten::log2", "", F},
      {"aten::log1p", "", F},
      {"aten::reciprocal", "", F},
      {"aten::rsqrt", "", F},
      {"aten::sinh", "", F},
      {"aten::tan", "", F},
      {"aten::pow", "Tensor_Scalar", F},
      {"aten::pow", "Tensor_Tensor", F},
      {"aten::pow", "Scalar", F},
      {"aten::cumprod", "", F},
      {"aten::cumsum", "", F},
      {"aten::dist", "", F},
      {"aten::norm", "Scalar", F},
      {"aten::norm", "ScalarOpt_dim", F},
      {"aten::norm", "ScalarOpt_dim_dtype", F},
      {"aten::norm", "ScalarOpt_dtype", F},
      {"aten::linalg_vector_norm", "", F},
      {"aten::prod", "", F},
      {"aten::prod", "dim_int", F},
      {"aten::std", "", F},
      {"aten::std", "dim", F},
      {"aten::std", "correction", F},
      {"aten::sum", "", F},
      {"aten::sum", "dim_IntList", F},
      {"aten::var", "", F},
      {"aten::var", "dim", F},
      {"aten::var", "correction", F},
      {"aten::renorm", "", F},
      // ---- fp32 at every casting level: softmaxes and every loss ---------------------------
      {"aten::softmax", "int", S},
      {"aten::log_softmax", "int", S},
      {"aten::nll_loss", "", S},
      {"aten::nll_loss2d", "", S},
      {"aten::nll_loss_nd", "", S},
      {"aten::cross_entropy_loss", "", S},
      {"aten::mse_loss", "", S},
      {"aten::l1_loss", "", S},
      {"aten::smooth_l1_loss", "", S},
      {"aten::huber_loss", "", S},
      {"aten::kl_div", "", S},
      {"aten::binary_cross_entropy_with_logits", "", S},
      {"aten::soft_margin_loss", "", S},
      {"aten::multi_margin_loss", "", S},
      {"aten::multilabel_margin_loss", "", S},
      {"aten::hinge_embedding_loss", "", S},
      {"aten::margin_ranking_loss", "", S},
      {"aten::cosine_embedding_loss", "", S},
      {"aten::poisson_nll_loss", "", S},
      {"aten::triplet_margin_loss", "", S},
      {"aten::ctc_loss", "IntList", S},
      {"aten::ctc_loss", "Tensor", S},
      // ---- promote (Apex CASTS) -----------------------------------------------------------
      {"aten::addcdiv", "", P},
      {"aten::addcmul", "", P},
      {"aten::atan2", "", P},
      {"aten::cross", "", P},
      {"aten::linalg_cross", "", P},
      {"aten::bilinear", "", P},
      {"aten::dot", "", P},
      {"aten::vdot", "", P},
      {"aten::add", "Tensor", P},
      {"aten::sub", "Tensor", P},
      {"aten::mul", "Tensor", P},
      {"aten::div", "Tensor", P},
      {"aten::eq", "Tensor", P},
      {"aten::ne", "Tensor", P},
      {"aten::lt", "Tensor", P},
      {"aten::le", "Tensor", P},
      {"aten::gt", "Tensor", P},
      {"aten::ge", "Tensor", P},
      {"aten::cat", "", P},
      {"aten::stack", "", P},
      {"aten::index_put", "", P},
      {"aten::tensordot", "", P},
      {"aten::embedding_bag", "", P},
      {"aten::embedding_bag", "padding_idx", P},
      // ---- banned -------------------------------------------------------------------------
      {"aten::binary_cross_entropy", "", B},
  };
  return table;
}

const char* category_name(Category c) {
  switch (c) {
    case Category::kLower:
      return "lower";
    case Category::kFp32:
      return "fp32";
    case Category::kFp32Loss:
      return "fp32 (loss)";
    case Category::kPromote:
      return "promote";
    case Category::kBanned:
      return "banned";
  }
  return "?";
}

const char* banned_message(const char* name) {
  if (std::strcmp(name, "aten::binary_cross_entropy") == 0) {
    return "amp does not work out-of-the-box with binary_cross_entropy (torch::nn::BCELoss, "
           "F.binary_cross_entropy): it is unsafe to autocast because sigmoid outputs in "
           "reduced precision lose the accuracy the loss needs. Use "
           "binary_cross_entropy_with_logits (torch::nn::BCEWithLogitsLoss), which fuses the "
           "sigmoid and is safe, or run the loss in fp32 inside an amp::disable_casts() scope. "
           "(Refused at O1/O4 and in amp::autocast regions, as Apex's O1 did; at O2/O5 it runs "
           "as an fp32 loss, and at O0/O3 it is not cast.)";
  }
  return "this op is banned under optamp casting";
}

}  // namespace amp::detail
