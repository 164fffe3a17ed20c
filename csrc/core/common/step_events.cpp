#include "common/step_events.h"

#include <algorithm>
#include <mutex>
#include <vector>

namespace amp::detail {
namespace {

struct Listeners {
  std::mutex mutex;
  std::vector<StepListener> list;
};

Listeners& listeners() {
  static Listeners instance;  // constructed on first use: safe from static initializers
  return instance;
}

}  // namespace

void add_weights_may_change_listener(StepListener listener) {
  auto& l = listeners();
  std::lock_guard<std::mutex> lock(l.mutex);
  if (std::find(l.list.begin(), l.list.end(), listener) == l.list.end()) l.list.push_back(listener);
}

void notify_weights_may_change() {
  std::vector<StepListener> copy;
  {
    auto& l = listeners();
    std::lock_guard<std::mutex> lock(l.mutex);
    copy = l.list;
  }
  for (StepListener listener : copy) listener();
}

}  // namespace amp::detail
