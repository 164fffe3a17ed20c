// amp::PrecisionProbe (optamp/precision_probe.h, docs/precision.md): two global
// at::RecordFunction callbacks, one on ATen ops (inputs and outputs) and one on autograd nodes
// (the backward phase), installed while a probe records and removed with it.
#include "optamp/precision_probe.h"

#include <ATen/ATen.h>
#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "diagnostics/precision_format.h"
#include "diagnostics/value_stats.h"
#include "dispatch/carried_state.h"
#include "dispatch/substitution.h"
#include "ops/stream_capture.h"

namespace amp {

using detail::value_stats;
using detail::ValueStats;
using Phase = PrecisionProbe::Phase;

namespace {

// An autograd node running on this thread: its name and the scope its forward op ran in.
struct NodeFrame {
  std::string name;
  std::string scope;
  int graph_task = -1;  // the backward pass it ran in
};

// Per thread: the Scope names pushed, the backward nodes running, and whether the probe is
// measuring (its own ATen calls must not be observed).
struct ThreadFrames {
  std::vector<std::string> scopes;
  std::vector<NodeFrame> nodes;
  // The node that ended last: the engine's work right after it (reducing a gradient to its
  // input's shape in validate_outputs, adding it into the next node's inputs) is its.
  NodeFrame last_node;
  bool measuring = false;
  int op_depth = 0;  // observed op calls running on this thread
};
thread_local ThreadFrames t_frames;

// A tensor's version, or -1 where it keeps none (inference tensors). Read without throwing: the
// start callback must not.
std::int64_t version_of(const at::Tensor& t) {
  const c10::VariableVersion& counter = t.unsafeGetTensorImpl()->version_counter();
  return counter.enabled() ? static_cast<std::int64_t>(counter.current_version()) : -1;
}

using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

// Tensors measured during the outermost op call running on this thread. A cast is observed
// three times (aten::to -> aten::_to_copy -> aten::copy_), each returning the same tensor made
// from the same source: those are read once. Only there, and only within one outermost call: a
// kernel may write another op's output afterwards without a version bump (below autograd), and
// LibTorch's optimizers update parameters through .data() (no bump either).
struct MeasuredTensor {
  WeakTensor impl;
  std::int64_t version;
  detail::ValueStats stats;
};
thread_local std::vector<MeasuredTensor> t_measured;

// Storages whose values are known during the outermost op call running on this thread: its
// inputs', and those of the outputs that calls observed inside it computed or wrote. A kernel may
// allocate a tensor without the dispatcher (a structured kernel's output) and convert it before
// filling it: CPU `mean` of fp16 does `result.to(kFloat)` on its unwritten result, then sums into
// that. Such a cast converts whatever memory held (NaN at times), so the probe reported a
// non-finite `copy_` that no value of the program held, as the first inf/NaN. A nested cast of a
// source on none of these storages is not measured.
thread_local std::vector<const c10::StorageImpl*> t_known_storages;

bool storage_known(const at::Tensor& t) {
  return t.has_storage() && std::find(t_known_storages.begin(), t_known_storages.end(),
                                      t.storage().unsafeGetStorageImpl()) != t_known_storages.end();
}

// Which kinds of non-finite value some values held.
struct NonFiniteKinds {
  bool inf = false, nan = false;
  static NonFiniteKinds of(const ValueStats& s) { return {s.nonfinite > s.nan, s.nan > 0}; }
  void add(NonFiniteKinds other) {
    inf = inf || other.inf;
    nan = nan || other.nan;
  }
  // Whether these hold a kind `given` did not.
  bool beyond(NonFiniteKinds given) const { return (nan && !given.nan) || (inf && !given.inf); }
};

// A tensor seen holding inf/NaN, at the version it had then.
struct NonFiniteTensor {
  WeakTensor impl;
  const c10::StorageImpl* storage = nullptr;  // compared only while `impl` lives (it holds it)
  std::int64_t version = 0;
  NonFiniteKinds kinds;
};

// What one call's floating outputs held.
struct Measurement {
  std::vector<c10::ScalarType> dtypes;  // distinct floating output dtypes
  std::int64_t elements = 0;
  std::int64_t nonfinite = 0;
  NonFiniteKinds kinds;
  bool made = false;          // an inf or NaN its inputs did not hold (PrecisionProbe::NonFinite)
  bool from_outside = false;  // not made: carried from a tensor no recorded op made
  std::vector<NonFiniteTensor> nonfinite_tensors;  // its outputs that held one
  double max_abs = 0.0;
  std::int64_t fp16_overflow = 0, fp16_flush = 0, bf16_overflow = 0, bf16_flush = 0;
  c10::ScalarType nonfinite_dtype = c10::ScalarType::Undefined;
};

void add_dtype(std::vector<c10::ScalarType>& dtypes, c10::ScalarType dtype) {
  if (std::find(dtypes.begin(), dtypes.end(), dtype) == dtypes.end()) dtypes.push_back(dtype);
}

}  // namespace

// The recorded tables of one probe. Callbacks update them from any thread (the autograd
// engine's device threads run CUDA backward), so every access holds `mutex`.
struct PrecisionProbe::State {
  using RowKey = std::tuple<std::string, std::string, int, std::string>;  // op, scope, phase, node
  struct SeqHash {
    std::size_t operator()(const std::pair<std::uint64_t, std::int64_t>& k) const {
      return std::hash<std::uint64_t>()(k.first * 0x9E3779B97F4A7C15ULL ^
                                        static_cast<std::uint64_t>(k.second));
    }
  };

  std::string label;
  std::atomic<bool> recording{true};
  std::atomic<std::int64_t> next_call{0};

  mutable std::mutex mutex;
  std::vector<Row> rows;
  std::map<RowKey, std::size_t> row_index;
  std::optional<NonFinite> first_made;     // the first call that made an inf/NaN
  std::optional<NonFinite> first_outside;  // the first that carried one from outside
  std::atomic<bool> made_found{false};
  // Outputs seen holding inf/NaN (bounded): what an in-place op's written input held before it.
  std::vector<NonFiniteTensor> nonfinite_tensors;
  std::int64_t unmeasured = 0;

  std::optional<NonFinite> first_nonfinite() const;            // holding `mutex`
  void remember_nonfinite(std::vector<NonFiniteTensor> seen);  // holding `mutex`
  const NonFiniteTensor* nonfinite_before(const c10::TensorImpl* impl,
                                          std::int64_t version) const;  // holding `mutex`
  bool seen_nonfinite(const at::Tensor& t) const;  // holding `mutex`: an output, or a view of one
  // (forward thread, sequence number) -> the scope of the forward op that created the node.
  std::unordered_map<std::pair<std::uint64_t, std::int64_t>, std::string, SeqHash> seq_scopes;

  void remember_scope(std::uint64_t thread, std::int64_t first, std::int64_t end,
                      const std::string& scope);
  std::string scope_of(std::uint64_t thread, std::int64_t seq) const;
  Row& row_for(const std::string& op, const std::string& scope, Phase phase,
               const std::string& node, std::int64_t call);
};

void PrecisionProbe::State::remember_scope(std::uint64_t thread, std::int64_t first,
                                           std::int64_t end, const std::string& scope) {
  std::lock_guard<std::mutex> lock(mutex);
  for (std::int64_t seq = first; seq < end; ++seq) seq_scopes[{thread, seq}] = scope;
}

std::string PrecisionProbe::State::scope_of(std::uint64_t thread, std::int64_t seq) const {
  std::lock_guard<std::mutex> lock(mutex);
  auto it = seq_scopes.find({thread, seq});
  return it == seq_scopes.end() ? std::string() : it->second;
}

std::optional<PrecisionProbe::NonFinite> PrecisionProbe::State::first_nonfinite() const {
  if (first_made) return first_made;
  if (!first_outside) return std::nullopt;
  NonFinite outside = *first_outside;
  outside.from_inputs = true;
  return outside;
}

void PrecisionProbe::State::remember_nonfinite(std::vector<NonFiniteTensor> seen) {
  constexpr std::size_t kKept = 4096;  // a diagnostic's few steps; expired entries go first
  if (nonfinite_tensors.size() + seen.size() > kKept) {
    auto expired = [](const NonFiniteTensor& t) { return t.impl.expired(); };
    nonfinite_tensors.erase(
        std::remove_if(nonfinite_tensors.begin(), nonfinite_tensors.end(), expired),
        nonfinite_tensors.end());
  }
  for (auto& t : seen) {
    if (nonfinite_tensors.size() >= kKept) break;
    nonfinite_tensors.push_back(std::move(t));
  }
}

const NonFiniteTensor* PrecisionProbe::State::nonfinite_before(const c10::TensorImpl* impl,
                                                               std::int64_t version) const {
  for (auto it = nonfinite_tensors.rbegin(); it != nonfinite_tensors.rend(); ++it) {
    if (!it->impl.expired() && it->impl._unsafe_get_target() == impl && it->version == version) {
      return &*it;
    }
  }
  return nullptr;
}

bool PrecisionProbe::State::seen_nonfinite(const at::Tensor& t) const {
  const c10::StorageImpl* storage = t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
  return std::any_of(nonfinite_tensors.begin(), nonfinite_tensors.end(), [&](const auto& seen) {
    return !seen.impl.expired() && (seen.impl._unsafe_get_target() == t.unsafeGetTensorImpl() ||
                                    (storage != nullptr && seen.storage == storage));
  });
}

PrecisionProbe::Row& PrecisionProbe::State::row_for(const std::string& op, const std::string& scope,
                                                    Phase phase, const std::string& node,
                                                    std::int64_t call) {
  RowKey key{op, scope, static_cast<int>(phase), node};
  auto it = row_index.find(key);
  if (it == row_index.end()) {
    Row row;
    row.op = op;
    row.scope = scope;
    row.phase = phase;
    row.node = node;
    row.first_call = call;
    it = row_index.emplace(std::move(key), rows.size()).first;
    rows.push_back(std::move(row));
  }
  return rows[it->second];
}

namespace {

using State = PrecisionProbe::State;

// The probe that records now, and the callbacks installed for it. Process-wide: one at a time.
struct Registry {
  std::mutex mutex;
  std::shared_ptr<State> active;
  at::CallbackHandle op_callback = at::INVALID_CALLBACK_HANDLE;
  at::CallbackHandle node_callback = at::INVALID_CALLBACK_HANDLE;
};
Registry& registry() {
  static auto* r = new Registry();  // never destroyed: callbacks may run during exit
  return *r;
}

std::shared_ptr<State> active_state() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.active;
}

// How an op treats its outputs' values, from its name (ATen's naming conventions).
enum class OutputKind {
  kComputed,       // new values (or a view: see OpContext::input_storages)
  kWritesInputs,   // in-place (`add_`) or out= (`add.out`): an output aliasing an input is new
  kUninitialized,  // empty, empty_strided, new_empty, resize_: whatever memory held
};

OutputKind output_kind(const std::string& name, const std::string& overload) {
  const auto colons = name.find("::");
  const std::string base = colons == std::string::npos ? name : name.substr(colons + 2);
  if (base.empty()) return OutputKind::kComputed;
  for (const char* prefix : {"empty", "_empty", "new_empty", "resize", "_resize"}) {
    if (base.rfind(prefix, 0) == 0) return OutputKind::kUninitialized;
  }
  if (base.back() == '_' || overload == "out" || overload.rfind("out_", 0) == 0 ||
      (overload.size() > 4 && overload.compare(overload.size() - 4, 4, "_out") == 0)) {
    return OutputKind::kWritesInputs;
  }
  return OutputKind::kComputed;
}

// The input a cast op converts (aten::to.*, aten::_to_copy, aten::copy_'s src), else -1. A
// narrowing cast's losses are measured against it: its output alone cannot show them.
int cast_source_index(const std::string& name) {
  if (name == "aten::to" || name == "aten::_to_copy") return 0;
  if (name == "aten::copy_") return 1;
  return -1;
}

// The stats of `t` measured earlier in this outermost call, if `reuse`; else measured now.
ValueStats stats_of(const at::Tensor& t, bool reuse) {
  const std::int64_t version = version_of(t);
  const bool versioned = version >= 0;
  if (reuse && versioned) {
    for (const auto& m : t_measured) {
      if (!m.impl.expired() && m.impl._unsafe_get_target() == t.unsafeGetTensorImpl() &&
          m.version == version) {
        return m.stats;
      }
    }
  }
  ValueStats stats = value_stats(t);
  if (versioned) t_measured.push_back({WeakTensor(t.getIntrusivePtr()), version, stats});
  return stats;
}

// One observed op call, from its start callback to its end callback.
struct OpContext : at::ObserverContext {
  std::shared_ptr<State> state;
  std::string op;  // "aten::add.Tensor"
  std::int64_t call = 0;
  std::string scope;
  Phase phase = Phase::kForward;
  std::string node;
  // Forward, the outermost call above autograd: the sequence number the next autograd node
  // will get (the dispatcher passes sequence_number::peek() when autograd is in the key set and
  // grad mode is on; calls below autograd get -1).
  std::int64_t seq = -1;
  OutputKind kind = OutputKind::kComputed;
  std::vector<c10::ScalarType> input_dtypes;  // the call's dtype when no output is floating
  // An output on one of these storages is a view of an input (no new values) unless the op
  // writes its inputs.
  std::vector<const c10::StorageImpl*> input_storages;
  at::Tensor cast_source;
  // The floating tensor inputs with their versions at the start (an in-place op bumps its written
  // one), and whether a scalar argument was inf or NaN (`fill_(-inf)`, `masked_fill(m, -inf)`);
  // only while no op is known to have made an inf/NaN (`keeps_inputs`). Kept here: the
  // dispatcher destroys the boxed inputs after the start callbacks, and weakly: a kernel may
  // count a tensor's references (autograd steals a gradient it holds alone).
  struct Input {
    WeakTensor impl;
    std::int64_t version = 0;
  };
  bool keeps_inputs = false;
  std::vector<Input> float_inputs;
  NonFiniteKinds scalar_kinds;
};

// Marks a backward node's frame on this thread; its end pops it.
struct NodeContext : at::ObserverContext {};

void add_input(const c10::IValue& v, OpContext& ctx) {
  if (v.isTensor()) {
    const auto& t = v.toTensor();
    if (!t.defined()) return;
    if (t.is_floating_point()) {
      add_dtype(ctx.input_dtypes, t.scalar_type());
      if (ctx.keeps_inputs)
        ctx.float_inputs.push_back({WeakTensor(t.getIntrusivePtr()), version_of(t)});
    }
    if (t.has_storage()) ctx.input_storages.push_back(t.storage().unsafeGetStorageImpl());
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) add_input(e, ctx);
  } else if (v.isDouble() && ctx.keeps_inputs) {
    const double d = v.toDouble();
    ctx.scalar_kinds.add({std::isinf(d), std::isnan(d)});
  }
}

// Backward: an autograd node runs on this thread, or the engine works between nodes (it adds
// gradients from several edges outside any node).
bool in_backward() {
  return !t_frames.nodes.empty() || torch::autograd::get_current_graph_task_id() != -1;
}

void locate(OpContext& ctx) {
  if (in_backward()) {
    ctx.phase = Phase::kBackward;
    if (!t_frames.nodes.empty()) {
      ctx.node = t_frames.nodes.back().name;
      ctx.scope = t_frames.nodes.back().scope;
    } else if (t_frames.last_node.graph_task == torch::autograd::get_current_graph_task_id() &&
               !t_frames.last_node.name.empty()) {
      ctx.node = "after " + t_frames.last_node.name;
      ctx.scope = t_frames.last_node.scope;
    }
  } else if (!t_frames.scopes.empty()) {
    ctx.scope = t_frames.scopes.back();
  }
}

void read_inputs(const at::RecordFunction& fn, const c10::OperatorName& name, OpContext& ctx) {
  ctx.op = name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
  ctx.kind = output_kind(name.name, name.overload_name);
  const auto inputs = fn.inputs();
  for (const c10::IValue& v : inputs) add_input(v, ctx);
  const int source = cast_source_index(name.name);
  if (source >= 0 && static_cast<std::size_t>(source) < inputs.size() &&
      inputs[source].isTensor()) {
    ctx.cast_source = inputs[source].toTensor();
  }
}

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& fn) {
  if (t_frames.measuring) return nullptr;
  const auto name = fn.operator_name();
  if (!name) return nullptr;  // a named range (the engine's evaluate_function), not an op
  auto state = active_state();
  if (!state) return nullptr;
  auto ctx = std::make_unique<OpContext>();
  ctx->call = state->next_call.fetch_add(1);
  locate(*ctx);
  if (ctx->phase == Phase::kForward) ctx->seq = fn.seqNr();
  ctx->keeps_inputs = !state->made_found.load();
  read_inputs(fn, *name, *ctx);
  ctx->state = std::move(state);
  if (t_frames.op_depth == 0) t_known_storages = ctx->input_storages;
  ++t_frames.op_depth;
  return ctx;
}

// The keys whose kernels would change what a measuring op computes or where it goes: optamp's
// casting and O2/O5 substitution keys, native autocast, and Python modes/subclasses.
c10::DispatchKeySet measuring_excluded_keys() {
  return c10::autocast_dispatch_keyset |
         c10::DispatchKeySet({detail::kCastKey, detail::kSubstituteKey, c10::DispatchKey::Python,
                              c10::DispatchKey::PythonTLSSnapshot});
}

// Tensors the probe can read values of: dense, with storage, not a wrapper whose ops go
// elsewhere (functorch, functionalization, Python subclasses, fake tensors).
bool measurable(const at::Tensor& t) {
  if (t.layout() != at::kStrided || t.is_nested() || t.is_meta() || !t.has_storage()) {
    return false;
  }
  const auto wrappers = c10::DispatchKeySet(
      {c10::DispatchKey::Python, c10::DispatchKey::FuncTorchBatched,
       c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::Functionalize});
  if (!(t.key_set() & wrappers).empty()) return false;
  // A device->host read is refused while a CUDA graph captures.
  return !t.is_cuda() || !ops::stream_is_capturing(t.device());
}

// The source a cast op's output `t` was converted from, if `t` is that output.
at::Tensor source_of(const at::Tensor& t, const OpContext& ctx) {
  const at::Tensor& s = ctx.cast_source;
  if (!s.defined() || !s.is_floating_point() || s.scalar_type() == t.scalar_type() ||
      s.numel() != t.numel() || !measurable(s)) {
    return at::Tensor();
  }
  return s;
}

// A view returns an input's values: nothing new to measure.
bool is_view_of_input(const at::Tensor& t, const OpContext& ctx) {
  if (ctx.kind == OutputKind::kWritesInputs || !t.has_storage()) return false;
  const auto* storage = t.storage().unsafeGetStorageImpl();
  return std::find(ctx.input_storages.begin(), ctx.input_storages.end(), storage) !=
         ctx.input_storages.end();
}

void add_stats(Measurement& m, const ValueStats& v, c10::ScalarType dtype) {
  add_counts(m, v);
  if (v.nonfinite > 0 && m.nonfinite_dtype == c10::ScalarType::Undefined) {
    m.nonfinite_dtype = dtype;
  }
}

void measure_tensor(const at::Tensor& t, const OpContext& ctx, Measurement& m) {
  if (!t.defined() || !t.is_floating_point()) return;
  add_dtype(m.dtypes, t.scalar_type());
  if (t.numel() == 0 || ctx.kind == OutputKind::kUninitialized || !measurable(t) ||
      is_view_of_input(t, ctx)) {
    return;
  }
  if (t_frames.op_depth > 1 && ctx.cast_source.defined() && !storage_known(ctx.cast_source)) {
    return;  // a kernel's conversion of memory it has not written yet (see t_known_storages)
  }
  t_known_storages.push_back(t.storage().unsafeGetStorageImpl());
  // A cast's output (not copy_: it writes it) was measured by the copy_ inside it.
  ValueStats v = stats_of(t, ctx.cast_source.defined() && ctx.kind == OutputKind::kComputed);
  // A narrowing cast's output cannot show what it lost (an overflow is already inf, a flush
  // already 0): its column for the output dtype counts the source values instead.
  const at::Tensor source = source_of(t, ctx);
  if (source.defined()) {
    const ValueStats from = stats_of(source, true);
    if (t.scalar_type() == at::kHalf) {
      v.fp16_overflow = from.fp16_overflow;
      v.fp16_flush = from.fp16_flush;
    } else if (t.scalar_type() == at::kBFloat16) {
      v.bf16_overflow = from.bf16_overflow;
      v.bf16_flush = from.bf16_flush;
    }
  }
  add_stats(m, v, t.scalar_type());
  if (v.nonfinite > 0) {
    const NonFiniteKinds kinds = NonFiniteKinds::of(v);
    m.kinds.add(kinds);
    const std::int64_t version = version_of(t);
    if (version >= 0) {
      m.nonfinite_tensors.push_back(
          {WeakTensor(t.getIntrusivePtr()), t.storage().unsafeGetStorageImpl(), version, kinds});
    }
  }
}
void measure_value(const c10::IValue& v, const OpContext& ctx, Measurement& m) {
  if (v.isTensor()) {
    measure_tensor(v.toTensor(), ctx, m);
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) measure_value(e, ctx, m);
  } else if (v.isTuple()) {
    for (const c10::IValue& e : v.toTupleRef().elements()) measure_value(e, ctx, m);
  }
}

struct HeldNonFinite {
  NonFiniteKinds kinds;
  bool outside = false;  // some held one that no recorded op made (a corrupt batch, a buffer)
};

bool is_an_output(const at::Tensor& t, const std::vector<c10::IValue>& outputs) {
  return std::any_of(outputs.begin(), outputs.end(), [&](const c10::IValue& o) {
    return o.isTensor() && o.toTensor().unsafeGetTensorImpl() == t.unsafeGetTensorImpl();
  });
}

// What an input held when the call began: a written input (in-place, out=) as the probe last saw
// it (-1: an inference tensor, which has no version); the others as they are now.
void add_held(const OpContext::Input& input, const OpContext& ctx,
              const std::vector<c10::IValue>& outputs, HeldNonFinite& held) {
  const auto impl = input.impl.lock();
  if (!impl) return;
  const at::Tensor t(impl);
  if (is_an_output(t, outputs)) {
    if (input.version < 0) return;
    std::lock_guard<std::mutex> lock(ctx.state->mutex);
    if (const NonFiniteTensor* before = ctx.state->nonfinite_before(impl.get(), input.version)) {
      held.kinds.add(before->kinds);
    }
    return;
  }
  if (t.numel() == 0 || !measurable(t)) return;
  const ValueStats s = stats_of(t, true);
  if (s.nonfinite == 0) return;
  held.kinds.add(NonFiniteKinds::of(s));
  std::lock_guard<std::mutex> lock(ctx.state->mutex);
  held.outside = held.outside || !ctx.state->seen_nonfinite(t);
}

// Whether the call made the inf/NaN its outputs hold (its inputs held none of that kind), or
// carried one from a tensor no recorded op made.
void judge_nonfinite(const at::RecordFunction& fn, const OpContext& ctx, Measurement& m) {
  HeldNonFinite held{ctx.scalar_kinds};
  const std::vector<c10::IValue>& outputs = fn.outputs();
  for (const auto& input : ctx.float_inputs) add_held(input, ctx, outputs, held);
  m.made = m.kinds.beyond(held.kinds);
  m.from_outside = !m.made && held.outside;
}

// Measures the call without being observed, without autograd, and outside every key that could
// make the measurement compute something else than the values as they are.
Measurement measure_call(const at::RecordFunction& fn, const OpContext& ctx) {
  struct Measuring {
    Measuring() { t_frames.measuring = true; }
    ~Measuring() { t_frames.measuring = false; }
  } measuring;
  at::RecordFunctionGuard no_callbacks(false);
  c10::NoGradGuard no_grad;
  c10::impl::ExcludeDispatchKeyGuard no_casts(measuring_excluded_keys());
  Measurement m;
  for (const c10::IValue& v : fn.outputs()) measure_value(v, ctx, m);
  // Only until an op is found to have made one: the inputs are read again then (rare).
  if (m.nonfinite > 0 && ctx.keeps_inputs) judge_nonfinite(fn, ctx, m);
  return m;
}

void add_call(PrecisionProbe::Row& row, const OpContext& ctx, const Measurement& m) {
  row.calls += 1;
  row.first_call = std::min(row.first_call, ctx.call);
  const auto& dtypes = m.dtypes.empty() ? ctx.input_dtypes : m.dtypes;
  for (c10::ScalarType dtype : dtypes) {
    auto it = std::find_if(row.dtypes.begin(), row.dtypes.end(),
                           [&](const auto& d) { return d.dtype == dtype; });
    if (it == row.dtypes.end()) it = row.dtypes.insert(row.dtypes.end(), {dtype, 0});
    it->calls += 1;
  }
  detail::add_counts(row, m);
}

PrecisionProbe::NonFinite nonfinite_call(const OpContext& ctx, const Measurement& m,
                                         std::int64_t op_call) {
  PrecisionProbe::NonFinite first;
  first.op = ctx.op;
  first.phase = ctx.phase;
  first.scope = ctx.scope;
  first.node = ctx.node;
  first.call = ctx.call;
  first.op_call = op_call;
  first.dtype = m.nonfinite_dtype;
  first.count = m.nonfinite;
  first.elements = m.elements;
  return first;
}

void record(const OpContext& ctx, Measurement m) {
  State& state = *ctx.state;
  std::lock_guard<std::mutex> lock(state.mutex);
  if (!state.recording.load()) return;  // ended while this call ran
  auto& row = state.row_for(ctx.op, ctx.scope, ctx.phase, ctx.node, ctx.call);
  add_call(row, ctx, m);
  if (m.nonfinite == 0) return;
  if (m.from_outside && !state.first_outside) {
    state.first_outside = nonfinite_call(ctx, m, row.calls);
  }
  if (m.made && !state.first_made) {
    state.first_made = nonfinite_call(ctx, m, row.calls);
    state.made_found = true;
  }
  state.remember_nonfinite(std::move(m.nonfinite_tensors));
}

// Every autograd node the call created (its own, and those of the casts and inner calls it made:
// an op whose inputs optamp casts gets its node after theirs) backs up into its scope.
void remember_nodes(const at::RecordFunction& fn, const OpContext& ctx) {
  if (ctx.seq < 0 || ctx.scope.empty()) return;
  const auto end = static_cast<std::int64_t>(at::sequence_number::peek());
  ctx.state->remember_scope(fn.threadId(), ctx.seq, end, ctx.scope);
}

void on_op_end(const at::RecordFunction& fn, at::ObserverContext* raw) {
  auto* ctx = static_cast<OpContext*>(raw);
  if (ctx == nullptr) return;
  struct Depth {  // the outermost call's end forgets what was measured in it
    ~Depth() {
      if (--t_frames.op_depth <= 0) {
        t_frames.op_depth = 0;
        t_measured.clear();
        t_known_storages.clear();
      }
    }
  } depth;
  // An end callback runs in RecordFunction's destructor: nothing may escape from it.
  try {
    remember_nodes(fn, *ctx);
    record(*ctx, measure_call(fn, *ctx));
  } catch (const std::exception&) {
    std::lock_guard<std::mutex> lock(ctx->state->mutex);
    ctx->state->unmeasured += 1;
  }
}

// A backward node's RecordFunction carries the node's sequence number and the thread its
// forward ran on (Node::operator() in torch/csrc/autograd/function.h): the key to the scope.
std::unique_ptr<at::ObserverContext> on_node_start(const at::RecordFunction& fn) {
  if (t_frames.measuring) return nullptr;
  auto state = active_state();
  if (!state) return nullptr;
  t_frames.nodes.push_back({fn.name(), state->scope_of(fn.forwardThreadId(), fn.seqNr()),
                            torch::autograd::get_current_graph_task_id()});
  return std::make_unique<NodeContext>();
}

void on_node_end(const at::RecordFunction& /*fn*/, at::ObserverContext* ctx) {
  if (ctx != nullptr && !t_frames.nodes.empty()) {
    t_frames.last_node = std::move(t_frames.nodes.back());
    t_frames.nodes.pop_back();
  }
}

void install(const std::shared_ptr<State>& state) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  TORCH_CHECK(!r.active, "amp::PrecisionProbe: only one probe records at a time; ",
              r.active ? r.active->label : std::string(),
              " is still recording (call its stop() or let it go out of scope first), got a "
              "second one: ",
              state->label);
  r.op_callback = at::addGlobalCallback(at::RecordFunctionCallback(&on_op_start, &on_op_end)
                                            .needsInputs(true)
                                            .needsOutputs(true)
                                            .scopes({at::RecordScope::FUNCTION}));
  r.node_callback = at::addGlobalCallback(at::RecordFunctionCallback(&on_node_start, &on_node_end)
                                              .scopes({at::RecordScope::BACKWARD_FUNCTION}));
  r.active = state;
}

void uninstall(const std::shared_ptr<State>& state) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.active != state) return;
  at::removeCallback(r.op_callback);
  at::removeCallback(r.node_callback);
  r.op_callback = r.node_callback = at::INVALID_CALLBACK_HANDLE;
  r.active.reset();
}

std::string default_label() {
  static std::atomic<int> count{0};
  std::ostringstream out;
  out << "PrecisionProbe #" << ++count << " (started on thread " << std::this_thread::get_id()
      << ")";
  return out.str();
}

}  // namespace

double PrecisionProbe::Row::fraction(std::int64_t count) const {
  return elements > 0 ? static_cast<double>(count) / static_cast<double>(elements) : 0.0;
}

PrecisionProbe::Scope::Scope(std::string name) : depth_(t_frames.scopes.size()) {
  t_frames.scopes.push_back(std::move(name));
}

PrecisionProbe::Scope::~Scope() {
  // Out-of-order ends (an exception between a pre- and a post-hook) drop the newer names too.
  if (t_frames.scopes.size() > depth_) t_frames.scopes.resize(depth_);
}

PrecisionProbe::PrecisionProbe(std::string label) : state_(std::make_shared<State>()) {
  state_->label = label.empty() ? default_label() : "\"" + label + "\"";
  install(state_);
}

PrecisionProbe::~PrecisionProbe() { stop(); }

void PrecisionProbe::stop() {
  uninstall(state_);
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->recording = false;
}

bool PrecisionProbe::recording() const { return state_->recording.load(); }

PrecisionProbe::Report PrecisionProbe::report() const {
  Report report;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    report.rows = state_->rows;
    report.first_nonfinite = state_->first_nonfinite();
    report.calls = state_->next_call.load();
    report.unmeasured = state_->unmeasured;
  }
  std::stable_sort(report.rows.begin(), report.rows.end(),
                   [](const Row& a, const Row& b) { return a.first_call < b.first_call; });
  return report;
}

std::optional<PrecisionProbe::NonFinite> PrecisionProbe::first_nonfinite() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->first_nonfinite();
}

std::string PrecisionProbe::table(int max_rows) const {
  TORCH_CHECK_VALUE(max_rows >= 1, "PrecisionProbe::table: max_rows must be >= 1, got ", max_rows);
  return detail::precision_table(report(), max_rows);
}

std::string PrecisionProbe::json() const { return detail::precision_json(report()); }

const char* PrecisionProbe::phase_name(Phase phase) {
  return phase == Phase::kBackward ? "backward" : "forward";
}

}  // namespace amp
