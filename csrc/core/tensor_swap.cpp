#include "optamp/tensor_swap.h"

#include <c10/util/Exception.h>

#include <array>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "cache/cast_cache.h"
#include "cache/companion_casts.h"
#include "dispatch/substitution_call.h"
#include "scaler/scale_loss.h"
#include "session.h"

namespace amp {

// What one tensor had in the session, without the weak references (which the swap refuses).
struct SessionRecords {
  struct Parameter {
    c10::ScalarType dtype;
    std::string name;
    bool in_models;
  };
  std::optional<Parameter> parameter;
  struct Source {
    c10::ScalarType dtype;
    bool buffer;
  };
  std::optional<Source> source;
  bool empty() const { return !parameter && !source; }
};

struct HeldRecords {
  const c10::TensorImpl* impl = nullptr;  // nullptr: the second tensor is the first one again
  SessionRecords session;
  detail::ScaledGradMarks marks;
};

class SwapHold {
 public:
  std::array<HeldRecords, 2> held;
  bool restored = false;
};

namespace {

// The session edits of this thread's swaps, published together: at the end of each restore, or
// of the outermost SwapBatch (Module.to() and load_state_dict() swap every parameter one by one,
// and a new session per swap made such a call quadratic in the parameters). Until then the
// published session keeps the old TensorImpls' entries, their references released, and the new
// TensorImpls carry the key without an entry: ops run on them as given, which is what the
// conversions inside a batch do anyway (they run with optamp's rules off).
struct PendingMoves {
  int batch_depth = 0;
  std::unordered_set<const c10::TensorImpl*> erased;  // entries to drop from the session
  struct Moved {
    SessionRecords records;
    std::shared_ptr<detail::TensorRef> ref;
  };
  std::unordered_map<const c10::TensorImpl*, Moved> inserted;  // applied after the erasures
};

PendingMoves& pending() {
  thread_local PendingMoves moves;
  return moves;
}

// Takes `impl`'s records: from a move not yet published, else from the published session (a live
// entry only: a released one was taken before). Releases their references in every copy.
SessionRecords take_session_records(const c10::TensorImpl* impl) {
  SessionRecords records;
  auto& moves = pending();
  if (auto it = moves.inserted.find(impl); it != moves.inserted.end()) {
    it->second.ref->release();
    records = std::move(it->second.records);
    moves.inserted.erase(it);
  } else {
    // Both read before either reference is released: a moved parameter's two entries share one.
    const auto session = detail::current_session();
    const auto parameter = session->parameters.find(impl);
    const auto source = session->working_copy_sources.find(impl);
    const bool has_parameter =
        parameter != session->parameters.end() && parameter->second.ref->is(impl);
    const bool has_source =
        source != session->working_copy_sources.end() && source->second.ref->is(impl);
    if (has_parameter) {
      const auto& r = parameter->second;
      records.parameter = SessionRecords::Parameter{r.dtype, r.name, r.in_models};
      r.ref->release();
    }
    if (has_source) {
      records.source = SessionRecords::Source{source->second.dtype, source->second.buffer};
      source->second.ref->release();
    }
  }
  if (records.empty()) return records;
  moves.erased.insert(impl);
  if (records.source) detail::put_substitution_key(const_cast<c10::TensorImpl*>(impl), false);
  return records;
}

void put_session_records(SessionRecords records, const at::Tensor& now) {
  if (records.empty()) return;
  if (records.source) detail::put_substitution_key(now.unsafeGetTensorImpl(), true);
  pending().inserted.insert_or_assign(
      now.unsafeGetTensorImpl(),
      PendingMoves::Moved{std::move(records), std::make_shared<detail::TensorRef>(now)});
}

void publish_moves() {
  auto& moves = pending();
  if (moves.erased.empty() && moves.inserted.empty()) return;
  detail::edit_session([&moves](detail::Session& s) {
    for (const auto* impl : moves.erased) {
      s.parameters.erase(impl);
      s.working_copy_sources.erase(impl);
    }
    for (const auto& [impl, moved] : moves.inserted) {
      const auto& r = moved.records;
      if (r.parameter) {
        s.parameters.insert_or_assign(
            impl, detail::ParameterRecord{moved.ref, r.parameter->dtype, r.parameter->name,
                                          r.parameter->in_models});
      }
      if (r.source) {
        s.working_copy_sources.insert_or_assign(
            impl, detail::WorkingCopySource{moved.ref, r.source->dtype, r.source->buffer});
      }
    }
  });
  moves.erased.clear();
  moves.inserted.clear();
}

}  // namespace

std::shared_ptr<SwapHold> hold_records_for_swap(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK_VALUE(a.defined() && b.defined(),
                    "hold_records_for_swap: both tensors must be defined, got ",
                    a.defined() ? "an undefined b" : "an undefined a");
  auto hold = std::make_shared<SwapHold>();
  hold->held[0].impl = a.unsafeGetTensorImpl();
  if (b.unsafeGetTensorImpl() != hold->held[0].impl) hold->held[1].impl = b.unsafeGetTensorImpl();
  for (auto& held : hold->held) {
    if (!held.impl) continue;
    held.session = take_session_records(held.impl);
    detail::forget_casts_of(held.impl);
    held.marks = detail::take_scaled_grad_marks(held.impl);
  }
  detail::drop_companions();  // forward-local copies (this thread's), which may alias either
  return hold;
}

void restore_records_after_swap(SwapHold& hold, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(!hold.restored, "restore_records_after_swap: these records were restored already");
  hold.restored = true;
  const std::array<const at::Tensor*, 2> now{&a, &b};
  for (std::size_t i = 0; i < hold.held.size(); ++i) {
    if (!hold.held[i].impl) continue;
    put_session_records(std::move(hold.held[i].session), *now[i]);
    detail::put_scaled_grad_marks(*now[i], hold.held[i].marks);
  }
  if (pending().batch_depth == 0) publish_moves();
}

SwapBatch::SwapBatch() { ++pending().batch_depth; }

SwapBatch::~SwapBatch() {
  if (--pending().batch_depth != 0) return;
  try {
    publish_moves();
  } catch (const std::exception& e) {  // only an allocation can fail here
    TORCH_WARN("optamp: the records of swapped tensors were not published: ", e.what());
  }
}

}  // namespace amp
