#include "cache/cast_cache.h"

#include <ATen/EmptyTensor.h>
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <atomic>
#include <iterator>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "cache/autograd_cast.h"
#include "cache/batched_cast.h"
#include "cache/companion_casts.h"
#include "cache/gradient_buckets.h"
#include "common/step_events.h"
#include "ops/stream_capture.h"
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
  at::Tensor cast;           // undefined while the entry waits for its re-cast (see invalidate)
  std::uint64_t generation;  // the cache generation the copy was made in
  std::uint64_t capture;     // the CUDA graph capture it was made in (0: none; see is_current)
  bool recast;               // re-cast with the others in the next generation (see invalidate)
  bool served_now;           // served (or made) in its generation
  bool hit_since_sweep;      // served from the cache since the last sweep
  bool in_working_set;       // its generation's working set, kept by sweeps (see sweep_if_grown)
  std::uint64_t order;       // when its generation first served it (the next batch's order)
  bool bucketed;             // its copy's gradient goes through a bucket (gradient_buckets.h)
  at::Tensor own_edge;       // a bucketed copy's alias for its later uses (alias_with_own_edge)
};

// Whether a copy is re-cast in the batch of the next generation: made under autograd (a training
// forward; copies made under no_grad are simply dropped) from a dense, plain source. A copy with
// a ToCopyBackward node (a subclass, a tensor with a forward-mode tangent) is made afresh.
bool batch_recast(const at::Tensor& source, bool records_autograd) {
  return records_autograd && is_plain_for_autograd(source) && source.is_non_overlapping_and_dense();
}

// Whether the source's storage holds its data now. FSDP2 frees a gathered (unsharded) parameter's
// storage after its module's forward and backward (resize to 0 bytes) and gathers it again
// before the next use: a batch that read it between the two failed ("The tensor has a non-zero
// number of elements, but its data is not allocated yet"), in the next step's first forward.
bool holds_its_data(const at::Tensor& source) {
  const auto needed = at::detail::computeStorageNbytes(
      source.sizes(), source.strides(), source.element_size(), source.storage_offset());
  return source.storage().nbytes() >= needed;
}

class CastCache {
 public:
  CastResult get(const at::Tensor& source, c10::ScalarType dtype) {
    const Key key{source.unsafeGetTensorImpl(), dtype, records_autograd_now()};
    const std::uint64_t capture = ops::stream_capture_id(source.device());
    std::vector<Entry> dropped;  // destroyed after the lock is released (see clear())
    std::unique_lock<std::mutex> lock(mutex_);
    auto it = entries_.find(key);
    if (it != entries_.end() && it->second.generation != generation_ && it->second.recast) {
      // The first use after the weights may change.
      recast_previous_generation(dtype, source.device(), capture, dropped);
      it = entries_.find(key);
    }
    while (it != entries_.end() && !is_current(it->second, source, capture)) {
      // A stale copy is released before its replacement is made. It holds the source's grad
      // accumulator as its gradient edge, and the new copy would take over that node, with the
      // stream it was made on: an eager copy replaced inside a CUDA graph capture would have the
      // captured backward accumulate on the default stream, which breaks the capture (torch
      // warns of "an AccumulateGrad node created prior to the current iteration being kept
      // alive"). Released, and held nowhere else, the node goes, and the new copy makes its own.
      // A copy from another capture (or from outside one) goes with every other such copy: the
      // copies of a batch share their bucket's node (gradient_buckets.h), which holds all their
      // sources' accumulators, so one released alone would leave the node to the rest.
      std::vector<at::Tensor> stale;
      if (it->second.capture != capture) {
        drop_copies_of_other_captures(capture, stale, dropped);
      } else {
        drop(it, stale, dropped);
      }
      lock.unlock();
      stale.clear();  // outside the lock (see clear())
      lock.lock();
      it = entries_.find(key);  // another thread may have cast it meanwhile
    }
    if (it != entries_.end()) return {serve(it->second, source), false};
    at::Tensor cast = cast_for_autograd(source, dtype, key.grad_mode);
    ++made_in_generation_;
    const bool in_working_set = made_in_generation_ <= 2 * working_set_ + kWorkingSetFloor;
    dtypes_cast_to_ |= std::uint64_t{1} << static_cast<int>(dtype);
    entries_.insert_or_assign(
        key,
        Entry{c10::weak_intrusive_ptr<c10::TensorImpl>(source.getIntrusivePtr()), source._version(),
              storage_of(source), cast, generation_, capture, batch_recast(source, key.grad_mode),
              true, false, in_working_set, next_order_++, /*bucketed=*/false, /*own_edge=*/{}});
    sweep_if_grown(dropped);
    return {cast, true};
  }

  // The weights may change: no copy is served again. Every copy is released (its memory is freed
  // once the graphs that saved it are gone, as before an optimizer step it should be); the
  // entries of the copies a training forward used in the ending generation stay, without their
  // copy, so that the first use of any of them re-casts them all at once.
  void invalidate() {
    std::vector<Entry> dropped;  // both destroyed after the lock is released
    std::vector<at::Tensor> released;
    std::lock_guard<std::mutex> lock(mutex_);
    ++generation_;
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (it->second.recast && it->second.served_now) {
        released.push_back(std::move(it->second.cast));
        released.push_back(std::move(it->second.own_edge));
        it->second.bucketed = false;
        it->second.served_now = false;
        it->second.in_working_set = true;  // the next step's batch
        ++it;
      } else {
        dropped.push_back(std::move(it->second));
        it = entries_.erase(it);
      }
    }
    working_set_ = entries_.size();
    made_in_generation_ = 0;
  }

  void clear() {
    std::unordered_map<Key, Entry, KeyHash> dropped;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      dropped.swap(entries_);
      live_after_sweep_ = 0;
      working_set_ = made_in_generation_ = 0;
      ++generation_;
    }
    // `dropped` releases the cached tensors here, outside the lock: freeing a tensor may run
    // deleters that must not re-enter the cache while it is locked.
  }

  // Drops the entries of `source` (every dtype and grad mode), before torch.utils.swap_tensors
  // hands its TensorImpl to another tensor (tensor_swap.h).
  // Looked up by key, not scanned: torch swaps a module's parameters one at a time, so a scan
  // made Module.to() and load_state_dict() of a model quadratic in its parameters.
  void forget(const c10::TensorImpl* source) {
    std::vector<Entry> dropped;  // destroyed after the lock is released (see clear())
    std::lock_guard<std::mutex> lock(mutex_);
    for (int t = 0; t < kDtypeCount; ++t) {
      if ((dtypes_cast_to_ >> t & 1) == 0) continue;
      for (const bool grad_mode : {false, true}) {
        const auto it = entries_.find(Key{source, static_cast<c10::ScalarType>(t), grad_mode});
        if (it == entries_.end()) continue;
        dropped.push_back(std::move(it->second));
        entries_.erase(it);
      }
    }
  }

  // Entries that would be served now (those waiting for their re-cast are not).
  std::size_t size() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::size_t current = 0;
    for (const auto& entry : entries_) current += entry.second.generation == generation_;
    return current;
  }

  std::size_t waiting_for_recast() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::size_t waiting = 0;
    for (const auto& entry : entries_) {
      waiting += entry.second.recast && entry.second.generation != generation_;
    }
    return waiting;
  }

 private:
  static const c10::StorageImpl* storage_of(const at::Tensor& t) {
    return t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
  }

  // The copy a use gets: the first use in a generation takes the entry's copy (and sets the order
  // of the next batch), a later use of a bucketed copy its alias (alias_with_own_edge says why).
  at::Tensor serve(Entry& e, const at::Tensor& source) {
    e.hit_since_sweep = true;
    if (!e.served_now) {
      e.served_now = true;
      e.order = next_order_++;
      return e.cast;
    }
    if (!e.bucketed) return e.cast;
    if (!e.own_edge.defined()) e.own_edge = alias_with_own_edge(e.cast, source);
    return e.own_edge;
  }

  using EntryIt = std::unordered_map<Key, Entry, KeyHash>::iterator;

  // Erases an entry; its copy and its alias go to `stale` (released by the caller, unlocked,
  // before it makes a replacement), the rest of it to `dropped`. Returns the next entry.
  EntryIt drop(EntryIt it, std::vector<at::Tensor>& stale, std::vector<Entry>& dropped) {
    stale.push_back(std::move(it->second.cast));
    stale.push_back(std::move(it->second.own_edge));
    dropped.push_back(std::move(it->second));
    return entries_.erase(it);
  }

  // Drops every entry holding a copy made outside `capture` (see get).
  void drop_copies_of_other_captures(std::uint64_t capture, std::vector<at::Tensor>& stale,
                                     std::vector<Entry>& dropped) {
    for (auto it = entries_.begin(); it != entries_.end();) {
      const Entry& e = it->second;
      const bool holds_a_copy = e.cast.defined() || e.own_edge.defined();
      it = holds_a_copy && e.capture != capture ? drop(it, stale, dropped) : std::next(it);
    }
  }

  static at::Tensor lock_source(const Entry& e) {
    auto impl = e.source.lock();
    if (!impl) return {};
    return at::Tensor(
        c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim(impl.release()));
  }

  // Why the capture is part of it: a CUDA graph reads the tensors its capture used by address.
  // A copy made before the capture and served inside it would be baked into the graph, and freed
  // at the next step while the replays still read it (torch.cuda.make_graphed_callables captures
  // a forward after eager warm-up forwards of the same step); a copy made inside a capture holds
  // nothing until the graph is replayed, so eager ops after the capture must not read it either.
  bool is_current(const Entry& e, const at::Tensor& source, std::uint64_t capture) const {
    return e.generation == generation_ && e.capture == capture && !e.source.expired() &&
           e.version == source._version() && e.storage == storage_of(source);
  }

  // Re-casts the `dtype` copies the previous generation's training forwards used, all at once
  // (BatchedCast): a step uses the copies the step before used, so the first use after the
  // weights may have changed makes them all. The gradient edge is each source's as it is now (a
  // parameter frozen or thawed since gets a gradient exactly when it wants one), through a bucket
  // of gradient conversions where it may (gradient_buckets.h). Sources that died or are no longer
  // plain and dense are dropped, and cast on their own if used again. `capture` is the capture on
  // `device`, where the first use was.
  void recast_previous_generation(c10::ScalarType dtype, const c10::Device& device,
                                  std::uint64_t capture, std::vector<Entry>& dropped) {
    std::vector<std::pair<Entry*, at::Tensor>> recast;  // entry, its source
    for (auto it = entries_.begin(); it != entries_.end();) {
      Entry& e = it->second;
      if (e.generation == generation_ || !e.recast || it->first.dtype != dtype) {
        ++it;
        continue;
      }
      at::Tensor source = lock_source(e);
      if (!source.defined() || !batch_recast(source, /*records_autograd=*/true)) {
        dropped.push_back(std::move(e));
        it = entries_.erase(it);
        continue;
      }
      if (!holds_its_data(source)) {  // waits on: re-cast with the next batch, once it does
        ++it;
        continue;
      }
      recast.emplace_back(&e, std::move(source));
      ++it;
    }
    // In the order the last generation first used them: the gradient buckets' order.
    std::sort(recast.begin(), recast.end(),
              [](const auto& a, const auto& b) { return a.first->order < b.first->order; });
    BatchedCast batch(dtype);
    for (const auto& r : recast) batch.add(r.second);
    std::vector<at::Tensor> copies = batch.run();
    GradientBuckets buckets;
    for (std::size_t i = 0; i < recast.size(); ++i) {
      auto& [e, source] = recast[i];
      e->bucketed = GradientBuckets::admits(source);
      if (e->bucketed) {
        buckets.add(copies[i], source);
      } else if (source.requires_grad()) {
        give_gradient_edge(copies[i], source);
      }
      e->cast = std::move(copies[i]);
      e->version = source._version();
      e->storage = storage_of(source);
      e->generation = generation_;
      e->capture = source.device() == device ? capture : ops::stream_capture_id(source.device());
      count_cast();
    }
  }

  // Once the map has doubled since the last sweep (amortized O(1) per insert), entries not served
  // since that sweep are dropped (a clock-style second chance), so the size stays within about
  // twice the set of tensors that are actually reused, except the working set: the entries the
  // previous step used (its next batch) and the first 2 x that many + 256 made in this
  // generation. Why: a step makes its copies before it serves any of them again, so a
  // clock alone drops the copies a forward made early while that forward still inserts (the first
  // sweep comes at the 64th entry) and a model with more cached tensors than that lost some every
  // step, and with them their place in the next step's batch. The working set grows to a model's
  // size within a few steps (one up to 256 tensors, 1000 in two); a loop that casts fresh tensors
  // without a step keeps at most the first 256 besides what the clock keeps.
  // Why not "source expired": a cast made under autograd holds its source through
  // its grad accumulator (autograd_cast.h), so a dead parameter is never expired while its
  // entry lives, and from Python its preserved PyObject adds a reference too, so no reference count
  // tells a dropped parameter from a live one. Dropping a live entry costs one cast later (and
  // its place in one batch).
  void sweep_if_grown(std::vector<Entry>& dropped) {
    if (entries_.size() < 2 * live_after_sweep_ + 64) return;
    for (auto it = entries_.begin(); it != entries_.end();) {
      const Entry& e = it->second;
      if ((e.hit_since_sweep || e.in_working_set) && e.source.use_count() > 1) {
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
  // Every dtype an entry was ever made for, one bit each (forget's keys).
  static constexpr int kDtypeCount = static_cast<int>(c10::ScalarType::NumOptions);
  static_assert(kDtypeCount <= 64, "dtypes_cast_to_ holds one bit per ScalarType");
  std::uint64_t dtypes_cast_to_ = 0;
  std::size_t live_after_sweep_ = 0;
  std::uint64_t generation_ = 0;
  std::uint64_t next_order_ = 0;  // Entry::order
  // The working set (sweep_if_grown): the entries the last generation ended with, and how many
  // this generation has made; the first 2 x working_set_ + kWorkingSetFloor it makes belong to it.
  static constexpr std::size_t kWorkingSetFloor = 256;
  std::size_t working_set_ = 0;
  std::size_t made_in_generation_ = 0;
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

std::size_t cache_entries_waiting_for_recast() { return cache().waiting_for_recast(); }

void forget_casts_of(const c10::TensorImpl* source) { cache().forget(source); }

}  // namespace amp::detail

namespace amp {

void clear_cache() {
  detail::cache().clear();
  detail::drop_companions();  // this thread's: the other threads drop theirs at their step ends
}
std::size_t cache_size() { return detail::cache().size(); }
std::int64_t cast_count() { return detail::g_cast_count.load(std::memory_order_relaxed); }

}  // namespace amp
