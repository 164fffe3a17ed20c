#include "cache/cast_cache.h"

#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "cache/autograd_cast.h"
#include "cache/companion_casts.h"
#include "common/step_events.h"
#include "optamp/cast_cache.h"
#include "optamp/policy.h"

namespace amp::detail {
namespace {

struct Key {
  const c10::TensorImpl* source;
  c10::ScalarType dtype;
  bool grad_mode;
  bool operator==(const Key& other) const {
    return source == other.source && dtype == other.dtype && grad_mode == other.grad_mode;
  }
};

struct KeyHash {
  std::size_t operator()(const Key& k) const {
    return std::hash<const void*>()(k.source) ^ (static_cast<std::size_t>(k.dtype) << 1) ^
           static_cast<std::size_t>(k.grad_mode);
  }
};

struct Entry {
  c10::weak_intrusive_ptr<c10::TensorImpl> source;
  std::uint32_t version;
  // The source's storage when it was cast. set_data (what Module::to(device/dtype) does to every
  // parameter) swaps the storage of the same TensorImpl without bumping its version, so the
  // version alone would serve a copy of the old data, on the old device.
  const c10::StorageImpl* storage;
  at::Tensor cast;
  bool hit_since_sweep;  // served from the cache since the last sweep
};

class CastCache {
 public:
  CastResult get(const at::Tensor& source, c10::ScalarType dtype) {
    const Key key{source.unsafeGetTensorImpl(), dtype, records_autograd_now()};
    const std::uint32_t version = source._version();
    std::vector<Entry> dropped;  // destroyed after the lock is released (see clear())
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(key);
    const c10::StorageImpl* storage =
        source.has_storage() ? source.storage().unsafeGetStorageImpl() : nullptr;
    if (it != entries_.end() && !it->second.source.expired() && it->second.version == version &&
        it->second.storage == storage) {
      it->second.hit_since_sweep = true;
      return {it->second.cast, false};
    }
    if (it != entries_.end()) dropped.push_back(std::move(it->second));  // stale
    at::Tensor cast = cast_for_autograd(source, dtype, key.grad_mode);
    entries_.insert_or_assign(
        key, Entry{c10::weak_intrusive_ptr<c10::TensorImpl>(source.getIntrusivePtr()), version,
                   storage, cast, false});
    sweep_if_grown(dropped);
    return {cast, true};
  }

  void clear() {
    std::unordered_map<Key, Entry, KeyHash> dropped;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      dropped.swap(entries_);
      live_after_sweep_ = 0;
    }
    // `dropped` releases the cached tensors here, outside the lock: freeing a tensor may run
    // deleters that must not re-enter the cache while it is locked.
  }

  std::size_t size() {
    std::lock_guard<std::mutex> lock(mutex_);
    return entries_.size();
  }

 private:
  // Once the map has doubled since the last sweep (amortized O(1) per insert), entries not served
  // since that sweep are dropped (a clock-style second chance), so the size stays within about
  // twice the set of tensors that are actually reused.
  // Why not "source expired": a cast made under autograd holds its source through
  // its grad accumulator (autograd_cast.h), so a dead parameter is never expired while its
  // entry lives, and from Python its preserved PyObject adds a reference too, so no reference count
  // tells a dropped parameter from a live one. Dropping a live entry only costs one cast later.
  void sweep_if_grown(std::vector<Entry>& dropped) {
    if (entries_.size() < 2 * live_after_sweep_ + 64) return;
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (it->second.hit_since_sweep && it->second.source.use_count() > 1) {
        it->second.hit_since_sweep = false;
        ++it;
        continue;
      }
      dropped.push_back(std::move(it->second));
      it = entries_.erase(it);
    }
    live_after_sweep_ = entries_.size();
  }

  std::mutex mutex_;
  std::unordered_map<Key, Entry, KeyHash> entries_;
  std::size_t live_after_sweep_ = 0;
};

CastCache& cache() {
  static auto* instance = new CastCache();  // leaked: used until process exit
  return *instance;
}

std::atomic<std::int64_t> g_cast_count{0};

bool is_cacheable(const at::Tensor& t) { return t.is_leaf() && t.requires_grad(); }

const bool g_registered = [] {
  // Companion copies are needed only within a forward: the notifying thread (its scale_loss
  // guard's end) drops its own, so they do not outlive a training loop.
  add_weights_may_change_listener([] {
    cache().clear();
    drop_companions();
  });
  return true;
}();

}  // namespace

CastResult cast_through_cache(const at::Tensor& source, c10::ScalarType dtype, bool always_cache) {
  if (!always_cache && !is_cacheable(source)) {
    count_cast();
    if (auto companion = find_companion(source, dtype)) return {*std::move(companion), true};
    return {cast_for_autograd(source, dtype, records_autograd_now()), true};
  }
  CastResult result = cache().get(source, dtype);
  if (result.performed_cast) count_cast();
  return result;
}

void count_cast() { g_cast_count.fetch_add(1, std::memory_order_relaxed); }

}  // namespace amp::detail

namespace amp {

void clear_cache() {
  detail::cache().clear();
  detail::drop_companions();  // this thread's: the other threads drop theirs at their step ends
}
std::size_t cache_size() { return detail::cache().size(); }
std::int64_t cast_count() { return detail::g_cast_count.load(std::memory_order_relaxed); }

}  // namespace amp
