#pragma once
// The session: everything amp::initialize creates for one run, in one object (docs/design.md,
// "The session"). initialize builds a complete Session and publishes it in one step; reset
// publishes the empty one; nothing else changes it. A published Session is immutable: the
// dispatch kernels read a per-thread snapshot of it (one acquire load per call when nothing
// changed), so a kernel never sees half of a level. What is mutable during a run (a scaler's
// scale, the gradients' bookkeeping) lives in objects with their own locks that the session
// holds by pointer.
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/intrusive_ptr.h>

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "optamp/loss_scaler.h"
#include "optamp/opt_level.h"
#include "optamp/policy.h"

namespace amp::detail {

// What every kernel call reads: the level's rules.
struct LevelRules {
  RuleSet rules = RuleSet::kNone;                    // kNone: no level rules (O0, no session)
  c10::ScalarType low = c10::ScalarType::Undefined;  // the level's fp16/bf16
  int verbosity = 1;
  // A model cast in place (O3) has no fp32 weights to meet fp32 inputs under no_grad, so its
  // rules apply there too (docs/casting.md, "The no_grad gate").
  bool ungated = false;
  bool rules_under_no_grad = false;  // Properties::rules_under_no_grad
  OpLists op_lists = OpLists::kApex;
};
// The rules of a resolved level (kNone at O0 or with enabled=false).
LevelRules level_rules_for(const Properties& properties);

// A weak reference to a model tensor's TensorImpl, shared by every copy of the session that
// records the tensor: so a reused address is never mistaken for a dead tensor. Shared, and
// released in place, because torch.utils.swap_tensors refuses a TensorImpl anything holds a weak
// reference to, and a thread's snapshot of an earlier session (an autograd device thread's, until
// its next call) outlives any edit of the published one (tensor_swap.cpp).
class TensorRef {
 public:
  explicit TensorRef(const at::Tensor& t) : ref_(t.getIntrusivePtr()) {}
  // The TensorImpl while it lives and the reference was not released, else null.
  c10::intrusive_ptr<c10::TensorImpl> lock() const {
    std::lock_guard<std::mutex> guard(mutex_);
    return ref_.lock();
  }
  // Whether this refers to `impl` (alive).
  bool is(const c10::TensorImpl* impl) const { return lock().get() == impl; }
  void release() {
    c10::weak_intrusive_ptr<c10::TensorImpl> released(c10::intrusive_ptr<c10::TensorImpl>{});
    std::lock_guard<std::mutex> guard(mutex_);
    ref_.swap(released);
  }

 private:
  mutable std::mutex mutex_;
  c10::weak_intrusive_ptr<c10::TensorImpl> ref_;
};
using SharedTensorRef = std::shared_ptr<TensorRef>;

// A model tensor O2/O5 ops see as its working copy, with its dtype at initialize (the master's).
struct WorkingCopySource {
  SharedTensorRef ref;
  c10::ScalarType dtype;
  bool buffer = false;  // a buffer, not a parameter: view ops hand it its own data
};
using WorkingCopySources = std::unordered_map<const c10::TensorImpl*, WorkingCopySource>;

// The end of the error when a model tensor's dtype is no longer the one the session recorded.
inline constexpr char kCastAfterInitialize[] =
    ": the model was cast after initialize (e.g. model->to(torch::kDouble)), or its data replaced "
    "by a tensor of another dtype (at O2/O5, parameters_to_vector / views of the parameters in "
    "grad mode see the fp16/bf16 working copies: build such a vector under no_grad), which "
    "optamp does not follow. Call amp::reset(), cast the model, and initialize again (or cast "
    "before initialize); moving it to another device is fine.";

// The end of the error when an optimizer parameter of no model passed (taken at O1/O4) changed
// dtype: libraries cast such weights themselves.
inline constexpr char kOutsideModelsCastAfterInitialize[] =
    ": it is a parameter of no model passed to initialize (a loss's own weights, taken as they "
    "are at O1/O4), and its module cast it since, often to the dtype of its input "
    "(pytorch-metric-learning's ArcFaceLoss and ProxyAnchorLoss cast their weights to the "
    "embeddings' fp16/bf16 at O1/O4). Stepped in that dtype without fp32 master weights, its "
    "updates would round away: give that module fp32 inputs (loss_fn(embeddings.float(), "
    "labels)), as torch's GradScaler requires too.";

// An optimizer parameter as initialize left it: its dtype (scale_loss refuses one cast since)
// and the model's name for it ("fc1.weight"; empty when the front gave none or it is in no
// model), which error messages use.
struct ParameterRecord {
  SharedTensorRef ref;
  c10::ScalarType dtype;
  std::string name;
  bool in_models = true;  // false: an optimizer's parameter of no model passed (O1/O4)
};
using ParameterRecords = std::unordered_map<const c10::TensorImpl*, ParameterRecord>;

struct Session {
  bool initialized = false;  // made by amp::initialize (not by configure_loss_scalers alone)
  LevelRules rules;
  WorkingCopySources working_copy_sources;  // O2/O5: the tensors that carry the substitution key
  ParameterRecords parameters;
  // One per loss_id; empty: loss scaling not configured. A live scale_loss guard holds its
  // scaler, so a guard open across a reset finishes on the scaler it started with.
  std::vector<std::shared_ptr<LossScaler>> loss_scalers;
  // The optimizers scale_loss accepts (the ones initialize was given); nullopt: any.
  std::optional<std::unordered_set<const void*>> optimizers;
  // The models initialize was given (their identities, as the front passed them) and the casts at
  // their boundary (Properties::model_boundary; at O2/O5 the inputs' cast also depends on the
  // thread: core::model_boundary).
  std::vector<const void*> models;
  ModelBoundary boundary;

  // The record of `t` when `t` is (still) that parameter, else nullptr.
  const ParameterRecord* find_parameter(const at::Tensor& t) const;
};

// This thread's snapshot of the published session (never null: the empty session before any
// initialize). Holding it keeps that session alive; a thread refreshes its snapshot at its next
// call after a publish. A thread that ends leaves a replaced session to the next publish, which
// releases it (see ~Snapshot in session.cpp).
std::shared_ptr<const Session> current_session();
// The level rules of this thread's snapshot (a copy: valid whatever publishes meanwhile).
LevelRules current_level_rules();

// Serializes the operations that replace the session (initialize, reset, configure_loss_scalers):
// held for their whole validate-then-publish, so two initializes cannot interleave.
std::unique_lock<std::mutex> lock_session_changes();
// Publishes `next` (caller holds lock_session_changes()) and returns the session it replaces.
std::shared_ptr<const Session> publish_session(std::shared_ptr<const Session> next);
// Publishes a copy of the current session with `edit` applied (takes the lock itself): what the
// parts that are set on their own use (the loss scalers without initialize, tests' level rules).
void edit_session(const std::function<void(Session&)>& edit);

}  // namespace amp::detail
