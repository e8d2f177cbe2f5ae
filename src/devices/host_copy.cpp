// host_copy.hpp: a large host copy cut into parts, one per thread, the caller's included.
//
// The helpers take parts from one queue. A caller puts its parts there, copies its own, then takes back
// whichever of its parts no helper took yet (helpers busy with another caller's copy never hold it
// up), and waits only for parts a helper is copying now.
#include "devices/host_copy.hpp"

#include <sched.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "core/env.hpp"

namespace weft::gpu::detail {
namespace {

// Parts start on a page: two threads never write one cache line, and the copies stay aligned.
constexpr std::size_t part_alignment = 4096;

struct Copy {
  int parts_left = 0;  // guarded by Helpers::mutex_
  std::condition_variable done;
};

struct Part {
  Copy* copy;
  std::byte* dst;
  const std::byte* src;
  std::size_t bytes;
};

class Helpers {
 public:
  explicit Helpers(unsigned count) {
    for (unsigned i = 0; i < count; ++i) std::thread([this] { serve(); }).detach();
  }

  void copy(std::byte* dst, const std::byte* src, std::size_t bytes, unsigned threads) {
    // Equal parts, cut at pages; the first is the caller's.
    const std::size_t each = (bytes / threads + part_alignment - 1) / part_alignment * part_alignment;
    Copy copy;
    std::vector<Part> mine;
    {
      std::lock_guard lock(mutex_);
      for (std::size_t at = each; at < bytes; at += each) {
        queue_.push_back(Part{&copy, dst + at, src + at, std::min(each, bytes - at)});
        ++copy.parts_left;
      }
    }
    work_.notify_all();
    std::memcpy(dst, src, std::min(each, bytes));
    std::unique_lock lock(mutex_);
    for (auto it = queue_.begin(); it != queue_.end();) {
      if (it->copy == &copy) {
        mine.push_back(*it);
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
    lock.unlock();
    for (const Part& part : mine) std::memcpy(part.dst, part.src, part.bytes);
    lock.lock();
    copy.parts_left -= static_cast<int>(mine.size());
    copy.done.wait(lock, [&] { return copy.parts_left == 0; });
  }

 private:
  [[noreturn]] void serve() {
    std::unique_lock lock(mutex_);
    for (;;) {
      work_.wait(lock, [&] { return !queue_.empty(); });
      const Part part = queue_.front();
      queue_.pop_front();
      lock.unlock();
      std::memcpy(part.dst, part.src, part.bytes);
      lock.lock();
      if (--part.copy->parts_left == 0) part.copy->done.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable work_;
  std::deque<Part> queue_;
};

unsigned threads_from_environment() {
  // Refused by Loop() when malformed (WEFT_COPY_THREADS=abc was 1 thread, silently).
  if (const long long set = weft::detail::env_count_or("WEFT_COPY_THREADS", 0, 1, 64); set > 0) return static_cast<unsigned>(set);
  // Half the CPUs, at most 4: the loop's thread, the device's host functions and the program's own
  // threads need the rest. (On a 2-core VM, 2 threads copied a staged 64 MiB at 3.3-8 GB/s against one
  // thread's 6.3-7.0 through the simulated device: the helper waited for a core.)
  cpu_set_t set;
  const int allowed = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
  return static_cast<unsigned>(std::clamp(allowed / 2, 1, 4));
}

}  // namespace

unsigned host_copy_threads() {
  static const unsigned threads = threads_from_environment();
  return threads;
}

void host_copy(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;  // an empty view's pointers may be null, which memcpy may not be given (UBSan)
  const unsigned threads = std::min<std::size_t>(host_copy_threads(), std::max<std::size_t>(1, bytes / (host_copy_split_from / 2)));
  if (bytes < host_copy_split_from || threads <= 1) {
    std::memcpy(dst, src, bytes);
    return;
  }
  // Kept for the process's life (never destroyed): a copy may still run in a device's host function
  // while the process exits, and its helpers must not be joined or freed under it.
  static Helpers* const helpers = new Helpers(host_copy_threads() - 1);
  helpers->copy(static_cast<std::byte*>(dst), static_cast<const std::byte*>(src), bytes, threads);
}

}  // namespace weft::gpu::detail
