#include "dispatch/carried_state.h"

#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/jit/python/update_graph_executor_opt.h>

namespace amp::detail {
namespace {

// Tags of the level modes in the PrivateUse1 autocast dtype slot (region dtypes are float16 or
// bfloat16, so these never collide with one).
constexpr c10::ScalarType kFollowLevelTag = c10::ScalarType::Float;
constexpr c10::ScalarType kUngatedTag = c10::ScalarType::Double;
// Disabled keeps the keys as they are (the kernels then only redispatch): a thread must still
// reach thread_cast_state() at its next op to drop a disable_casts ended on another thread.
constexpr c10::ScalarType kDisabledTag = c10::ScalarType::Bool;

bool is_region_dtype(c10::ScalarType t) {
  return t == c10::ScalarType::Half || t == c10::ScalarType::BFloat16;
}

// TorchScript's graph executor, once it has profiled a function, differentiates whole subgraphs
// symbolically, with gradient formulas that take each op's output to have the dtypes its graph
// recorded. Casts made below the graph (optamp's kernels) break that: a scripted model's second
// training step failed in a batch norm's backward ("expected scalar type Half but found Float").
// Native autocast avoids it by inserting its casts into the graph (the JIT's autocast pass), which
// optamp's lists cannot do. So while casting is on on a thread, that thread runs TorchScript
// unoptimized (its setting is per thread): each op is dispatched, and differentiated, as in eager
// mode. The user's own setting comes back when casting goes off.
thread_local bool torchscript_optimized_before = true;

void follow_casting_in_torchscript(bool casting_on) {
  if (casting_on) {
    torchscript_optimized_before = torch::jit::getGraphExecutorOptimize();
    torch::jit::setGraphExecutorOptimize(false);
  } else {
    torch::jit::setGraphExecutorOptimize(torchscript_optimized_before);
  }
}

}  // namespace

// Writes the effective mode where at::ThreadLocalState carries it.
void write_carried(std::int32_t mode, c10::ScalarType dtype, bool key, bool substitution) {
  if (key != thread_key_on()) set_thread_key(key);
  if (substitution != substitution_thread_on()) set_substitution_key(substitution);
  const c10::ScalarType tag = mode == kRegion               ? dtype
                              : mode == kFollowLevelUngated ? kUngatedTag
                              : mode == kDisabled           ? kDisabledTag
                                                            : kFollowLevelTag;
  at::autocast::set_autocast_dtype(c10::DeviceType::PrivateUse1, tag);
}

void set_thread_key(bool on) {
  const bool was_on = thread_key_on();
  c10::impl::tls_set_dispatch_key_included(kCastKey, on);
  c10::impl::tls_set_dispatch_key_excluded(kCastKey, !on);
  if (on != was_on) follow_casting_in_torchscript(on);
  // Turned on from off: the level's mode, whatever the slot held (its default is a dtype).
  if (on && !was_on)
    at::autocast::set_autocast_dtype(c10::DeviceType::PrivateUse1, kFollowLevelTag);
}

bool thread_key_on() { return c10::impl::tls_is_dispatch_key_included(kCastKey); }

CarriedMode carried_mode() {
  if (!thread_key_on()) return {kDisabled, c10::ScalarType::Undefined};
  const c10::ScalarType tag = at::autocast::get_autocast_dtype(c10::DeviceType::PrivateUse1);
  if (is_region_dtype(tag)) return {kRegion, tag};
  if (tag == kDisabledTag) return {kDisabled, c10::ScalarType::Undefined};
  return {tag == kUngatedTag ? kFollowLevelUngated : kFollowLevel, c10::ScalarType::Undefined};
}

void set_substitution_key(bool on) {
  // The key reaches dispatch through the registered tensors' key sets, never through the
  // thread's included set: turning it on only lifts torch's default exclusion.
  c10::impl::tls_set_dispatch_key_included(kSubstituteKey, false);
  c10::impl::tls_set_dispatch_key_excluded(kSubstituteKey, !on);
}

bool substitution_thread_on() { return !c10::impl::tls_is_dispatch_key_excluded(kSubstituteKey); }

}  // namespace amp::detail
