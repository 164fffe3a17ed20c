// Kernels on optamp's key live in torch::Library objects created at run time (one per operator
// namespace) and kept for the life of the process. The opt level is data the kernels read, and a
// policy change (register_half_op and friends) updates the kernel in place, so nothing is ever
// deregistered while other threads may be dispatching.
#include "dispatch/registration.h"
#include "dispatch/unboxed_kernels.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <tuple>
#include <unordered_map>

#include "dispatch/carried_state.h"
#include "dispatch/cast_kernel.h"
#include "optamp/policy.h"

namespace amp::detail {
namespace {

struct Registry {
  std::mutex mutex;
  std::map<std::string, std::unique_ptr<torch::Library>> libraries;  // by namespace
  std::unordered_map<c10::OperatorName, CastKernel*> kernels;        // owned by the dispatcher
  std::vector<std::string> skipped;                                  // table rows this build lacks
  bool registered = false;
};

Registry& registry() {
  static auto* instance = new Registry();  // leaked on purpose: kernels outlive static teardown
  return *instance;
}

void check_key_is_free() {
  TORCH_CHECK(!c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(kCastKey),
              "optamp needs the dispatch key ", kCastKey,
              " for its casting kernels, but another "
              "library already registered a fallback on it (an out-of-tree PrivateUse1 device "
              "backend with its own autocast is loaded in this process). optamp cannot share that "
              "key; use that backend's autocast, or run optamp in a process without it.");
}

// The kernel of one existing operator, registered on first use. Caller holds the mutex.
CastKernel& kernel_locked(Registry& r, const c10::OperatorHandle& op) {
  const c10::OperatorName& name = op.operator_name();
  if (auto it = r.kernels.find(name); it != r.kernels.end()) return *it->second;
  const std::string ns = name.name.substr(0, name.name.find("::"));
  auto& library = r.libraries[ns];
  if (!library) {
    library =
        std::make_unique<torch::Library>(torch::Library::IMPL, ns, kCastKey, __FILE__, __LINE__);
  }
  auto kernel = std::make_unique<CastKernel>(op.schema());
  CastKernel& registered = *kernel;
  r.kernels[name] = kernel.get();
  if (register_unboxed(*library, name, qualified(name), kernel.get())) {
    static_cast<void>(kernel.release());  // the unboxed kernel refers to it: lives as the registry
  } else {
    library->impl(qualified(name).c_str(),
                  torch::CppFunction::makeFromBoxedFunctor(std::move(kernel)));
  }
  return registered;
}

// Every table's rows, into one kernel per operator that holds the op's row of each table.
// The entry's operator in this LibTorch, or nullopt, recorded as skipped (`where`: its table).
std::optional<c10::OperatorHandle> find_listed(Registry& r, const TableEntry& entry,
                                               const std::string& where) {
  auto op = c10::Dispatcher::singleton().findSchema({entry.name, entry.overload});
  if (!op) r.skipped.push_back(qualified({entry.name, entry.overload}) + where);
  return op;
}

void register_builtin_tables_locked(Registry& r) {
  for (const ListSet set : kListSets) {
    for (const TableEntry& entry : table_of(set)) {
      const std::string where = std::string(" (") + to_string(set) + ")";
      if (auto op = find_listed(r, entry, where)) {
        kernel_locked(r, *op).set_policy(set, entry.policy, entry.message);
      }
    }
  }
  // With either lists, where a table has no row of its own: AutocastCPU promotes index_copy, and
  // op_lists="torch" runs it as native autocast does.
  for (const TableEntry& entry : match_self_ops()) {
    if (auto op = find_listed(r, entry, "")) {
      CastKernel& kernel = kernel_locked(r, *op);
      for (const ListSet set : kListSets) {
        if (!kernel.policy(set)) kernel.set_policy(set, entry.policy);
      }
    }
  }
}

// Whether another library gave `op` a native autocast kernel (for any device optamp casts on).
bool has_own_autocast(const c10::OperatorHandle& op) {
  for (const NativeAutocastKey& native : kNativeAutocastKeys) {
    if (op.hasKernelForDispatchKey(native.key)) return true;
  }
  return false;
}

// Ops outside ATen that come with their own autocast kernel (torchvision's nms, roi_align, ...):
// under torch.autocast that kernel casts them, and it does under optamp too, unless a table or a
// registration gave the op a policy. ATen's autocast kernels are torch's lists, which optamp
// replaces with its own (or copies, OpLists::kTorch). Libraries load at any time, so each
// initialize looks again.
void register_own_autocast_ops_locked(Registry& r) {
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const auto& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) == 0) continue;
    auto op = dispatcher.findSchema(name);  // an impl without a def has no schema to read
    if (!op || !has_own_autocast(*op)) continue;
    CastKernel& kernel = kernel_locked(r, *op);
    if (!kernel.listed()) kernel.set_policy_everywhere(CastPolicy::kOwnAutocast);
  }
}

bool writes_an_argument(const c10::FunctionSchema& schema) {
  for (const auto& arg : schema.arguments()) {
    if (arg.alias_info() && arg.alias_info()->isWrite()) return true;
  }
  return false;
}

// "ns::op.overload" -> that operator; "ns::op" -> its overloads that write no argument (a lowered
// input next to an fp32 `out=` or `self` would only make the kernel fail), or every overload when
// all of them write (an in-place-only custom op).
std::vector<c10::OperatorHandle> resolve_ops(std::string_view qualified_name) {
  const std::string text(qualified_name);
  const auto sep = text.find("::");
  TORCH_CHECK_VALUE(sep != std::string::npos && sep > 0 && sep + 2 < text.size(),
                    "op name must be qualified as \"namespace::op\" or "
                    "\"namespace::op.overload\", got \"",
                    text, "\"");
  const auto dot = text.find('.', sep);
  const std::string base = text.substr(0, dot);
  auto& dispatcher = c10::Dispatcher::singleton();
  std::vector<c10::OperatorHandle> ops;
  if (dot != std::string::npos) {
    if (auto op = dispatcher.findSchema({base, text.substr(dot + 1)})) ops.push_back(*op);
  } else {
    std::vector<c10::OperatorHandle> writing;
    for (const auto& name : dispatcher.getAllOpNames()) {
      if (name.name != base) continue;
      if (auto op = dispatcher.findSchema(name)) {
        (writes_an_argument(op->schema()) ? writing : ops).push_back(*op);
      }
    }
    if (ops.empty()) ops = std::move(writing);  // an in-place-only op: what was asked for
  }
  TORCH_CHECK_VALUE(!ops.empty(), "no operator named \"", text,
                    "\" is registered with the "
                    "dispatcher (define it with TORCH_LIBRARY / torch.library first, and check "
                    "the namespace and overload)");
  return ops;
}

}  // namespace

std::string qualified(const c10::OperatorName& name) {
  return name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
}

void ensure_registered() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.registered) return;
  check_key_is_free();
  // Ops without a policy fall through at the cost of a table lookup.
  static auto* fallback =
      new torch::Library(torch::Library::IMPL, "_", kCastKey, __FILE__, __LINE__);
  fallback->fallback(torch::CppFunction::makeFallthrough());
  register_builtin_tables_locked(r);
  register_own_autocast_ops_locked(r);
  r.registered = true;
}

void register_own_autocast_ops() {
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    if (r.registered) {
      register_own_autocast_ops_locked(r);
      return;
    }
  }
  ensure_registered();  // the first registration looks too
}

void activate_thread(bool on) {
  if (on) ensure_registered();
  set_thread_key(on);
}

void register_user_op(std::string_view qualified_name, CastPolicy policy) {
  auto ops = resolve_ops(qualified_name);  // validate before touching anything
  ensure_registered();
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& op : ops) kernel_locked(r, op).set_policy_everywhere(policy);
}

std::optional<KernelOfCall> kernel_of_call(const std::string& qualified_name) {
  ensure_registered();
  const auto dot = qualified_name.find('.', qualified_name.find("::"));
  const std::string base = qualified_name.substr(0, dot);
  const std::optional<std::string> overload =
      dot == std::string::npos ? std::nullopt : std::optional(qualified_name.substr(dot + 1));
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const CastKernel* found = nullptr;
  c10::OperatorName found_name{"", ""};
  auto rank = [](const c10::OperatorName& name, const CastKernel& kernel) {
    if (!kernel.listed()) return 3;
    return name.overload_name == "Tensor" ? 0 : name.overload_name.empty() ? 1 : 2;
  };
  for (const auto& [name, kernel] : r.kernels) {
    if (name.name != base) continue;
    if (overload) {
      if (name.overload_name != *overload) continue;
    } else if (found != nullptr &&
               std::make_tuple(rank(found_name, *found), found_name.overload_name) <=
                   std::make_tuple(rank(name, *kernel), name.overload_name)) {
      continue;
    }
    found = kernel;
    found_name = name;
  }
  if (found == nullptr) return std::nullopt;
  auto op = c10::Dispatcher::singleton().findSchema(found_name);
  if (!op) return std::nullopt;
  return KernelOfCall{*op, found};
}

RegisteredPolicies registered_policies() {
  ensure_registered();
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  RegisteredPolicies registered;
  for (const auto& [name, kernel] : r.kernels) {
    const std::string op = qualified(name);
    for (const ListSet list : kListSets) {
      if (const auto policy = kernel->policy(list)) registered.rows.push_back({op, list, *policy});
    }
  }
  std::sort(registered.rows.begin(), registered.rows.end(), [](const auto& a, const auto& b) {
    return std::tie(a.op, a.list) < std::tie(b.op, b.list);
  });
  registered.skipped.assign(r.skipped.begin(), r.skipped.end());
  return registered;
}

}  // namespace amp::detail
