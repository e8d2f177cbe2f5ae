#include "weft/offload.hpp"

#include <algorithm>
#include <atomic>
#include <cstdlib>

#include "core/env.hpp"

namespace weft {
namespace {
std::atomic<int> running_jobs{0};
}

int detail::compute_jobs_running() noexcept { return running_jobs.load(std::memory_order_relaxed); }

ComputePool::ComputePool(unsigned threads) {
  if (threads == 0) {
    threads = static_cast<unsigned>(detail::env_count_or("WEFT_COMPUTE_THREADS", 0, 1, 1024));  // refused by Loop()
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
    running_jobs.fetch_add(1, std::memory_order_relaxed);
    job();
    running_jobs.fetch_sub(1, std::memory_order_relaxed);
  }
}

ComputePool& ComputePool::shared() {
  // Never destroyed: coroutines may still offload while static destructors run.
  static ComputePool* pool = new ComputePool();
  return *pool;
}

}  // namespace weft
