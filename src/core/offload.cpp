#include "weft/offload.hpp"

#include <algorithm>
#include <cstdlib>

namespace weft {

ComputePool::ComputePool(unsigned threads) {
  if (threads == 0) {
    if (const char* v = std::getenv("WEFT_COMPUTE_THREADS"); v && std::atoi(v) > 0) threads = static_cast<unsigned>(std::atoi(v));
  }
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  threads_.reserve(threads);
  for (unsigned i = 0; i < threads; ++i) threads_.emplace_back([this] { work(); });
}

ComputePool::~ComputePool() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  ready_.notify_all();
  for (auto& t : threads_) t.join();
}

void ComputePool::submit(std::function<void()> job) {
  {
    std::lock_guard lock(mutex_);
    jobs_.push_back(std::move(job));
  }
  ready_.notify_one();
}

void ComputePool::work() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock lock(mutex_);
      ready_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, and everything submitted has run
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
  }
}

ComputePool& ComputePool::shared() {
  // Never destroyed: coroutines may still offload while static destructors run.
  static ComputePool* pool = new ComputePool();
  return *pool;
}

}  // namespace weft
