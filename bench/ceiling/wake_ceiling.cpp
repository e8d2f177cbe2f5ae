// How long the first message after idling takes on this host without weft: the floor under issue 15's
// "first message after 10 ms idle < 50 us" (bench/RESULTS.md, "The first message after idling, again").
// Two processes and an eventfd each way: the sender sleeps 10 ms, stamps CLOCK_MONOTONIC into shared
// memory and writes the eventfd; the receiver, blocked in read(), takes the difference.
//   wake-ceiling SENDER_CPU RECEIVER_CPU [ROUNDS]   a CPU of -1 leaves that process unpinned
// Prints the median, p90 and min in us. On a VM, a wake-up that must reach another, halted, vCPU costs the
// hypervisor's wake-up; one that lands on the writer's CPU does not.
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

std::int64_t now_ns() { return std::chrono::steady_clock::now().time_since_epoch().count(); }

void pin(int cpu) {
  if (cpu < 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (sched_setaffinity(0, sizeof set, &set) != 0) std::perror("sched_setaffinity");
}

void write_one(int fd) {
  const std::uint64_t one = 1;
  if (::write(fd, &one, sizeof one) != sizeof one) std::perror("write");
}

void read_one(int fd) {
  std::uint64_t value = 0;
  if (::read(fd, &value, sizeof value) != sizeof value) std::perror("read");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: wake-ceiling SENDER_CPU RECEIVER_CPU [ROUNDS]\n");
    return 2;
  }
  const int sender_cpu = std::atoi(argv[1]);
  const int receiver_cpu = std::atoi(argv[2]);
  const int rounds = argc > 3 ? std::max(1, std::atoi(argv[3])) : 60;
  const int go = eventfd(0, 0);
  const int back = eventfd(0, 0);
  void* page = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (go < 0 || back < 0 || page == MAP_FAILED) {
    std::perror("wake-ceiling");
    return 1;
  }
  auto* stamp = static_cast<volatile std::int64_t*>(page);
  const pid_t child = fork();
  if (child == 0) {
    pin(receiver_cpu);
    std::vector<double> us;
    for (int i = 0; i < rounds; ++i) {
      read_one(go);
      us.push_back(static_cast<double>(now_ns() - *stamp) / 1000.0);
      write_one(back);
    }
    std::sort(us.begin(), us.end());
    std::printf("sender cpu %d, receiver cpu %d: %d rounds, median %.1f us, p90 %.1f us, min %.1f us\n", sender_cpu, receiver_cpu,
                rounds, us[us.size() / 2], us[us.size() * 9 / 10], us.front());
    return 0;
  }
  pin(sender_cpu);
  for (int i = 0; i < rounds; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    *stamp = now_ns();
    write_one(go);
    read_one(back);
  }
  int status = 0;
  waitpid(child, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}
