#pragma once
// The boxed, schema-driven casting kernel registered per listed operator.
#include <ATen/core/boxing/OperatorKernel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <array>
#include <atomic>
#include <optional>
#include <vector>

#include "dispatch/policy_table.h"

namespace amp::detail {

class CastKernel final : public c10::OperatorKernel {
 public:
  // Listed in no table until set_policy.
  explicit CastKernel(const c10::FunctionSchema& schema);
  // The op's row in one table; `banned_message`: the error of a kBanned policy (static storage).
  void set_policy(ListSet set, CastPolicy policy, const char* banned_message = nullptr);
  // A user registration (register_half_op, ...): the same policy whichever lists are in use.
  void set_policy_everywhere(CastPolicy policy);
  // nullopt: the op is not in that table (the kernel only redispatches).
  std::optional<CastPolicy> policy(ListSet set) const;

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                  torch::jit::Stack* stack);

 private:
  enum class SlotKind : std::uint8_t { kTensor, kOptionalTensor, kTensorList, kOptionalTensorList };
  struct Slot {
    std::size_t index;
    SlotKind kind;
  };

  static constexpr std::uint8_t kUnlisted = 0xFF;
  std::array<std::atomic<std::uint8_t>, kNumListSets> policies_;  // a CastPolicy or kUnlisted
  std::atomic<const char*> banned_message_{nullptr};
  std::vector<Slot> slots_;  // read-only tensor arguments (written ones are never cast)
  std::size_t num_arguments_;
  int dtype_index_ = -1;            // the op's `ScalarType? dtype` argument, if any
  bool promotes_natively_ = false;  // see promotes_natively() (policy_table.h)
  std::string name_;
};

}  // namespace amp::detail
