#include "session.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <vector>

namespace amp::detail {

LevelRules level_rules_for(const Properties& p) {
  LevelRules r;
  if (!p.enabled) return r;  // enabled=False: every call runs as without optamp
  r.low = p.low_dtype();
  r.verbosity = p.verbosity;
  r.op_lists = p.op_lists;
  r.rules_under_no_grad = p.rules_under_no_grad;
  r.ungated = p.model_cast() == ModelCast::kInPlace;
  if (!p.casts()) return r;
  // The lists at O1/O4; at the model levels, the rules of the level when the model is cast (Apex
  // cast no op when it did not cast the model).
  switch (p.opt_level) {
    case OptLevel::O1:
    case OptLevel::O4:
      r.rules = RuleSet::kFullLists;
      break;
    case OptLevel::O2:
    case OptLevel::O5:
      r.rules = RuleSet::kMasterWeights;
      break;
    default:  // O3, and O0 with a reduced cast_model_type
      r.rules = RuleSet::kPureLow;
  }
  return r;
}

const ParameterRecord* Session::find_parameter(const at::Tensor& t) const {
  const auto it = parameters.find(t.unsafeGetTensorImpl());
  if (it == parameters.end() || !it->second.ref->is(t.unsafeGetTensorImpl())) {
    return nullptr;
  }
  return &it->second;
}

namespace {

// The published session and its version. Readers compare the version with the one their
// snapshot has (one acquire load) and take the lock only when it moved: std::atomic_load of a
// shared_ptr takes a global lock in libstdc++ on every call, which every kernel call would pay.
struct Published {
  std::mutex changes;  // lock_session_changes()
  std::mutex mutex;    // guards `session` and `left_by_ended_threads`
  std::shared_ptr<const Session> session = std::make_shared<Session>();
  std::atomic<std::uint64_t> version{1};
  // Replaced sessions whose last holder was a thread that ended (~Snapshot): released by the next
  // publish, on the publishing thread.
  std::vector<std::shared_ptr<const Session>> left_by_ended_threads;
};

Published& published() {
  static auto* instance = new Published();  // leaked: read by kernels until process exit
  return *instance;
}

struct Snapshot {
  std::uint64_t version = 0;
  std::shared_ptr<const Session> session;

  Snapshot() = default;
  Snapshot(const Snapshot&) = delete;
  Snapshot& operator=(const Snapshot&) = delete;
  ~Snapshot();
};

// A thread that ends may hold the last reference to a session replaced since its last call, and
// must not destroy it. The autograd engine's device threads run our kernels in every CUDA backward
// and end only when the process exits (the engine's static destructor stops them), by which time
// the CUDA runtime may be shutting down: a loss scaler's event or pinned buffer destroyed then
// throws from a noexcept destructor and the process aborts after a test has passed (seen on an
// H200 after `reset`). So the ending thread leaves a replaced session to the published state; the
// next publish releases it on the thread that publishes, and at exit it is never destroyed.
Snapshot::~Snapshot() {
  if (!session) return;
  auto& p = published();
  std::lock_guard<std::mutex> lock(p.mutex);
  // Dropped under the lock while `p` holds a reference too, so this is never the last one.
  const bool held_elsewhere =
      session == p.session ||
      std::find(p.left_by_ended_threads.begin(), p.left_by_ended_threads.end(), session) !=
          p.left_by_ended_threads.end();
  if (held_elsewhere) {
    session.reset();
  } else {
    p.left_by_ended_threads.push_back(std::move(session));
  }
}

const std::shared_ptr<const Session>& refreshed_snapshot() {
  thread_local Snapshot snapshot;
  auto& p = published();
  if (C10_UNLIKELY(snapshot.version != p.version.load(std::memory_order_acquire))) {
    std::lock_guard<std::mutex> lock(p.mutex);
    snapshot.session = p.session;
    snapshot.version = p.version.load(std::memory_order_relaxed);
  }
  return snapshot.session;
}

}  // namespace

std::shared_ptr<const Session> current_session() { return refreshed_snapshot(); }

LevelRules current_level_rules() { return refreshed_snapshot()->rules; }

std::unique_lock<std::mutex> lock_session_changes() {
  return std::unique_lock<std::mutex>(published().changes);
}

std::shared_ptr<const Session> publish_session(std::shared_ptr<const Session> next) {
  auto& p = published();
  std::vector<std::shared_ptr<const Session>> left;
  {
    std::lock_guard<std::mutex> lock(p.mutex);
    std::swap(p.session, next);
    p.version.fetch_add(1, std::memory_order_release);
    left.swap(p.left_by_ended_threads);
  }
  // Both released outside the lock (a scaler's tensors may run deleters): `left` here, the
  // replaced session by the caller.
  return next;
}

void edit_session(const std::function<void(Session&)>& edit) {
  auto lock = lock_session_changes();
  std::shared_ptr<const Session> current;
  {
    auto& p = published();
    std::lock_guard<std::mutex> read(p.mutex);
    current = p.session;
  }
  auto next = std::make_shared<Session>(*current);
  edit(*next);
  publish_session(std::move(next));
}

}  // namespace amp::detail
