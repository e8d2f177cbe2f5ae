#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

#include <csignal>
#include <cstring>
#include <ctime>

#include <execinfo.h>
#include <fcntl.h>
#include <malloc.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "core/sanitizer.hpp"

#if defined(WEFT_UNDER_THREAD_SANITIZER)
// libstdc++ is not built with ThreadSanitizer: an exception's reference count (exception_ptr's, and
// __cxa_end_catch's) is atomic there but invisible to it. A failure rethrown on one thread (a Future's
// caller) and let go last on another (the loop that published it, which must hold the state while it
// does) then looks like a race between the reader of its message and the exception's destructor. Only
// reports with those frames are passed over (docs/RELIABILITY.md, "Sanitizers").
extern "C" const char* __tsan_default_suppressions() {
  return "race:std::__exception_ptr::exception_ptr::_M_release\n"
         "race:std::runtime_error::~runtime_error\n";
}
#endif

namespace {

// The suites allocate and free megabyte buffers for every dtype, op and rank. glibc gives each back to
// the kernel (an mmap of its own, or a trimmed heap), and the next one faults its pages in again: on
// this project's VMs a page fault is dear (collectives p8 over tcp spent 60 % of its 30 s there, with the
// MALLOC_PERTURB_ that meson sets; 12 s with these). Freed memory stays with the process instead.
const bool malloc_keeps_memory = [] {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's largest: bigger blocks are still mapped on their own
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  return true;
}();

// Where a test died or hung, for runs whose machine is gone by the time the log is read (the GPU
// machine: 2026-12-04 a case segfaulted and another timed out there, and nothing said where). A crash
// prints the faulting thread's stack; SIGTERM (timeout's, meson's at its bound) prints every thread's,
// one thread at a time, then ends the process as SIGTERM would. Catch2's own handler runs first while a
// test runs (it names the test case), then restores these and raises the signal again.
// Only calls that are safe in a signal handler, apart from backtrace(), called once up front so that
// it has loaded its unwinder before the first signal. The addresses are resolved with
// `addr2line -f -C -e PROGRAM ADDRESS` against the same binary.
void say(const char* text) { (void)!::write(STDERR_FILENO, text, std::strlen(text)); }

void say_number(long value) {
  char digits[24];
  int at = sizeof digits;
  digits[--at] = '\0';
  const bool negative = value < 0;
  unsigned long rest = negative ? 0UL - static_cast<unsigned long>(value) : static_cast<unsigned long>(value);
  do {
    digits[--at] = static_cast<char>('0' + rest % 10);
    rest /= 10;
  } while (rest != 0 && at > 1);
  if (negative) digits[--at] = '-';
  say(digits + at);
}

void print_stack(const char* why, int signal) {
  void* frames[64];
  const int depth = backtrace(frames, 64);
  say("=== weft test: ");
  say(why);
  say(" (signal ");
  say_number(signal);
  say(") in thread ");
  say_number(static_cast<long>(::syscall(SYS_gettid)));
  say(":\n");
  backtrace_symbols_fd(frames, depth, STDERR_FILENO);
}

constexpr int stack_request = SIGUSR2;

extern "C" void on_stack_request(int signal) { print_stack("asked for its stack", signal); }

extern "C" void on_crash(int signal) {
  print_stack("crashed", signal);
  std::signal(signal, SIG_DFL);
  std::raise(signal);  // delivered once this returns (the signal is blocked in its handler)
}

extern "C" void on_terminate(int signal) {
  const long self = ::syscall(SYS_gettid);
  const int tasks = ::open("/proc/self/task", O_RDONLY | O_DIRECTORY);
  alignas(8) char entries[4096];
  long bytes = 0;
  int asked = 0;
  while (tasks >= 0 && asked < 128 && (bytes = ::syscall(SYS_getdents64, tasks, entries, sizeof entries)) > 0) {
    for (long at = 0; at < bytes;) {
      // struct linux_dirent64: u64 inode, s64 offset, u16 record length, u8 type, then the name.
      unsigned short length;
      std::memcpy(&length, entries + at + 16, sizeof length);
      const char* name = entries + at + 19;
      at += length;
      long tid = 0;
      for (const char* c = name; *c >= '0' && *c <= '9'; ++c) tid = tid * 10 + (*c - '0');
      if (tid <= 0 || tid == self) continue;
      ::syscall(SYS_tgkill, ::getpid(), tid, stack_request);
      ++asked;
      const timespec pause{0, 20'000'000};  // one thread's stack at a time
      ::nanosleep(&pause, nullptr);
    }
  }
  if (tasks >= 0) ::close(tasks);
  print_stack("terminated", signal);
  std::signal(signal, SIG_DFL);
  std::raise(signal);
}

void install(int signal, void (*handler)(int)) {
  struct sigaction now{};
  // Left alone where something else handles it already (AddressSanitizer's reports).
  if (::sigaction(signal, nullptr, &now) != 0 || now.sa_handler != SIG_DFL) return;
  struct sigaction wanted{};
  wanted.sa_handler = handler;
  sigemptyset(&wanted.sa_mask);
  wanted.sa_flags = SA_RESTART;
  ::sigaction(signal, &wanted, nullptr);
}

const bool stacks_printed = [] {
  void* warm[1];
  (void)backtrace(warm, 1);
  install(stack_request, on_stack_request);
  for (int signal : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) install(signal, on_crash);
  install(SIGTERM, on_terminate);
  return true;
}();

}  // namespace
