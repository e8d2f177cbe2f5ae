#pragma once
// Whether a peer can read a buffer of this process with process_vm_readv: the check a lender makes
// before it hands out a buffer's address (the arena's direct reads, a ring's reference records).
//
// Why it is needed: the link probes prove that a peer can read this process's ordinary memory, not every
// buffer a caller passes. The kernel pins the pages it copies from, and refuses (EFAULT) memory it cannot
// pin: a driver's mapping (VM_IO / VM_PFNMAP, as CUDA's pinned and managed host memory can be: Open MPI
// and UCX users met exactly this, openucx/ucx#6058 and #7194) or memfd_secret memory. The owner still
// reads and writes such memory as any other, so a collective on it must work; a lender that finds its
// buffer unreadable lends a copy in ordinary memory instead (group/shm_collectives.cpp), and a ring
// writes it inline. The check is the kernel's own: this process reads the buffer's first and last byte
// of itself, one system call (about 2 us on this project's VMs), made only where a buffer is lent.
#include <cstddef>

namespace weft::shm {

/// The kernel's copy (process_vm_readv of this process's own memory, as the arena's direct reads go)
/// against memcpy, each the fastest of a few rounds, both between the same two warm buffers.
struct KernelCopyCost {
  double kernel_us = 0;
  double memcpy_us = 0;
  /// Whether reading a peer's buffer directly loses to copying through shared memory (a copy in, a
  /// copy out): where the kernel's copy takes at least kernel_copy_slow_ratio times memcpy's, two
  /// copies win even if the one between cores costs memcpy's twice. On the project's Intel Xeon the
  /// kernel copied 256 KiB in 1.9x memcpy's time (between two processes) and direct reads won 1.65-2.5x;
  /// on its AMD EPYC 3.9-5.0x, and they lost 1.2-1.7x (bench/RESULTS.md, "The kernel's copy measured at
  /// set-up").
  bool slow() const noexcept;
};
inline constexpr double kernel_copy_slow_ratio = 3.0;

/// Measures KernelCopyCost on `bytes` (256 KiB: three bursts of `rounds` rounds, about 0.3 ms of copies
/// spread over 1-2 ms, plus faulting in the buffers). The kernel's time is 0 where process_vm_readv
/// fails (then nothing reads directly anyway).
KernelCopyCost measure_kernel_copy(std::size_t bytes = std::size_t{256} << 10, int rounds = 5) noexcept;

/// True when process_vm_readv can read [data, data + bytes) of this process (its first and last byte:
/// a buffer that spans several mappings, one of them unreadable in its middle, is not caught, and its
/// reader fails with EFAULT as before). True for bytes == 0.
bool kernel_can_read(const void* data, std::size_t bytes) noexcept;

}  // namespace weft::shm
