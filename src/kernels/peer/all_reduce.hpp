#pragma once
// The in-process multi-device all_reduce's protocol and algorithms (issue 17), written once for the GPU
// (nvcc: every function is __host__ __device__) and for the simulated device (host threads, one per
// (device, block)), templated on the atomic operations so that the sim runs the very code the kernels
// run, under ThreadSanitizer. Header-only; plain data and pointers, no allocation, no library calls.
//
// Each device runs one instance with the same number of blocks; block b of every device handles the same
// elements and synchronises only with block b of the others (no grid-wide barrier), as in vLLM's custom
// all-reduce (csrc/custom_all_reduce.cuh) and Mojo's allreduce: ../shared/design/gpu.md, section 2.
//
//   barrier   Each device owns a Signal (zeroed, or filled with one value, once, when the set of devices is
//             made; never reset). A call bumps its block's flag; the block stores the flag into every
//             device's start[b][rank] (release) and waits until its own start[b][i] holds the flag for
//             every i (acquire); the same on `end` at the end. Only equality is asked of the flags, so
//             they may wrap (uint32). Two arrays because a fast device can reach a call's end barrier
//             while a slow one still waits at its start: a single array would let the second write
//             satisfy the first wait. A device cannot be two barriers ahead: leaving `end` needs every
//             device there, and the next `start` is the next call's.
//   one_stage Every device reads every input (the peers' through their pointers: P2P) and writes its
//             own output, accumulating in rank order 0..n-1, so every device's output is bitwise the
//             same. start, compute, end: `end` keeps a device's input from being written (by its next
//             work) while a peer still reads it. Outputs must not alias inputs (a device would write
//             its output over what a peer is still reading): in place takes the two-stage form.
//   two_stage Reduce-scatter into each device's scratch (`tmp`, a slice per device), barrier (end,
//             release/acquire: the scratch is read by the peers next), then all-gather from every
//             device's scratch into the own output. Inputs are read only before the barrier, so the
//             output may be the input (in place). A slice of the scratch is rewritten only by the next
//             call's first stage, after that call's start barrier, when every peer has left this one.
//
// Atomics (a type with static functions): store_release(std::uint32_t*, std::uint32_t),
// load_acquire(const std::uint32_t*), pause(std::uint64_t spins) -> bool: between looks at a flag;
// false gives up (a bounded spin in debug builds and tests: the algorithm then returns false instead of
// hanging the device), sync_block(): every lane of the block meets (__syncthreads on the GPU, nothing on
// the sim, whose blocks have one lane), and sync_block_all(bool) -> bool: the same, and true when every
// lane passed true (__syncthreads_and). A block's lanes (its threads: `lane` of `lanes`) stride over its
// elements and share the barrier's peers (lane i arrives at and waits for device i, as in vLLM); when
// one gives up, every lane of the block returns false together.
#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define WEFT_PEER_FN __host__ __device__ inline
#else
#define WEFT_PEER_FN inline
#endif

namespace weft::kernels::peer {

inline constexpr int max_devices = 8;
inline constexpr int max_blocks = 64;

/// One device's signals, in memory every device of the set can reach (device memory with P2P; host
/// memory on the sim).
struct alignas(128) Signal {
  std::uint32_t start[max_blocks][max_devices];
  std::uint32_t end[max_blocks][max_devices];
  std::uint32_t flag[max_blocks];  // this device's count per block: only its own block b touches it
};

/// What one device's instance sees.
struct Devices {
  int rank = 0;  // this device's place in the set
  int n = 1;     // devices in the set (1 <= n <= max_devices)
  Signal* signals[max_devices] = {};  // every device's, signals[rank] its own
  /// Where the host says give up (non-zero), looked at every 256th spin of a barrier's wait; null: never.
  /// The devices of several processes (ImportedBuffer windows) wait for peers that a failed process's
  /// host will never launch: its group's failure sets this word, so the spin ends and the call fails.
  const std::uint32_t* abort = nullptr;
};

/// Block b's share of `count` elements split over `blocks`: [first, last).
struct Range {
  std::size_t first, last;
};
WEFT_PEER_FN Range share(std::size_t count, int part, int parts) {
  const std::size_t p = static_cast<std::size_t>(parts);
  const std::size_t i = static_cast<std::size_t>(part);
  return Range{count * i / p, count * (i + 1) / p};
}

template <class Atomics>
struct Barrier {
  /// Tells device `peer` that this block arrived (one thread per peer on the GPU).
  WEFT_PEER_FN static void arrive(std::uint32_t (*arrays)[max_devices], int block, int rank, std::uint32_t flag) {
    Atomics::store_release(&arrays[block][rank], flag);
  }
  /// Waits until device `peer`'s block arrived; false if the spin was given up.
  WEFT_PEER_FN static bool wait(const std::uint32_t (*arrays)[max_devices], int block, int peer, std::uint32_t flag,
                                const std::uint32_t* abort = nullptr) {
    for (std::uint64_t spins = 0; Atomics::load_acquire(&arrays[block][peer]) != flag; ++spins) {
      if (!Atomics::pause(spins)) return false;
      if (abort && (spins & 255) == 255 && Atomics::load_acquire(abort) != 0) return false;
    }
    return true;
  }

  /// The next flag of block `block` of this device (a call's, used by both its barriers): every lane
  /// reads the count, the lanes meet, lane 0 stores the count + 1 (no other block touches it, and the
  /// next call's lanes read it after this kernel ended).
  WEFT_PEER_FN static std::uint32_t next_flag_of_block(const Devices& d, int block, int lane) {
    Signal& self = *d.signals[d.rank];
    const std::uint32_t flag = self.flag[block] + 1u;  // wraps
    Atomics::sync_block();
    if (lane == 0) self.flag[block] = flag;
    return flag;
  }
  /// Every device's block `block` at this point of the call with `flag` (start: `at_start` true). The
  /// block's lanes meet first (what they wrote is then ordered before the release), share the peers,
  /// and meet again once every peer arrived.
  WEFT_PEER_FN static bool all_arrive(const Devices& d, int block, int lane, int lanes, std::uint32_t flag, bool at_start) {
    Atomics::sync_block();
    for (int i = lane; i < d.n; i += lanes) arrive(at_start ? d.signals[i]->start : d.signals[i]->end, block, d.rank, flag);
    const Signal& self = *d.signals[d.rank];
    bool ok = true;
    for (int i = lane; ok && i < d.n; i += lanes) ok = wait(at_start ? self.start : self.end, block, i, flag, d.abort);
    return Atomics::sync_block_all(ok);  // every lane meets, and learns whether one gave up
  }
};

/// One block's part of the one-stage all_reduce: out[i] = epilogue(in_0[i] op in_1[i] op ... in_{n-1}[i], i)
/// for this block's share of the elements. `Op`: a functor on T; `Epilogue`: (T, std::size_t index) -> Out,
/// called once per element as it is stored. Returns false if a barrier's spin was given up.
template <class Atomics, class T, class Out, class Op, class Epilogue>
WEFT_PEER_FN bool one_stage(const Devices& d, int block, int blocks, int lane, int lanes, const T* const* inputs, Out* out,
                            std::size_t count, Op op, Epilogue epilogue) {
  using B = Barrier<Atomics>;
  const std::uint32_t flag = B::next_flag_of_block(d, block, lane);
  if (!B::all_arrive(d, block, lane, lanes, flag, true)) return false;
  const Range r = share(count, block, blocks);
  for (std::size_t i = r.first + static_cast<std::size_t>(lane); i < r.last; i += static_cast<std::size_t>(lanes)) {
    T acc = inputs[0][i];
    for (int k = 1; k < d.n; ++k) acc = op(acc, inputs[k][i]);
    out[i] = epilogue(acc, i);
  }
  return B::all_arrive(d, block, lane, lanes, flag, false);
}

/// One block's part of the two-stage all_reduce. `tmp[k]`: device k's scratch, at least
/// share(count, k, n) elements. The output may be this device's input.
template <class Atomics, class T, class Out, class Op, class Epilogue>
WEFT_PEER_FN bool two_stage(const Devices& d, int block, int blocks, int lane, int lanes, const T* const* inputs, Out* out,
                            T* const* tmp, std::size_t count, Op op, Epilogue epilogue) {
  using B = Barrier<Atomics>;
  const std::uint32_t flag = B::next_flag_of_block(d, block, lane);
  if (!B::all_arrive(d, block, lane, lanes, flag, true)) return false;
  // Reduce-scatter: this device's slice, this block's share of it, into the own scratch.
  const Range mine = share(count, d.rank, d.n);
  const Range part = share(mine.last - mine.first, block, blocks);
  const auto step = static_cast<std::size_t>(lanes);
  for (std::size_t j = part.first + static_cast<std::size_t>(lane); j < part.last; j += step) {
    const std::size_t i = mine.first + j;
    T acc = inputs[0][i];
    for (int k = 1; k < d.n; ++k) acc = op(acc, inputs[k][i]);
    tmp[d.rank][j] = acc;
  }
  if (!B::all_arrive(d, block, lane, lanes, flag, false)) return false;
  // All-gather: every device's slice (the same share of it that its block `block` wrote) into the output.
  for (int k = 0; k < d.n; ++k) {
    const Range slice = share(count, k, d.n);
    const Range p = share(slice.last - slice.first, block, blocks);
    for (std::size_t j = p.first + static_cast<std::size_t>(lane); j < p.last; j += step) out[slice.first + j] = epilogue(tmp[k][j], slice.first + j);
  }
  return true;
}

}  // namespace weft::kernels::peer
