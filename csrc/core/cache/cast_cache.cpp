#include "cache/cast_cache.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "cache/autograd_cast.h"
#include "cache/companion_casts.h"
#include "common/step_events.h"
#include "dispatch/carried_state.h"
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
  std::int64_t version;
  // The source's storage when it was cast. set_data (what Module::to(device/dtype) does to every
  // parameter) swaps the storage of the same TensorImpl without bumping its version, so the
  // version alone would serve a copy of the old data, on the old device.
  const c10::StorageImpl* storage;
  at::Tensor cast;
  c10::Stream stream;        // the copy was made or last refreshed on (see refresh_kept)
  std::uint64_t generation;  // the cache generation the copy was made or refreshed in
  bool kept;                 // outlives its generation, to be refreshed in place (see invalidate)
  bool served_now;           // served (or made) in its generation
  bool hit_since_sweep;      // served from the cache since the last sweep
};

// Whether a copy may be kept across generations and refreshed in place: made under autograd (a
// training forward: no_grad copies are dropped, so evaluation does not keep a second set alive),
// with the source's layout (one elementwise copy refreshes it), and either borrowing the
// source's edge or needing none. A copy with a ToCopyBackward node (a subclass, a tensor with a
// forward-mode tangent) is made afresh.
bool keepable(const at::Tensor& source, const at::Tensor& cast, bool records_autograd) {
  if (!records_autograd || cast.is_same(source) || !is_plain_for_autograd(source)) return false;
  return source.is_non_overlapping_and_dense() && cast.strides() == source.strides();
}

// One multi-tensor copy per (device, source dtype, copy dtype): on CUDA a few launches for all
// of a model's copies (torch's foreach copy converts dtypes on its fast path) instead of one
// allocation and one launch per parameter.
class RefreshBatch {
 public:
  void add(at::Tensor source, const at::Tensor& destination) {
    for (auto& group : groups_) {
      if (group.sources.front().device() == source.device() &&
          group.sources.front().scalar_type() == source.scalar_type() &&
          group.destinations.front().scalar_type() == destination.scalar_type()) {
        group.sources.push_back(std::move(source));
        group.destinations.push_back(destination);
        return;
      }
    }
    groups_.push_back({{std::move(source)}, {destination}});
  }

  // Below autograd and optamp's keys: the copies are the cache's own business, and the sources
  // (O2/O5 masters) would otherwise be substituted by their own stale copies.
  void run() {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    c10::impl::ExcludeDispatchKeyGuard no_optamp_keys(
        c10::DispatchKeySet({kCastKey, kSubstituteKey}));
    for (auto& group : groups_) at::_foreach_copy_(group.destinations, group.sources);
  }

 private:
  struct Group {
    std::vector<at::Tensor> sources, destinations;
  };
  std::vector<Group> groups_;
};

class CastCache {
 public:
  CastResult get(const at::Tensor& source, c10::ScalarType dtype) {
    const Key key{source.unsafeGetTensorImpl(), dtype, records_autograd_now()};
    std::vector<Entry> dropped;  // destroyed after the lock is released (see clear())
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(key);
    if (it != entries_.end() && it->second.generation != generation_ && it->second.kept) {
      refresh_kept(dtype, dropped);  // the first use after the weights may have changed
      it = entries_.find(key);
    }
    if (it != entries_.end() && is_current(it->second, source)) {
      it->second.hit_since_sweep = true;
      it->second.served_now = true;
      return {it->second.cast, false};
    }
    if (it != entries_.end()) dropped.push_back(std::move(it->second));  // stale
    at::Tensor cast = cast_for_autograd(source, dtype, key.grad_mode);
    const bool kept = keepable(source, cast, key.grad_mode);
    entries_.insert_or_assign(
        key, Entry{c10::weak_intrusive_ptr<c10::TensorImpl>(source.getIntrusivePtr()),
                   source._version(), storage_of(source), cast, current_stream(source.device()),
                   generation_, kept, true, false});
    sweep_if_grown(dropped);
    return {cast, true};
  }

  // The weights may change: no entry is served again as it is. Copies served in the ending
  // generation are kept, to be refreshed in place by the next use of any of them (see
  // refresh_kept); the rest are dropped.
  void invalidate() {
    std::vector<Entry> dropped;
    std::lock_guard<std::mutex> lock(mutex_);
    ++generation_;
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (it->second.kept && it->second.served_now) {
        it->second.served_now = false;
        ++it;
      } else {
        dropped.push_back(std::move(it->second));
        it = entries_.erase(it);
      }
    }
  }

  void clear() {
    std::unordered_map<Key, Entry, KeyHash> dropped;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      dropped.swap(entries_);
      live_after_sweep_ = 0;
      ++generation_;
    }
    // `dropped` releases the cached tensors here, outside the lock: freeing a tensor may run
    // deleters that must not re-enter the cache while it is locked.
  }

  // Entries that would be served now (kept copies awaiting their refresh are not).
  std::size_t size() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::size_t current = 0;
    for (const auto& entry : entries_) current += entry.second.generation == generation_;
    return current;
  }

  std::size_t kept_copies() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::size_t kept = 0;
    for (const auto& entry : entries_) kept += entry.second.kept;
    return kept;
  }

 private:
  static c10::Stream current_stream(c10::Device device) {
    if (!c10::impl::hasDeviceGuardImpl(device.type())) {
      return c10::Stream(c10::Stream::DEFAULT, device);
    }
    return c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
  }

  // Whether the refresh may write `e`'s copy in place: nothing but the entry holds it, and the
  // work queued on it so far was queued on the stream the refresh writes on (a step run on
  // another stream could still be reading it).
  static bool refreshable_in_place(const Entry& e, c10::Stream now) {
    return e.cast.use_count() == 1 && e.cast.storage().use_count() == 1 && e.stream == now;
  }

  static const c10::StorageImpl* storage_of(const at::Tensor& t) {
    return t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
  }

  static at::Tensor lock_source(const Entry& e) {
    auto impl = e.source.lock();
    if (!impl) return {};
    return at::Tensor(
        c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim(impl.release()));
  }

  bool is_current(const Entry& e, const at::Tensor& source) const {
    return e.generation == generation_ && !e.source.expired() && e.version == source._version() &&
           e.storage == storage_of(source);
  }

  // Refreshes every kept `dtype` copy of an ended generation: the copies a step used are used
  // again by the next, so they are all brought up to date in one batch (RefreshBatch), each into
  // its own storage when nothing else holds it. That keeps the copies' addresses across steps (a
  // step captured in a CUDA graph reads and writes the same ones) and makes no allocation. A copy
  // someone still holds (a graph kept with retain_graph, a tensor a user kept) is left to them
  // with its old values: its replacement gets new storage, as a fresh cast would. A copy whose
  // source died, moved (set_data) or gained a forward-mode tangent is dropped, and cast afresh if
  // it is used again.
  void refresh_kept(c10::ScalarType dtype, std::vector<Entry>& dropped) {
    RefreshBatch batch;
    std::vector<std::pair<Entry*, at::Tensor>> refreshed;  // entry, source
    for (auto it = entries_.begin(); it != entries_.end();) {
      Entry& e = it->second;
      if (e.generation == generation_ || !e.kept || it->first.dtype != dtype) {
        ++it;
        continue;
      }
      at::Tensor source = lock_source(e);
      if (!source.defined() || storage_of(source) != e.storage || !is_plain_for_autograd(source)) {
        dropped.push_back(std::move(e));
        it = entries_.erase(it);
        continue;
      }
      const c10::Stream now = current_stream(e.cast.device());
      if (!refreshable_in_place(e, now)) {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        e.cast = at::empty_strided(e.cast.sizes(), e.cast.strides(), e.cast.options());
        e.stream = now;
      }
      batch.add(source, e.cast);
      refreshed.emplace_back(&e, std::move(source));
      ++it;
    }
    batch.run();
    for (auto& [e, source] : refreshed) {
      // The source's edge as it is now: a parameter frozen or thawed since gets no gradient, or
      // gets one again.
      if (source.requires_grad() || e->cast.requires_grad()) give_gradient_edge(e->cast, source);
      e->version = source._version();
      e->generation = generation_;
      count_cast();
    }
  }

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
  std::uint64_t generation_ = 0;
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
  add_weights_may_change_listener(&invalidate_cache);
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

void invalidate_cache() {
  cache().invalidate();
  drop_companions();  // this thread's: the other threads drop theirs at their step ends
}

std::size_t kept_cache_copies() { return cache().kept_copies(); }

}  // namespace amp::detail

namespace amp {

void clear_cache() {
  detail::cache().clear();
  detail::drop_companions();  // this thread's: the other threads drop theirs at their step ends
}
std::size_t cache_size() { return detail::cache().size(); }
std::int64_t cast_count() { return detail::g_cast_count.load(std::memory_order_relaxed); }

}  // namespace amp
