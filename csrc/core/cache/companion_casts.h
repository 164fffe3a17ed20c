#pragma once
// Companion copies: a reduced-precision copy of an fp32 result, made by the kernel that computed
// the result, handed to the next op that would cast it; and, marked exact, the reduced tensor an
// fp32 one was widened from (a model boundary's output), which a loss of it reads instead.
//
// Why: Apex's lists run some ops in fp32 (GELU) between ops that run in fp16/bf16 (linear). The
// fp32 result is what the op returns, as Apex returns it, and the next linear then casts it back.
// A kernel that has each value in a register anyway writes the reduced copy in the same pass
// (ops/widened_gelu.h), and the cast finds it here instead of reading the fp32 result again. The
// copy carries its own autograd edge, so its gradient reaches the producing node in the reduced
// dtype, with no conversion.
//
// Per thread (a forward runs on one thread), the last few offered; an entry is served while its
// source is alive and unchanged (same version), so a result modified in place is cast afresh. An
// entry holds the copy's values, not the graph of the forward that made it (companion_casts.cpp).
// A thread's companions are dropped when it ends a scale_loss guard, at its outermost
// amp::autocast exit and by amp::clear_cache() / amp::reset() on it; until then a thread keeps
// at most four (activation-sized) copies alive, and only those no op has taken yet: a taken copy
// is held weakly, by whoever took it.
#include <ATen/core/Tensor.h>

#include <optional>

namespace amp::detail {

// `companion` is `source` rounded to companion's dtype, bit for bit. `exact`: rounding loses
// nothing, `source` is `companion` widened (a model boundary's fp32 output), so a computation of
// `source` may read `companion` instead (find_reduced_companion).
void offer_companion(const at::Tensor& source, const at::Tensor& companion, bool exact = false);

// The companion of `source` in `dtype`, if one was offered and `source` has not changed since.
std::optional<at::Tensor> find_companion(const at::Tensor& source, c10::ScalarType dtype);

// The fp16 or bf16 companion offered as exact of `source`, or of the tensor that `source` views
// whole (a contiguous view of all of a contiguous tensor: the same elements in the same order, as
// `logits.view({-1, classes})`), viewed as `source`. For a loss of a model's widened output; not
// where the gradient of `source` (or of the tensor it views) is kept or hooked: the loss's
// gradient would bypass it.
std::optional<at::Tensor> find_reduced_companion(const at::Tensor& source);

// Drops this thread's companions.
void drop_companions();

}  // namespace amp::detail
