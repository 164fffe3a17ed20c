#pragma once
// The boxed, schema-driven casting kernel registered per listed operator.
#include <ATen/core/boxing/OperatorKernel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <atomic>
#include <vector>

#include "dispatch/policy_table.h"

namespace amp::detail {

class CastKernel final : public c10::OperatorKernel {
 public:
  // `banned_message`: the error of a kBanned policy (the table's; static storage).
  CastKernel(const c10::FunctionSchema& schema, CastPolicy policy,
             const char* banned_message = nullptr);
  void set_policy(CastPolicy policy) { policy_.store(policy); }
  CastPolicy policy() const { return policy_.load(); }

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                  torch::jit::Stack* stack);

 private:
  enum class SlotKind : std::uint8_t { kTensor, kOptionalTensor, kTensorList, kOptionalTensorList };
  struct Slot {
    std::size_t index;
    SlotKind kind;
  };

  std::atomic<CastPolicy> policy_;
  const char* banned_message_;
  std::vector<Slot> slots_;  // read-only tensor arguments (written ones are never cast)
  std::size_t num_arguments_;
  int dtype_index_ = -1;  // the op's `ScalarType? dtype` argument, if any
  std::string name_;
};

}  // namespace amp::detail
