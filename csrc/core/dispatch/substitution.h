#pragma once
// O2/O5 parameter substitution (docs/design.md, Dispatch keys; docs/casting.md, O2/O5: what ops
// see): every op that takes a registered model tensor sees its cached low-precision working copy.
//
// The key lives on the registered tensors themselves (added to their TensorImpl's key set, as
// torch adds a backend's autocast key to every tensor of that backend), and a thread running at
// O2/O5 stops excluding it. Dispatch reaches substitution only for ops with a registered tensor
// among their arguments: the rest of a forward, the whole backward and the casts themselves pay
// nothing.
#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKey.h>

#include <vector>

#include "dispatch/carried_state.h"

#include "session.h"

namespace amp::detail {

// The model tensors ops should see as working copies (params and buffers minus batch-norm /
// keep_in_fp32 ones; of them the fp32, fp16 and bf16 ones), for the session initialize builds;
// those not among `parameters` are buffers. Registers the key's kernels on first use.
WorkingCopySources make_working_copy_sources(const std::vector<at::Tensor>& tensors,
                                             const std::vector<at::Tensor>& parameters);
// After a session was published: the tensors of `from` (the replaced session's) lose the key,
// those of `to` get it.
void move_substitution_key(const WorkingCopySources& from, const WorkingCopySources& to);
// The dtype ops on this thread see `session`'s working copies in now (Undefined: they see the
// masters: no working copies, substitution off on this thread, the no_grad gate, disable_casts).
// The caller's snapshot, so its answer and the caller's other reads come from one session.
c10::ScalarType working_copy_dtype_now(const Session& session);
// Whether `t` is a registered source now.
bool is_working_copy_source(const at::Tensor& t);
// The dtype ops on this thread see `t` in now: its working copy's when it is a registered source
// and substitution applies, else its own. The cast kernels run above substitution: a promote call
// weighs a model tensor in the dtype its op will get.
c10::ScalarType dtype_ops_see(const at::Tensor& t);
// `t`'s own data for an op below substitution, where its cast kernel wants a model tensor in its
// own (fp32) dtype: an alias of a parameter (substitution replaces registered tensors, not their
// aliases), a copy of a buffer (substitution replaces any view over a registered buffer's
// storage, so that writes through views reach the buffer and reads see the working copy).
at::Tensor own_data_past_substitution(const at::Tensor& t);
// Whether `t` is a registered buffer or a view over one (not a parameter).
bool is_registered_buffer(const at::Tensor& t);

// This thread's substitution on/off (with the casting key, by initialize and reset); registers
// the key's kernels first when turning it on.
void activate_substitution_thread(bool on);

}  // namespace amp::detail
