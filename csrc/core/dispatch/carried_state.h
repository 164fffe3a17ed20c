#pragma once
// What at::ThreadLocalState carries of optamp's per-thread state to other threads (the autograd
// engine's device threads, at::launch, torch.jit.fork): the casting key, the substitution key's
// exclusion, and the mode tag in the PrivateUse1 autocast dtype slot. A leaf: the frames
// (thread_frames.h) write it, the per-call decision (cast_decision.h) reads it.
#include <c10/core/DispatchKey.h>
#include <c10/core/ScalarType.h>

#include <cstdint>

namespace amp::detail {

// The key optamp's casting kernels live on: above AutocastCUDA/CPU, free in CPU/CUDA builds.
constexpr c10::DispatchKey kCastKey = c10::DispatchKey::AutocastPrivateUse1;
// O2/O5 substitution's own key, so O1 ops (on kCastKey) don't pay for it. Free in CPU/CUDA builds.
// In torch's default excluded set, so a thread that never turned substitution on ignores it.
constexpr c10::DispatchKey kSubstituteKey = c10::DispatchKey::AutocastXLA;

// Per-thread mode, derived from the guards open on the thread (see ThreadCastState::frames).
//  kFollowLevel         the level's rules, while autograd records (the no_grad gate)
//  kRegion              an amp::autocast region: the full lists in its dtype, also under no_grad
//  kDisabled            no rules (disable_casts, autocast(enabled=false))
//  kFollowLevelUngated  the level's rules also under no_grad (amp::lift_no_grad_gate; the
//                       forward of a reentrant checkpoint)
enum ThreadMode : std::int32_t {
  kFollowLevel = 0,
  kRegion = 1,
  kDisabled = 2,
  kFollowLevelUngated = 3
};

// The effective mode lives in state that at::ThreadLocalState carries to other threads (the
// autograd engine's device threads, at::launch, torch.jit.fork): the dispatch-key TLS (casting
// and substitution keys) and the autocast dtype slot of PrivateUse1, the
// device type our key belongs to, which no backend uses in CPU/CUDA builds. The slot holds the
// region dtype (float16/bfloat16), or a tag for the other modes (see carried_mode()).
struct CarriedMode {
  std::int32_t mode = kFollowLevel;
  c10::ScalarType dtype = c10::ScalarType::Undefined;  // the region dtype
};
CarriedMode carried_mode();

// This thread's key: TLS include + un-exclude (new threads start with it off).
void set_thread_key(bool on);
bool thread_key_on();

// This thread's substitution on/off, the raw switch (substitution.h's
// activate_substitution_thread also registers the key's kernels first).
void set_substitution_key(bool on);
bool substitution_thread_on();

// Writes the effective mode, key and substitution where at::ThreadLocalState carries them.
void write_carried(std::int32_t mode, c10::ScalarType dtype, bool key, bool substitution);

}  // namespace amp::detail
