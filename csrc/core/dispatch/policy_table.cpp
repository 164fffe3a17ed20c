// The built-in op lists. Apex's O1 lists (FP16_FUNCS, FP32_FUNCS, CASTS/promote, BANNED),
// mapped from Python functions to the ATen operators they call, plus modern ops users hit; and
// torch.autocast's own lists (op_lists="torch"): AutocastCUDA's straight from the list macros of
// the LibTorch we build against, AutocastCPU's (which torch keeps in a .cpp) written out here and
// checked against the running LibTorch's registrations by the tests.
// Overloads missing from the running LibTorch are skipped at registration (see policy_report()).
#include "dispatch/policy_table.h"

#include <ATen/autocast_mode.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <string_view>

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
    // The ATen ops under F.grid_sample and F.layer_norm, public as torch.grid_sampler_2d/3d and
    // torch.native_layer_norm: a direct call (or a decomposition that reaches one) with a reduced
    // input and an fp32 grid or weight failed ("expected scalar type Half but found Float") where
    // the function above them is widened.
    {"aten::grid_sampler_2d", ""},
    {"aten::grid_sampler_3d", ""},
    // Apex's local_response_norm: F.local_response_norm (and torch::nn::functional's) pools
    // the squared input with avg_pool3d for 4-D/5-D input (avg_pool2d for 3-D), and CPU has
    // no fp16/bf16 avg_pool3d kernel. avg_pool2d stays uncast: its result is raised to fp32 by
    // the pow that follows, and it runs in fp16/bf16 everywhere.
    {"aten::avg_pool3d", ""},
    {"aten::softplus", ""},
    {"aten::gelu", ""},
    {"aten::layer_norm", ""},
    {"aten::native_layer_norm", ""},
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
};

// fp32 (always): ops ATen has no fp16/bf16 kernel for, at every level that casts (O3 too), so a
// reduced activation or working copy reaching one is widened instead of failing. Apex's lists
// leave them out (its O1 fed most of them fp32 activations; at O2 they failed); torch's CPU list
// has most of them as fp32 rows (O1/O4 only), its CUDA list only cdist and pdist.
// FFTs: no bf16 FFT on any device, no fp16 one on the CPU ("Unsupported dtype Half"); cuFFT's
// fp16 takes power-of-two sizes only and gives complex32 results, which few ops accept.
// Linear algebra: no fp16/bf16 decompositions, solvers or determinants on any device ("Low
// precision dtypes not supported"; "lu_cpu" not implemented for 'Half'): a normalizing flow's
// slogdet of a weight, orthogonal parametrizations (Cayley, Householder), Gaussian-process
// heads. The matrix exponential has fp16/bf16 kernels, but torch 2.11's CPU one returns NaN for
// ordinary inputs (a 2x2 diagonal matrix of norm 0.2, random 16x16 ones), so `orthogonal`'s
// default map for a square weight skipped every step at O2/O5. Distances and quantiles: no
// fp16/bf16 cdist/pdist kernel on the CPU (torch's CUDA autocast lists both in fp32 too);
// quantile takes float or double only. Complex values from real pairs (`view_as_complex`,
// `complex`): there is no complex bf16 on any device, and fp16 makes complex32, which the CPU
// cannot exponentiate, sum or take the log of ("exp_vml_cpu" not implemented for 'ComplexHalf'):
// an S4D-style layer's state matrix, kept as real pairs, failed at O2/O5. torch.special's
// functions with float/double kernels only, on every device (log_ndtr and ndtri of a probit or
// quantile head, erfcx, zeta, the Bessel and Airy functions, the orthogonal polynomials), and
// histograms ("histogramdd" not implemented for 'Half').
constexpr OpName kFp32AlwaysOps[] = {
    {"aten::fft_fft", ""},
    {"aten::fft_ifft", ""},
    {"aten::fft_fft2", ""},
    {"aten::fft_ifft2", ""},
    {"aten::fft_fftn", ""},
    {"aten::fft_ifftn", ""},
    {"aten::fft_rfft", ""},
    {"aten::fft_irfft", ""},
    {"aten::fft_rfft2", ""},
    {"aten::fft_irfft2", ""},
    {"aten::fft_rfftn", ""},
    {"aten::fft_irfftn", ""},
    {"aten::fft_hfft", ""},
    {"aten::fft_ihfft", ""},
    {"aten::fft_hfft2", ""},
    {"aten::fft_ihfft2", ""},
    {"aten::fft_hfftn", ""},
    {"aten::fft_ihfftn", ""},
    {"aten::stft", ""},
    {"aten::stft", "center"},
    {"aten::istft", ""},
    {"aten::cholesky", ""},
    {"aten::cholesky_inverse", ""},
    {"aten::cholesky_solve", ""},
    {"aten::inverse", ""},
    {"aten::lu_solve", ""},
    {"aten::orgqr", ""},
    {"aten::ormqr", ""},
    {"aten::pinverse", ""},
    {"aten::geqrf", ""},
    {"aten::qr", ""},
    {"aten::svd", ""},
    {"aten::triangular_solve", ""},
    {"aten::det", ""},
    {"aten::slogdet", ""},
    {"aten::logdet", ""},
    // A nuclear- or spectral-norm penalty on a weight (low-rank and Lipschitz regularizers) at
    // O2/O5, where the op sees the working copy: "linalg.matrix_norm: Low precision dtypes not
    // supported" for every ord but the norms of entries. torch's CUDA lists make them fp32 too.
    {"aten::linalg_matrix_norm", ""},
    {"aten::linalg_matrix_norm", "str_ord"},
    {"aten::nuclear_norm", ""},
    {"aten::nuclear_norm", "dim"},
    {"aten::linalg_cond", ""},
    {"aten::linalg_cond", "p_str"},
    {"aten::linalg_matrix_rank", ""},
    {"aten::linalg_matrix_rank", "tol_tensor"},
    {"aten::linalg_matrix_rank", "atol_rtol_tensor"},
    {"aten::linalg_matrix_rank", "atol_rtol_float"},
    {"aten::linalg_solve", ""},
    {"aten::linalg_solve_ex", ""},
    {"aten::linalg_solve_triangular", ""},
    {"aten::linalg_cholesky", ""},
    {"aten::linalg_cholesky_ex", ""},
    {"aten::linalg_inv", ""},
    {"aten::linalg_inv_ex", ""},
    {"aten::linalg_det", ""},
    {"aten::linalg_slogdet", ""},
    {"aten::linalg_lu", ""},
    {"aten::linalg_lu_factor", ""},
    {"aten::linalg_lu_factor_ex", ""},
    {"aten::linalg_lu_solve", ""},
    {"aten::linalg_ldl_factor", ""},
    {"aten::linalg_ldl_factor_ex", ""},
    {"aten::linalg_ldl_solve", ""},
    {"aten::linalg_qr", ""},
    {"aten::linalg_householder_product", ""},
    {"aten::linalg_svd", ""},
    {"aten::linalg_svdvals", ""},
    {"aten::linalg_eig", ""},
    {"aten::linalg_eigvals", ""},
    {"aten::linalg_eigh", ""},
    {"aten::linalg_eigvalsh", ""},
    {"aten::linalg_lstsq", ""},
    {"aten::linalg_pinv", ""},
    {"aten::linalg_pinv", "atol_rtol_float"},
    {"aten::linalg_pinv", "atol_rtol_tensor"},
    {"aten::linalg_pinv", "rcond_tensor"},
    {"aten::linalg_tensorinv", ""},
    {"aten::linalg_tensorsolve", ""},
    {"aten::linalg_matrix_exp", ""},
    {"aten::matrix_exp", ""},
    {"aten::cdist", ""},
    {"aten::pdist", ""},
    {"aten::quantile", ""},
    {"aten::quantile", "scalar"},
    {"aten::nanquantile", ""},
    {"aten::nanquantile", "scalar"},
    {"aten::view_as_complex", ""},
    {"aten::complex", ""},
    {"aten::special_log_ndtr", ""},
    {"aten::special_ndtri", ""},
    {"aten::special_erfcx", ""},
    {"aten::special_bessel_j0", ""},
    {"aten::special_bessel_j1", ""},
    {"aten::special_bessel_y0", ""},
    {"aten::special_bessel_y1", ""},
    {"aten::special_modified_bessel_i0", ""},
    {"aten::special_modified_bessel_i1", ""},
    {"aten::special_modified_bessel_k0", ""},
    {"aten::special_modified_bessel_k1", ""},
    {"aten::special_scaled_modified_bessel_k0", ""},
    {"aten::special_scaled_modified_bessel_k1", ""},
    {"aten::special_spherical_bessel_j0", ""},
    {"aten::special_airy_ai", ""},
    // fp16/bf16 forward kernels, but their backward is float/double only on every device
    // ("i1_backward" not implemented for 'Half'): a von Mises-Fisher head trains in fp32 only.
    {"aten::special_i1", ""},
    {"aten::special_i1e", ""},
    {"aten::special_zeta", ""},
    {"aten::special_zeta", "self_scalar"},
    {"aten::special_zeta", "other_scalar"},
    {"aten::special_chebyshev_polynomial_t", ""},
    {"aten::special_chebyshev_polynomial_t", "x_scalar"},
    {"aten::special_chebyshev_polynomial_t", "n_scalar"},
    {"aten::special_chebyshev_polynomial_u", ""},
    {"aten::special_chebyshev_polynomial_u", "x_scalar"},
    {"aten::special_chebyshev_polynomial_u", "n_scalar"},
    {"aten::special_chebyshev_polynomial_v", ""},
    {"aten::special_chebyshev_polynomial_v", "x_scalar"},
    {"aten::special_chebyshev_polynomial_v", "n_scalar"},
    {"aten::special_chebyshev_polynomial_w", ""},
    {"aten::special_chebyshev_polynomial_w", "x_scalar"},
    {"aten::special_chebyshev_polynomial_w", "n_scalar"},
    {"aten::special_shifted_chebyshev_polynomial_t", ""},
    {"aten::special_shifted_chebyshev_polynomial_t", "x_scalar"},
    {"aten::special_shifted_chebyshev_polynomial_t", "n_scalar"},
    {"aten::special_shifted_chebyshev_polynomial_u", ""},
    {"aten::special_shifted_chebyshev_polynomial_u", "x_scalar"},
    {"aten::special_shifted_chebyshev_polynomial_u", "n_scalar"},
    {"aten::special_shifted_chebyshev_polynomial_v", ""},
    {"aten::special_shifted_chebyshev_polynomial_v", "x_scalar"},
    {"aten::special_shifted_chebyshev_polynomial_v", "n_scalar"},
    {"aten::special_shifted_chebyshev_polynomial_w", ""},
    {"aten::special_shifted_chebyshev_polynomial_w", "x_scalar"},
    {"aten::special_shifted_chebyshev_polynomial_w", "n_scalar"},
    {"aten::special_hermite_polynomial_h", ""},
    {"aten::special_hermite_polynomial_h", "x_scalar"},
    {"aten::special_hermite_polynomial_h", "n_scalar"},
    {"aten::special_hermite_polynomial_he", ""},
    {"aten::special_hermite_polynomial_he", "x_scalar"},
    {"aten::special_hermite_polynomial_he", "n_scalar"},
    {"aten::special_laguerre_polynomial_l", ""},
    {"aten::special_laguerre_polynomial_l", "x_scalar"},
    {"aten::special_laguerre_polynomial_l", "n_scalar"},
    {"aten::special_legendre_polynomial_p", ""},
    {"aten::special_legendre_polynomial_p", "x_scalar"},
    {"aten::special_legendre_polynomial_p", "n_scalar"},
    {"aten::histogram", "bins_tensor"},
    {"aten::histogram", "bin_ct"},
    {"aten::histogramdd", ""},
    {"aten::histogramdd", "int_bins"},
    {"aten::histogramdd", "TensorList_bins"},
    // CTC has float/double kernels only, on every device ("ctc_loss_cuda" not implemented for
    // 'Half'): Apex's fp32 loss row, made fp32 at O3 too, where an fp16 speech model's
    // log-probabilities reached it and failed.
    {"aten::ctc_loss", "IntList"},
    {"aten::ctc_loss", "Tensor"},
};

// fp32 (always) on the CPU alone: ops ATen has no fp16/bf16 CPU kernel for, where CUDA has one
// (so a GPU keeps running them reduced). A 3-D average pool (nn.AvgPool3d, lp_pool3d) of a video
// or volume model at O2/O3/O5, where Apex's fp32 row for it does not apply; the antialiased
// resizes (`interpolate(..., antialias=True)`: "compute_index_ranges_weights" not implemented
// for 'Half'), a ViT's learned position grid resized to the input at O2/O5; a trace; polar; the
// samplers behind torch.distributions' Gamma, Beta, Dirichlet and Binomial and their gradients,
// given reduced parameters by a working copy or an activation ("gamma_cpu" not implemented for
// 'BFloat16'; Dirichlet's backward meets its fp32 sample with the fp16 concentration); the
// multi-class and multi-label margin losses, fp32 losses elsewhere, at O3 (where the losses are
// left as given) too. Ops that write an argument are not listed: a widened copy would take the
// write.
constexpr OpName kCpuFp32AlwaysOps[] = {
    {"aten::avg_pool3d", ""},
    {"aten::_upsample_bilinear2d_aa", ""},
    {"aten::_upsample_bilinear2d_aa", "vec"},
    {"aten::_upsample_bicubic2d_aa", ""},
    {"aten::_upsample_bicubic2d_aa", "vec"},
    {"aten::trace", ""},
    {"aten::polar", ""},
    {"aten::_standard_gamma", ""},
    {"aten::_standard_gamma_grad", ""},
    {"aten::_sample_dirichlet", ""},
    {"aten::_dirichlet_grad", ""},
    {"aten::binomial", ""},
    {"aten::multi_margin_loss", ""},
    {"aten::multilabel_margin_loss", ""},
};

// promote: Apex's CASTS, and three of optamp's (below).
constexpr OpName kPromoteOps[] = {
    {"aten::addcdiv", ""},
    {"aten::addcmul", ""},
    {"aten::atan2", ""},
    {"aten::cross", ""},
    {"aten::linalg_cross", ""},
    {"aten::bilinear", ""},
    {"aten::dot", ""},
    {"aten::vdot", ""},
    {"aten::add", "Tensor"},
    {"aten::sub", "Tensor"},
    {"aten::mul", "Tensor"},
    {"aten::div", "Tensor"},
    {"aten::eq", "Tensor"},
    {"aten::ne", "Tensor"},
    {"aten::lt", "Tensor"},
    {"aten::le", "Tensor"},
    {"aten::gt", "Tensor"},
    {"aten::ge", "Tensor"},
    {"aten::cat", ""},
    {"aten::stack", ""},
    {"aten::index_put", ""},
    {"aten::tensordot", ""},
    {"aten::embedding_bag", ""},
    {"aten::embedding_bag", "padding_idx"},
    // optamp's: ops newer than Apex's lists that torch does not promote, which fail on the mixed
    // widths casting makes ("expected dtype c10::Half for `end` but got dtype float"): a learned
    // token mixed into fp16 activations by `torch.lerp(token, x, mask)` at O1/O4, a working copy
    // beside an fp32 tensor at O2/O5.
    {"aten::lerp", "Scalar"},
    {"aten::lerp", "Tensor"},
    {"aten::heaviside", ""},
    // Found 2026-12-07 by a scan of ATen's ops given a working copy beside an fp32 tensor: a
    // grid of a parameter and fp32 coordinates (meshgrid, cartesian_prod), and linalg.vecdot,
    // which torch's lists lower (dot and vdot, its relatives, are Apex's promote rows).
    {"aten::meshgrid", ""},
    {"aten::meshgrid", "indexing"},
    {"aten::linalg_vecdot", ""},
};

// match self: in place (and out of place, for the same call written either way), the source must
// have self's dtype.
constexpr OpName kMatchSelfOps[] = {
    {"aten::index_add_", ""},
    {"aten::index_add", ""},
    {"aten::index_copy_", ""},
    {"aten::index_copy", ""},  // out of place too: found 2026-12-07 (an fp32 self, a working copy)
    {"aten::index_put_", ""},
    {"aten::scatter_", "src"},
    {"aten::scatter", "src"},
    {"aten::scatter_", "reduce"},
    {"aten::scatter", "reduce"},
    {"aten::scatter_add_", ""},
    {"aten::scatter_add", ""},
    {"aten::scatter_reduce_", "two"},
    {"aten::scatter_reduce", "two"},
    {"aten::masked_scatter_", ""},
    {"aten::masked_scatter", ""},
    {"aten::index_reduce_", ""},
    {"aten::index_reduce", ""},
    {"aten::put_", ""},
    {"aten::put", ""},
    // optamp's, with lerp's promote rows: an fp32 average moved towards a reduced value in place
    // (`ema.lerp_(x, 0.1)`), which torch refuses ("expected dtype float for `end`").
    {"aten::lerp_", "Scalar"},
    {"aten::lerp_", "Tensor"},
};

// The promote ops that do the promotion themselves, bit for bit as a cast would, gradients included
// (checked per op by tests/python/test_casting.py; atan2 is not: its backward computes in the
// inputs' own dtypes): a cast first only adds an op and an autograd node per call.
constexpr OpName kNativelyPromotingOps[] = {
    {"aten::add", "Tensor"}, {"aten::sub", "Tensor"}, {"aten::mul", "Tensor"},
    {"aten::div", "Tensor"}, {"aten::eq", "Tensor"},  {"aten::ne", "Tensor"},
    {"aten::lt", "Tensor"},  {"aten::le", "Tensor"},  {"aten::gt", "Tensor"},
    {"aten::ge", "Tensor"},  {"aten::cat", ""},       {"aten::stack", ""},
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
     "sigmoid and is safe, or register it as an fp32 op, which runs it in fp32 at every level "
     "(C++: amp::register_float_op(\"aten::binary_cross_entropy\"); Python: "
     "amp.register_float_op(\"aten::binary_cross_entropy\") or "
     "amp.register_float_function(torch.nn.functional, \"binary_cross_entropy\")). "
     "(Refused at O1/O4 and in amp::autocast regions, as Apex's O1 did; at O2/O5 it runs "
     "as an fp32 loss, and at O0/O3 it is not cast.)"},
};

// ---- torch.autocast's lists -------------------------------------------------------------------
// One row per `_(op)` / `_(op, overload)` of ATen's AT_FORALL_* list macros.
#define OPTAMP_TORCH_OP1(op) {"aten::" #op, ""},
#define OPTAMP_TORCH_OP2(op, overload) {"aten::" #op, #overload},
#define OPTAMP_PICK_BY_ARITY(_1, _2, NAME, ...) NAME
#define OPTAMP_TORCH_OP(...) \
  OPTAMP_PICK_BY_ARITY(__VA_ARGS__, OPTAMP_TORCH_OP2, OPTAMP_TORCH_OP1)(__VA_ARGS__)

// AutocastCUDA (and XPU): lower_precision_fp, plus the cuDNN convolutions it adds by hand.
// clang-format off
constexpr OpName kTorchOtherLowerOps[] = {
    AT_FORALL_LOWER_PRECISION_FP(OPTAMP_TORCH_OP)
    {"aten::cudnn_convolution", ""},
    {"aten::cudnn_convolution_transpose", ""},
    // AutocastCUDA's RNN kernel (registered by LibTorch's CUDA library, not by the list macros)
    // runs cuDNN RNN layers on fp16 inputs and weights.
    {"aten::_cudnn_rnn", ""},
};
// fp32, fp32_set_opt_dtype, and fp32_append_dtype (the norm overloads it redispatches with an
// fp32 dtype): all three compute in fp32.
constexpr OpName kTorchOtherFp32Ops[] = {
    AT_FORALL_FP32(OPTAMP_TORCH_OP)
    AT_FORALL_FP32_SET_OPT_DTYPE(OPTAMP_TORCH_OP)
    {"aten::norm", "Scalar"},
    {"aten::norm", "ScalarOpt_dim"},
    {"aten::norm", "names_ScalarOpt_dim"},
};
// clang-format on
constexpr OpName kTorchOtherPromoteOps[] = {AT_FORALL_PROMOTE(OPTAMP_TORCH_OP)};

#undef OPTAMP_TORCH_OP
#undef OPTAMP_PICK_BY_ARITY
#undef OPTAMP_TORCH_OP2
#undef OPTAMP_TORCH_OP1

// AutocastCPU (torch 2.11's aten/src/ATen/autocast_mode.cpp).
constexpr OpName kTorchCpuLowerOps[] = {
    {"aten::conv1d", ""},
    {"aten::conv1d", "padding"},
    {"aten::conv2d", ""},
    {"aten::conv2d", "padding"},
    {"aten::conv3d", ""},
    {"aten::conv3d", "padding"},
    {"aten::bmm", ""},
    {"aten::mm", ""},
    {"aten::linalg_vecdot", ""},
    {"aten::baddbmm", ""},
    {"aten::addmm", ""},
    {"aten::_addmm_activation", ""},
    {"aten::addbmm", ""},
    {"aten::linear", ""},
    {"aten::_convolution", "deprecated"},
    {"aten::matmul", ""},
    {"aten::conv_tbc", ""},
    {"aten::mkldnn_rnn_layer", ""},
    {"aten::conv_transpose1d", ""},
    {"aten::conv_transpose2d", "input"},
    {"aten::conv_transpose3d", "input"},
    {"aten::prelu", ""},
    {"aten::scaled_dot_product_attention", ""},
    {"aten::_native_multi_head_attention", ""},
};

constexpr OpName kTorchCpuFp32Ops[] = {
    {"aten::avg_pool3d", ""},
    {"aten::binary_cross_entropy", ""},
    {"aten::grid_sampler", ""},
    {"aten::polar", ""},
    {"aten::prod", ""},
    {"aten::prod", "dim_int"},
    {"aten::prod", "dim_Dimname"},
    {"aten::quantile", ""},
    {"aten::quantile", "scalar"},
    {"aten::nanquantile", ""},
    {"aten::nanquantile", "scalar"},
    {"aten::stft", ""},
    {"aten::stft", "center"},
    {"aten::cdist", ""},
    {"aten::grid_sampler_2d", ""},
    {"aten::_grid_sampler_2d_cpu_fallback", ""},
    {"aten::grid_sampler_3d", ""},
    {"aten::trace", ""},
    {"aten::view_as_complex", ""},
    {"aten::cholesky", ""},
    {"aten::cholesky_inverse", ""},
    {"aten::cholesky_solve", ""},
    {"aten::inverse", ""},
    {"aten::lu_solve", ""},
    {"aten::orgqr", ""},
    {"aten::ormqr", ""},
    {"aten::pinverse", ""},
    {"aten::max_pool3d", ""},
    {"aten::max_unpool2d", ""},
    {"aten::max_unpool3d", ""},
    {"aten::adaptive_avg_pool3d", ""},
    {"aten::reflection_pad1d", ""},
    {"aten::reflection_pad2d", ""},
    {"aten::replication_pad1d", ""},
    {"aten::replication_pad2d", ""},
    {"aten::replication_pad3d", ""},
    {"aten::mse_loss", ""},
    {"aten::cosine_embedding_loss", ""},
    {"aten::nll_loss", ""},
    {"aten::nll_loss2d", ""},
    {"aten::hinge_embedding_loss", ""},
    {"aten::poisson_nll_loss", ""},
    {"aten::smooth_l1_loss", ""},
    {"aten::cross_entropy_loss", ""},
    {"aten::l1_loss", ""},
    {"aten::huber_loss", ""},
    {"aten::margin_ranking_loss", ""},
    {"aten::soft_margin_loss", ""},
    {"aten::triplet_margin_loss", ""},
    {"aten::multi_margin_loss", ""},
    {"aten::ctc_loss", "IntList"},
    {"aten::ctc_loss", "Tensor"},
    {"aten::kl_div", ""},
    {"aten::multilabel_margin_loss", ""},
    {"aten::binary_cross_entropy_with_logits", ""},
    {"aten::fft_fft", ""},
    {"aten::fft_ifft", ""},
    {"aten::fft_fft2", ""},
    {"aten::fft_ifft2", ""},
    {"aten::fft_fftn", ""},
    {"aten::fft_ifftn", ""},
    {"aten::fft_rfft", ""},
    {"aten::fft_irfft", ""},
    {"aten::fft_rfft2", ""},
    {"aten::fft_irfft2", ""},
    {"aten::fft_rfftn", ""},
    {"aten::fft_irfftn", ""},
    {"aten::fft_hfft", ""},
    {"aten::fft_ihfft", ""},
    {"aten::linalg_cond", ""},
    {"aten::linalg_cond", "p_str"},
    {"aten::linalg_matrix_rank", ""},
    {"aten::linalg_matrix_rank", "tol_tensor"},
    {"aten::linalg_matrix_rank", "atol_rtol_tensor"},
    {"aten::linalg_matrix_rank", "atol_rtol_float"},
    {"aten::linalg_solve", ""},
    {"aten::linalg_cholesky", ""},
    {"aten::linalg_svdvals", ""},
    {"aten::linalg_eigvals", ""},
    {"aten::linalg_eigvalsh", ""},
    {"aten::linalg_inv", ""},
    {"aten::linalg_householder_product", ""},
    {"aten::linalg_tensorinv", ""},
    {"aten::linalg_tensorsolve", ""},
    {"aten::fake_quantize_per_tensor_affine", ""},
    {"aten::geqrf", ""},
    {"aten::_lu_with_info", ""},
    {"aten::qr", ""},
    {"aten::svd", ""},
    {"aten::triangular_solve", ""},
    {"aten::fractional_max_pool2d", ""},
    {"aten::fractional_max_pool3d", ""},
    {"aten::adaptive_max_pool3d", ""},
    {"aten::multilabel_margin_loss_forward", ""},
    {"aten::linalg_qr", ""},
    {"aten::linalg_cholesky_ex", ""},
    {"aten::linalg_svd", ""},
    {"aten::linalg_eig", ""},
    {"aten::linalg_eigh", ""},
    {"aten::linalg_lstsq", ""},
    {"aten::linalg_inv_ex", ""},
};

constexpr OpName kTorchCpuPromoteOps[] = {
    {"aten::stack", ""},
    {"aten::cat", ""},
    {"aten::index_copy", ""},
    {"aten::index_copy", "dimname"},
};

// Losses and softmaxes: the base names of Apex's fp32 (loss) rows, and the two loss kernels only
// torch lists. In torch's tables they become fp32 (loss), which O2/O5 apply too.
bool is_loss_or_softmax(std::string_view name) {
  if (name == "aten::binary_cross_entropy" || name == "aten::multilabel_margin_loss_forward") {
    return true;
  }
  for (const OpName& op : kFp32LossOps) {
    if (name == op.name) return true;
  }
  return false;
}

template <std::size_t N>
void append(std::vector<TableEntry>& table, const OpName (&ops)[N], CastPolicy policy) {
  for (const OpName& op : ops) table.push_back({op.name, op.overload, policy, nullptr});
}

template <std::size_t N>
bool contains(const OpName (&ops)[N], const OpName& op) {
  return std::any_of(std::begin(ops), std::end(ops), [&op](const OpName& listed) {
    return std::string_view(listed.name) == op.name &&
           std::string_view(listed.overload) == op.overload;
  });
}

// torch's fp32 rows: fp32 (loss) for losses and softmaxes, fp32 (always) for the ops without
// fp16/bf16 kernels, fp32 otherwise; then those of them torch does not list (most, on CUDA).
template <std::size_t N>
void append_torch_fp32(std::vector<TableEntry>& table, const OpName (&ops)[N]) {
  for (const OpName& op : ops) {
    const CastPolicy policy = is_loss_or_softmax(op.name)    ? CastPolicy::kFp32Loss
                              : contains(kFp32AlwaysOps, op) ? CastPolicy::kFp32Always
                                                             : CastPolicy::kFp32;
    table.push_back({op.name, op.overload, policy, nullptr});
  }
  for (const OpName& op : kFp32AlwaysOps) {
    if (!contains(ops, op))
      table.push_back({op.name, op.overload, CastPolicy::kFp32Always, nullptr});
  }
}

std::vector<TableEntry> make_apex_table() {
  std::vector<TableEntry> t;
  append(t, kLowerOps, CastPolicy::kLower);
  append(t, kFp32Ops, CastPolicy::kFp32);
  append(t, kFp32LossOps, CastPolicy::kFp32Loss);
  append(t, kFp32AlwaysOps, CastPolicy::kFp32Always);
  append(t, kPromoteOps, CastPolicy::kPromote);
  for (const BannedOp& b : kBannedOps) {
    t.push_back({b.op.name, b.op.overload, CastPolicy::kBanned, b.message});
  }
  return t;
}

// A table for CPU tensors: the CPU-only fp32 (always) ops replace their rows or join.
std::vector<TableEntry> with_cpu_fp32_always(std::vector<TableEntry> t) {
  for (const OpName& op : kCpuFp32AlwaysOps) {
    const auto row = std::find_if(t.begin(), t.end(), [&op](const TableEntry& e) {
      return std::string_view(e.name) == op.name && std::string_view(e.overload) == op.overload;
    });
    if (row != t.end()) {
      row->policy = CastPolicy::kFp32Always;
    } else {
      t.push_back({op.name, op.overload, CastPolicy::kFp32Always, nullptr});
    }
  }
  return t;
}

std::vector<TableEntry> make_torch_cpu_table() {
  std::vector<TableEntry> t;
  append(t, kTorchCpuLowerOps, CastPolicy::kLower);
  append_torch_fp32(t, kTorchCpuFp32Ops);
  append(t, kTorchCpuPromoteOps, CastPolicy::kPromote);
  return with_cpu_fp32_always(std::move(t));
}

std::vector<TableEntry> make_torch_other_table() {
  std::vector<TableEntry> t;
  append(t, kTorchOtherLowerOps, CastPolicy::kLower);
  append_torch_fp32(t, kTorchOtherFp32Ops);
  append(t, kTorchOtherPromoteOps, CastPolicy::kPromote);
  // Banned by AutocastCUDA too; Apex's message says what to use instead.
  for (const BannedOp& b : kBannedOps) {
    t.push_back({b.op.name, b.op.overload, CastPolicy::kBanned, b.message});
  }
  return t;
}

}  // namespace

ListSet list_set_for(OpLists lists, c10::DeviceType device) {
  const bool cpu = device == c10::DeviceType::CPU;
  if (lists == OpLists::kApex) return cpu ? ListSet::kApexCpu : ListSet::kApex;
  return cpu ? ListSet::kTorchCpu : ListSet::kTorchOther;
}

const std::vector<TableEntry>& table_of(ListSet set) {
  static const std::vector<TableEntry> tables[kNumListSets] = {
      make_apex_table(), make_torch_cpu_table(), make_torch_other_table(),
      with_cpu_fp32_always(make_apex_table())};
  return tables[static_cast<int>(set)];
}

const std::vector<TableEntry>& builtin_table() { return table_of(ListSet::kApex); }

const std::vector<TableEntry>& match_self_ops() {
  static const std::vector<TableEntry> ops = [] {
    std::vector<TableEntry> t;
    append(t, kMatchSelfOps, CastPolicy::kMatchSelf);
    return t;
  }();
  return ops;
}

bool promotes_natively(const char* name, const char* overload) {
  for (const auto& op : kNativelyPromotingOps) {
    if (std::strcmp(op.name, name) == 0 && std::strcmp(op.overload, overload) == 0) return true;
  }
  return false;
}

}  // namespace amp::detail
