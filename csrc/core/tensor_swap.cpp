#include "optamp/tensor_swap.h"

#include <c10/util/Exception.h>

#include <array>
#include <optional>
#include <string>

#include "cache/cast_cache.h"
#include "cache/companion_casts.h"
#include "dispatch/substitution_call.h"
#include "scaler/scale_loss.h"
#include "session.h"

namespace amp {

// What one tensor had, without the weak references (which are what the swap refuses).
struct HeldRecords {
  const c10::TensorImpl* impl = nullptr;  // nullptr: the second tensor is the first one again
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
  detail::ScaledGradMarks marks;
};

class SwapHold {
 public:
  std::array<HeldRecords, 2> held;
  bool restored = false;
};

namespace {

bool has_session_records(const detail::Session& s, const c10::TensorImpl* impl) {
  return s.parameters.count(impl) != 0 || s.working_copy_sources.count(impl) != 0;
}

// Moves `impl`'s session records into `held` (in the session being edited).
void take_session_records(detail::Session& s, HeldRecords& held) {
  if (auto it = s.parameters.find(held.impl); it != s.parameters.end()) {
    const auto& r = it->second;
    held.parameter = HeldRecords::Parameter{r.dtype, r.name, r.in_models};
    r.ref->release();  // in every snapshot of the session that still holds the record
    s.parameters.erase(it);
  }
  if (auto it = s.working_copy_sources.find(held.impl); it != s.working_copy_sources.end()) {
    held.source = HeldRecords::Source{it->second.dtype, it->second.buffer};
    it->second.ref->release();
    detail::put_substitution_key(const_cast<c10::TensorImpl*>(held.impl), false);
    s.working_copy_sources.erase(it);
  }
}

void put_session_records(detail::Session& s, const HeldRecords& held, const at::Tensor& now) {
  const auto ref = std::make_shared<detail::TensorRef>(now);
  if (held.parameter) {
    s.parameters.insert_or_assign(
        now.unsafeGetTensorImpl(),
        detail::ParameterRecord{ref, held.parameter->dtype, held.parameter->name,
                                held.parameter->in_models});
  }
  if (held.source) {
    s.working_copy_sources.insert_or_assign(
        now.unsafeGetTensorImpl(),
        detail::WorkingCopySource{ref, held.source->dtype, held.source->buffer});
    detail::put_substitution_key(now.unsafeGetTensorImpl(), true);
  }
}

}  // namespace

std::shared_ptr<SwapHold> hold_records_for_swap(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK_VALUE(a.defined() && b.defined(),
                    "hold_records_for_swap: both tensors must be defined, got ",
                    a.defined() ? "an undefined b" : "an undefined a");
  auto hold = std::make_shared<SwapHold>();
  hold->held[0].impl = a.unsafeGetTensorImpl();
  if (b.unsafeGetTensorImpl() != hold->held[0].impl) hold->held[1].impl = b.unsafeGetTensorImpl();
  bool in_session = false;
  {
    const auto session = detail::current_session();
    for (const auto& held : hold->held) {
      in_session = in_session || (held.impl && has_session_records(*session, held.impl));
    }
  }
  if (in_session) {
    detail::edit_session([&hold](detail::Session& s) {
      for (auto& held : hold->held) {
        if (held.impl) take_session_records(s, held);
      }
    });
  }
  for (auto& held : hold->held) {
    if (!held.impl) continue;
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
  bool in_session = false;
  for (const auto& held : hold.held) in_session = in_session || held.parameter || held.source;
  if (in_session) {
    detail::edit_session([&hold, &now](detail::Session& s) {
      for (std::size_t i = 0; i < hold.held.size(); ++i) {
        if (hold.held[i].impl) put_session_records(s, hold.held[i], *now[i]);
      }
    });
  }
  for (std::size_t i = 0; i < hold.held.size(); ++i) {
    if (hold.held[i].impl) detail::put_scaled_grad_marks(*now[i], hold.held[i].marks);
  }
}

}  // namespace amp
