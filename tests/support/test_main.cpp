#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

#include <malloc.h>

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

}  // namespace
