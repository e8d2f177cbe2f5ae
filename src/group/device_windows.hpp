#pragma once
// all_reduce on device buffers between the processes of one host, peer to peer (issue 17, part 4;
// docs/DESIGN.md, "Device windows"): every rank's device reads every rank's window (device memory opened
// through IpcHandles, gpu::detail::PeerWindow) instead of staging through host memory and the network.
//
//   caller's stream: [work queued before] -> gate -> [later work]
//   window's stream:  (after the work before) -> input into the own window -> the peer kernel -> output
//   loop:             its turn -> agree (a 16-byte all_reduce: the windows' size) -> [new windows: exchange
//                     the handles, open them, agree that every rank could] -> queue -> await -> open the gate
//
// Opt-in (WEFT_DEVICE_IPC=1 on every rank): then every rank passes device buffers to all_reduce (a rank that
// passes host ones fails as a mismatch, named). Where a rank cannot make or open a window (IPC refused),
// every rank falls back, for the group's life, to a copy through pinned memory and the host all_reduce.
#include <chrono>
#include <memory>

#include "weft/future.hpp"
#include "weft/gpu.hpp"

namespace weft::detail {

struct GroupState;
struct CollectiveCall;
struct DeviceWindows;  // device_windows.cpp: the group's window and the calls' turns

/// Whether `call` runs on device windows: WEFT_DEVICE_IPC=1, an all_reduce whose input and output are
/// device memory of one device, on a group of 2 to 8 ranks all on this host. Nothing in it depends on
/// what happened before, so every rank that passes device buffers answers the same.
bool takes_device_windows(const GroupState& g, const CollectiveCall& call);

/// Runs it: the fence and the gate in the caller's stream's order now (none where `stream` is null: the
/// buffers are ready at the call), then the sequence number. Errors: invalid_argument at once (a stream
/// of another device or loop, bad device memory); mismatch (a rank called it on host buffers);
/// device_failure (the group aborted); peer_failure or the group's failure where a peer failed or left
/// while this rank's device waited for it; a deadline as any collective's.
/// Cancellation: before the kernels are queued, as any collective; after, the call waits for them (the
/// peers' devices meet this one's at the same barriers).
Future<void> run_on_device_windows(const std::shared_ptr<GroupState>& g, gpu::Stream* stream, const CollectiveCall& call,
                                   std::chrono::milliseconds timeout);

}  // namespace weft::detail
