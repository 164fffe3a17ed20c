#pragma once
// O2/O5 parameter substitution (docs/design.md, Dispatch keys; docs/casting.md, O2/O5: what ops
// see): on a second dispatch key with a permanent boxed fallback, every op sees each registered
// model tensor as its cached low-precision working copy.
#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKey.h>

#include <vector>

namespace amp::detail {

// Its own key, so O1 ops (on kCastKey) don't pay for a boxed fallback. Free in CPU/CUDA builds.
constexpr c10::DispatchKey kSubstituteKey = c10::DispatchKey::AutocastXLA;

// The model tensors ops should see as working copies (params and buffers minus batch-norm /
// keep_in_fp32 ones). Replaces the previous set; registers the key's kernels on first use.
void set_working_copy_sources(const std::vector<at::Tensor>& tensors);
void clear_working_copy_sources();

// This thread's substitution key on/off (with the casting key, by initialize and reset).
void activate_substitution_thread(bool on);
bool substitution_thread_on();

}  // namespace amp::detail
