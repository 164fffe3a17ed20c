// amp::PrecisionProbe: dtypes per level, counts, nested ops, overflow and flush statistics, the
// first inf/NaN forward and backward (with the forward's scope), the callback gone when no probe
// records, bit-identical training with a probe, threads, the text forms and the errors.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <limits>
#include <optional>
#include <thread>

#include "diagnostics/value_stats.h"
#include "optamp/amp.h"
#include "optamp/core.h"
#include "test_util.h"

namespace amp {
namespace {

using Phase = PrecisionProbe::Phase;
using Row = PrecisionProbe::Row;

// One linear layer on raw tensors (no nn headers: they compile slowly).
struct Layer {
  at::Tensor w, b;
  Layer(int in, int out, double scale = 0.3, int seed = 0) {
    at::manual_seed(seed);
    w = (at::randn({out, in}) * scale).requires_grad_();
    b = at::zeros({out}).requires_grad_();
  }
  at::Tensor operator()(const at::Tensor& x) const { return at::linear(x, w, b); }
  std::vector<at::Tensor> params() const { return {w, b}; }
};

class PrecisionProbeTest : public ::testing::Test {
 protected:
  void init(OptLevel level, const std::vector<at::Tensor>& params) {
    core::ModelTensors model;
    model.reduced = params;
    model.parameters = params;
    core::initialize(model, {}, level, testing::quiet());
  }
  void TearDown() override { core::reset(); }
};

// The row of `op` in `scope` and `phase` (any node), or nullptr.
const Row* find_row(const PrecisionProbe::Report& report, const std::string& op,
                    const std::string& scope = "", Phase phase = Phase::kForward) {
  for (const auto& row : report.rows) {
    if (row.op == op && row.scope == scope && row.phase == phase) return &row;
  }
  return nullptr;
}

std::vector<c10::ScalarType> dtypes_of(const Row& row) {
  std::vector<c10::ScalarType> out;
  for (const auto& d : row.dtypes) out.push_back(d.dtype);
  return out;
}

TEST_F(PrecisionProbeTest, O1RunsLinearInFloat16AndSoftmaxInFloat32) {
  Layer layer(8, 4);
  init(OptLevel::O1, layer.params());
  PrecisionProbe probe;
  at::softmax(layer(at::randn({3, 8})), 1);
  probe.stop();
  const auto report = probe.report();
  const Row* linear = find_row(report, "aten::linear");
  const Row* softmax = find_row(report, "aten::softmax.int");
  ASSERT_NE(linear, nullptr) << probe.table();
  ASSERT_NE(softmax, nullptr) << probe.table();
  EXPECT_EQ(dtypes_of(*linear), std::vector<c10::ScalarType>{at::kHalf});
  EXPECT_EQ(dtypes_of(*softmax), std::vector<c10::ScalarType>{at::kFloat});
  EXPECT_EQ(linear->calls, 1);
  EXPECT_EQ(linear->elements, 12);
  EXPECT_LT(linear->first_call, softmax->first_call);
}

TEST_F(PrecisionProbeTest, O4RunsLinearInBfloat16AndO0InFloat32) {
  Layer layer(8, 4);
  init(OptLevel::O4, layer.params());
  {
    PrecisionProbe probe;
    layer(at::randn({3, 8}));
    const auto report = probe.report();
    const Row* linear = find_row(report, "aten::linear");
    ASSERT_NE(linear, nullptr);
    EXPECT_EQ(dtypes_of(*linear), std::vector<c10::ScalarType>{at::kBFloat16});
  }
  core::reset();
  init(OptLevel::O0, layer.params());
  PrecisionProbe probe;
  layer(at::randn({3, 8}));
  const auto report = probe.report();
  const Row* linear = find_row(report, "aten::linear");
  ASSERT_NE(linear, nullptr);
  EXPECT_EQ(dtypes_of(*linear), std::vector<c10::ScalarType>{at::kFloat});
}

TEST_F(PrecisionProbeTest, CountsCallsAndRecordsNestedOpsInTheirScope) {
  Layer layer(8, 4);
  init(OptLevel::O1, layer.params());
  PrecisionProbe probe;
  {
    PrecisionProbe::Scope scope("encoder.fc");
    for (int i = 0; i < 3; ++i) layer(at::randn({2, 8}));
  }
  at::randn({2}).exp();
  probe.stop();
  const auto report = probe.report();
  const Row* linear = find_row(report, "aten::linear", "encoder.fc");
  const Row* addmm = find_row(report, "aten::addmm", "encoder.fc");  // linear's inner call
  ASSERT_NE(linear, nullptr) << probe.table();
  ASSERT_NE(addmm, nullptr) << probe.table();
  EXPECT_EQ(linear->calls, 3);
  EXPECT_EQ(addmm->calls, 3);
  EXPECT_LT(linear->first_call, addmm->first_call) << "the outer call starts first";
  EXPECT_NE(find_row(report, "aten::exp"), nullptr) << "outside the scope: no scope";
  EXPECT_EQ(find_row(report, "aten::exp", "encoder.fc"), nullptr);
  for (std::size_t i = 1; i < report.rows.size(); ++i) {
    EXPECT_LT(report.rows[i - 1].first_call, report.rows[i].first_call) << "sorted by first call";
  }
}

// CPU mean of fp16 converts its result, allocated but not yet written, to fp32 and sums into
// that: the probe measured the conversion of whatever memory held (NaN from the freed tensors)
// and named a copy_ as the first inf/NaN.
TEST_F(PrecisionProbeTest, AKernelsCastOfMemoryItHasNotWrittenIsNotMeasured) {
  Layer layer(8, 4);
  init(OptLevel::O2, layer.params());
  const auto x = at::randn({2, 384}).to(at::kHalf);
  PrecisionProbe probe;
  at::Tensor mean;
  for (int i = 0; i < 50; ++i) {
    std::vector<at::Tensor> freed;
    for (int k = 0; k < 4; ++k) freed.push_back(at::full({768}, NAN));
    freed.clear();
    mean = x.mean(0);
  }
  probe.stop();
  const auto report = probe.report();
  EXPECT_TRUE(at::isfinite(mean).all().item<bool>());
  for (const auto& row : report.rows) {
    if (row.op != "aten::full" && row.op != "aten::fill_.Scalar") {
      EXPECT_EQ(row.nonfinite, 0) << row.op << "\n" << probe.table(60);
    }
  }
  const Row* sum = find_row(report, "aten::sum.IntList_out");
  ASSERT_NE(sum, nullptr) << probe.table(60);
  EXPECT_EQ(sum->elements, 50 * 384) << "what the kernel wrote is still measured";
}

TEST_F(PrecisionProbeTest, Float16OverflowInForwardNamesTheInnermostOpAndItsScope) {
  Layer big(16, 4, 1.0);
  {
    at::NoGradGuard no_grad;
    big.w.fill_(1000.0);
  }
  init(OptLevel::O1, big.params());
  PrecisionProbe probe;
  {
    PrecisionProbe::Scope scope("big");
    big(at::full({2, 16}, 100.0));  // 16 * 100 * 1000 = 1.6e6 > 65504
  }
  probe.stop();
  const auto first = probe.first_nonfinite();
  ASSERT_TRUE(first.has_value()) << probe.table();
  EXPECT_EQ(first->op, "aten::addmm") << "the innermost op ends first";
  EXPECT_EQ(first->phase, Phase::kForward);
  EXPECT_EQ(first->scope, "big");
  EXPECT_EQ(first->dtype, at::kHalf);
  EXPECT_EQ(first->count, 8);
  const auto report = probe.report();
  const Row* linear = find_row(report, "aten::linear", "big");
  ASSERT_NE(linear, nullptr);
  EXPECT_EQ(linear->nonfinite, 8);
  EXPECT_EQ(linear->fp16_overflow, 0) << "already float16: the overflow shows as non-finite";
}

// A causal mask's -inf (filled from a scalar, cast, added to the scores) is carried, not made: the
// first inf/NaN is the backward overflow after it. Before, every model with an additive -inf
// mask (torch.nn.Transformer's generate_square_subsequent_mask, open_clip's text tower) was
// reported at the mask's fill_.
TEST_F(PrecisionProbeTest, AnAttentionMasksInfinityIsCarriedAndTheOverflowAfterItIsNamed) {
  Layer query(8, 8, 1.0);
  init(OptLevel::O1, query.params());
  const double inf = std::numeric_limits<double>::infinity();
  const auto x = at::full({4, 8}, 1e-3).requires_grad_();
  PrecisionProbe probe;
  at::Tensor out;
  {
    PrecisionProbe::Scope scope("attention");
    const auto mask = at::full({4, 4}, -inf).triu(1);
    const auto q = query(x);
    const auto scores = at::matmul(q, q.t()) + mask.to(q.scalar_type());
    out = at::matmul(at::softmax(scores, 1), q);
  }
  (out.to(at::kFloat).sum() * 1e9).backward();  // its float16 gradient overflows
  probe.stop();
  const auto first = probe.first_nonfinite();
  ASSERT_TRUE(first.has_value()) << probe.table(80);
  EXPECT_EQ(first->phase, Phase::kBackward) << probe.table(80);
  EXPECT_FALSE(first->from_inputs);
  const auto report = probe.report();
  const Row* fill = find_row(report, "aten::fill_.Scalar", "attention");
  ASSERT_NE(fill, nullptr) << probe.table(80);
  EXPECT_EQ(fill->nonfinite, 16) << "still counted in its row";
}

// NaN made from infinities is made: a softmax over a row that is all -inf.
TEST_F(PrecisionProbeTest, ANaNMadeFromInfinitiesIsNamed) {
  const double inf = std::numeric_limits<double>::infinity();
  PrecisionProbe probe;
  const auto scores = at::zeros({2, 3}).index_fill(0, at::tensor({int64_t{1}}), -inf);
  at::softmax(scores, 1);
  probe.stop();
  const auto first = probe.first_nonfinite();
  ASSERT_TRUE(first.has_value()) << probe.table();
  EXPECT_EQ(first->op, "aten::_softmax") << probe.table();
  EXPECT_FALSE(first->from_inputs);
  EXPECT_EQ(first->count, 3);
}

// Values from outside the recorded ops: no op made them, so the first op that saw them is named,
// marked as having had them in its inputs; an in-place op on a tensor the probe saw holding
// them does not make them either.
TEST_F(PrecisionProbeTest, ValuesFromOutsideAreNamedWhereFirstSeenAsFromTheInputs) {
  Layer layer(4, 2, 1.0);
  init(OptLevel::O0, layer.params());
  auto batch = at::ones({3, 4});
  batch[1][2] = std::numeric_limits<double>::quiet_NaN();  // a corrupt batch
  PrecisionProbe probe;
  {
    PrecisionProbe::Scope scope("layer");
    const auto y = layer(batch);
    y.mul_(2);
  }
  probe.stop();
  const auto first = probe.first_nonfinite();
  ASSERT_TRUE(first.has_value()) << probe.table();
  EXPECT_TRUE(first->from_inputs) << probe.table();
  EXPECT_EQ(first->scope, "layer");
  EXPECT_EQ(first->op, "aten::addmm") << probe.table();
  EXPECT_NE(probe.table().find("no op made one: its inputs held them already"), std::string::npos);
  EXPECT_NE(probe.json().find("\"from_inputs\": true"), std::string::npos);
}

TEST_F(PrecisionProbeTest, Float32OutputsReportWhatFloat16AndBfloat16WouldLose) {
  Layer layer(16, 4, 1.0);
  init(OptLevel::O0, layer.params());
  {
    at::NoGradGuard no_grad;
    layer.w.fill_(1000.0);
  }
  PrecisionProbe probe;
  {
    PrecisionProbe::Scope scope("over");
    layer(at::full({2, 16}, 100.0));  // 1.6e6: finite in float32 and bfloat16, inf in float16
  }
  {
    PrecisionProbe::Scope scope("flush");
    layer(at::full({2, 16}, 1e-12));  // 1.6e-8: below float16's smallest subnormal / 2
  }
  probe.stop();
  const auto report = probe.report();
  const Row* over = find_row(report, "aten::linear", "over");
  const Row* flush = find_row(report, "aten::linear", "flush");
  ASSERT_NE(over, nullptr);
  ASSERT_NE(flush, nullptr);
  EXPECT_EQ(over->fp16_overflow, 8);
  EXPECT_DOUBLE_EQ(over->fraction(over->fp16_overflow), 1.0);
  EXPECT_EQ(over->bf16_overflow, 0);
  EXPECT_EQ(over->fp16_flush, 0);
  EXPECT_FLOAT_EQ(static_cast<float>(over->max_abs), 1.6e6f);
  EXPECT_EQ(flush->fp16_flush, 8);
  EXPECT_EQ(flush->bf16_flush, 0);
  EXPECT_EQ(flush->nonfinite, 0);
  EXPECT_FALSE(probe.first_nonfinite().has_value()) << "nothing overflowed in float32";
}

// Values at and next to each threshold, both signs, zeros, subnormals, inf and NaN.
at::Tensor boundary_values(c10::ScalarType dtype) {
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> v{0.0,      1.0,      65504.0,       65519.0,      65520.0,    65536.0,
                        1e5,      0x1p-24,  0x1p-25,       0x1.0001p-25, 0x1p-26,    1e-30,
                        0x1p-133, 0x1p-134, 0x1.0001p-134, 0x1p-140,     0x1.fep127, 0x1.ffp127,
                        3.4e38,   inf,      std::nan("")};
  const auto n = v.size();
  for (std::size_t i = 0; i < n; ++i) v.push_back(-v[i]);
  return at::tensor(v, at::kDouble).to(dtype);
}

// What torch's own casts do to `t`: finite values that become inf, nonzero values that become 0.
std::pair<std::int64_t, std::int64_t> cast_losses(const at::Tensor& t, c10::ScalarType low) {
  const auto cast = t.to(at::kFloat).to(low);  // torch casts float64 through float32 too
  return {at::logical_and(t.isfinite(), cast.isinf()).sum().item<std::int64_t>(),
          at::logical_and(t.ne(0), cast.eq(0)).sum().item<std::int64_t>()};
}

TEST_F(PrecisionProbeTest, ThresholdsCountExactlyWhatTorchsCastsLose) {
  for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    const auto t = boundary_values(dtype);
    const auto [fp16_over, fp16_flush] = cast_losses(t, at::kHalf);
    const auto [bf16_over, bf16_flush] = cast_losses(t, at::kBFloat16);
    for (const auto& s : {detail::value_stats(t), detail::value_stats_by_reductions(t)}) {
      EXPECT_EQ(s.fp16_overflow, fp16_over) << dtype;
      EXPECT_EQ(s.fp16_flush, fp16_flush) << dtype;
      EXPECT_EQ(s.bf16_overflow, bf16_over) << dtype;
      EXPECT_EQ(s.bf16_flush, bf16_flush) << dtype;
      EXPECT_EQ(s.nonfinite, t.isfinite().logical_not().sum().item<std::int64_t>()) << dtype;
      EXPECT_EQ(s.nan, t.isnan().sum().item<std::int64_t>()) << dtype;
      const auto finite_abs = at::where(t.isfinite(), t.abs(), 0).to(at::kDouble);
      EXPECT_EQ(s.max_abs, finite_abs.max().item<double>()) << dtype;
      EXPECT_EQ(s.elements, t.numel());
    }
  }
  EXPECT_GT(cast_losses(boundary_values(at::kFloat), at::kHalf).first, 0) << "the data reach it";
  EXPECT_GT(cast_losses(boundary_values(at::kFloat), at::kBFloat16).second, 0);
}

TEST_F(PrecisionProbeTest, O1ReportsTheFlushWhereTheInputIsCastToFloat16) {
  Layer layer(16, 4, 1.0);
  init(OptLevel::O1, layer.params());
  PrecisionProbe probe;
  {
    PrecisionProbe::Scope scope("tiny");
    layer(at::full({2, 16}, 1e-9));  // the cast of x to float16 flushes every value
  }
  {
    PrecisionProbe::Scope scope("normal");
    layer(at::full({2, 16}, 0.5));
  }
  probe.stop();
  const auto report = probe.report();
  const Row* cast = find_row(report, "aten::_to_copy", "tiny");
  ASSERT_NE(cast, nullptr) << probe.table();
  EXPECT_GE(cast->fp16_flush, 32) << probe.table();
  const Row* normal = find_row(report, "aten::_to_copy", "normal");
  ASSERT_NE(normal, nullptr);
  EXPECT_EQ(normal->fp16_flush, 0);
}

TEST_F(PrecisionProbeTest, BackwardOverflowNamesTheNodeAndTheForwardScope) {
  Layer layer(16, 16, 1.0);
  {
    at::NoGradGuard no_grad;
    layer.w.fill_(300.0);
  }
  init(OptLevel::O1, layer.params());
  const auto x = at::full({2, 16}, 1e-3).requires_grad_();
  PrecisionProbe probe;
  at::Tensor out;
  {
    PrecisionProbe::Scope scope("amplifier");
    out = layer(x);  // 4.8: finite
  }
  // A large loss scale: the float16 gradient of x, 1e4 * 300 * 16, overflows.
  (out.to(at::kFloat).sum() * 1e4).backward();
  probe.stop();
  const auto first = probe.first_nonfinite();
  ASSERT_TRUE(first.has_value()) << probe.table();
  EXPECT_EQ(first->phase, Phase::kBackward) << probe.table();
  EXPECT_EQ(first->scope, "amplifier") << probe.table();
  EXPECT_EQ(first->node, "AddmmBackward0") << probe.table();
  EXPECT_EQ(first->op, "aten::mm") << probe.table();
  EXPECT_EQ(first->dtype, at::kHalf);
  const auto report = probe.report();
  const Row* forward = find_row(report, "aten::linear", "amplifier");
  ASSERT_NE(forward, nullptr);
  EXPECT_EQ(forward->nonfinite, 0) << "forward was finite";
}

TEST_F(PrecisionProbeTest, StoppedProbeRemovesItsCallbackAndRecordsNothingMore) {
  ASSERT_FALSE(at::hasGlobalCallbacks());
  PrecisionProbe probe;
  EXPECT_TRUE(at::hasGlobalCallbacks());
  EXPECT_TRUE(probe.recording());
  at::randn({4}).exp();
  probe.stop();
  EXPECT_FALSE(at::hasGlobalCallbacks());
  EXPECT_FALSE(probe.recording());
  const auto calls = probe.report().calls;
  at::randn({4}).exp();
  EXPECT_EQ(probe.report().calls, calls);
  probe.stop();  // idempotent
  {
    PrecisionProbe scoped;
    EXPECT_TRUE(at::hasGlobalCallbacks());
  }
  EXPECT_FALSE(at::hasGlobalCallbacks()) << "the destructor stops it";
}

// Three SGD steps at `level` (with a probe or not): the parameters after them.
std::vector<at::Tensor> train(OptLevel level, bool probe) {
  Layer l1(8, 16, 0.3, 1), l2(16, 4, 0.3, 2);
  std::vector<at::Tensor> params{l1.w, l1.b, l2.w, l2.b};
  core::ModelTensors model;
  model.reduced = model.parameters = params;
  core::initialize(model, {}, level, testing::quiet());
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.1).momentum(0.9));
  std::optional<PrecisionProbe> recorder;
  if (probe) recorder.emplace("train");
  for (int step = 0; step < 3; ++step) {
    at::manual_seed(100 + step);
    const auto x = at::randn({5, 8});
    opt.zero_grad();
    auto loss = at::softmax(l2(at::gelu(l1(x))), 1).pow(2).mean();
    loss.backward();
    opt.step();
  }
  if (recorder) EXPECT_GT(recorder->report().rows.size(), 10u);
  core::reset();
  for (auto& p : params) p = p.detach().clone();
  return params;
}

TEST_F(PrecisionProbeTest, TrainingIsBitIdenticalWithAndWithoutAProbe) {
  for (OptLevel level : {OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O4}) {
    const auto plain = train(level, false);
    const auto probed = train(level, true);
    for (std::size_t i = 0; i < plain.size(); ++i) {
      EXPECT_TRUE(at::equal(plain[i], probed[i])) << "level " << static_cast<int>(level);
    }
  }
}

TEST_F(PrecisionProbeTest, OpsFromSeveralThreadsAreAllCounted) {
  PrecisionProbe probe;
  auto work = [] {
    const auto x = at::randn({8});
    for (int i = 0; i < 50; ++i) x.mul(1.5);
  };
  std::thread a(work), b(work);
  a.join();
  b.join();
  probe.stop();
  const auto report = probe.report();
  const Row* mul = find_row(report, "aten::mul.Scalar");
  ASSERT_NE(mul, nullptr);
  EXPECT_EQ(mul->calls, 100);
}

TEST_F(PrecisionProbeTest, SecondProbeIsAnErrorNamingTheFirst) {
  PrecisionProbe first("warmup steps");
  OPTAMP_EXPECT_THROW_WITH(PrecisionProbe second("second"), c10::Error, "one probe records",
                           "\"warmup steps\"", "\"second\"");
  EXPECT_TRUE(first.recording()) << "the failed one left the first alone";
  first.stop();
  PrecisionProbe third;  // fine once the first stopped
  EXPECT_TRUE(third.recording());
}

TEST_F(PrecisionProbeTest, TableAndJsonNameEveryColumn) {
  PrecisionProbe probe;
  {
    PrecisionProbe::Scope scope("a|b");
    (at::ones({4}) * 1e6).exp();  // inf
  }
  probe.stop();
  const std::string table = probe.table();
  for (const char* column : {"| op | scope | phase | dtypes | calls | max\\|x\\| |",
                             "fp16 overflow %", "fp16 flush %", "bf16 overflow %", "bf16 flush %",
                             "non-finite |", "a\\|b", "First inf/NaN: aten::exp, forward"}) {
    EXPECT_NE(table.find(column), std::string::npos) << column << " in\n" << table;
  }
  const std::string json = probe.json();
  for (const char* key : {"\"rows\": [", "\"op\": \"aten::exp\"", "\"scope\": \"a|b\"",
                          "\"fp16_overflow_fraction\"", "\"first_nonfinite\": {"}) {
    EXPECT_NE(json.find(key), std::string::npos) << key << " in " << json;
  }
  const std::string short_table = probe.table(1);
  EXPECT_NE(short_table.find("aten::exp"), std::string::npos) << "the troubled row is kept";
  EXPECT_NE(short_table.find("more rows"), std::string::npos);
  OPTAMP_EXPECT_THROW_WITH(probe.table(0), c10::ValueError, "max_rows", ">= 1", "got 0");
}

}  // namespace
}  // namespace amp
