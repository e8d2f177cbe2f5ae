// The Gloo side of bench/RESULTS.md: Gloo's all-reduce algorithms (ring, ring_chunked, halving_doubling,
// bcube), f32 sum over its TCP transport on loopback, timed like weft-bench; prints each and the best.
// Ranks come from weft-run's environment; rendezvous through a file store. Not part of weft.
//   weft-run -n 2 -- gloo-allreduce-bench MINBYTES MAXBYTES FACTOR ITERS
#include <gloo/allreduce_bcube.h>
#include <gloo/allreduce_halving_doubling.h>
#include <gloo/allreduce_ring.h>
#include <gloo/allreduce_ring_chunked.h>
#include <gloo/barrier_all_to_one.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  const int rank = std::atoi(std::getenv("WEFT_RANK"));
  const int size = std::atoi(std::getenv("WEFT_WORLD_SIZE"));
  const std::string job = std::getenv("WEFT_STORE");
  const long min_bytes = argc > 1 ? std::atol(argv[1]) : 8;
  const long max_bytes = argc > 2 ? std::atol(argv[2]) : 1 << 26;
  const long factor = argc > 3 ? std::atol(argv[3]) : 2;
  const int iters = argc > 4 ? std::atoi(argv[4]) : 20;
  std::string dir = "/tmp/gloo-store-" + job.substr(job.rfind(':') + 1);
  std::filesystem::create_directories(dir);
  gloo::transport::tcp::attr attr;
  // GLOO_HOSTNAME: the address to listen on where ranks are not on loopback (bench/hosts.sh's namespaces).
  const char* hostname = std::getenv("GLOO_HOSTNAME");
  attr.hostname = hostname && *hostname ? hostname : "127.0.0.1";
  auto device = gloo::transport::tcp::CreateDevice(attr);
  gloo::rendezvous::FileStore file_store(dir);
  gloo::rendezvous::PrefixStore store("bench", file_store);
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
  context->connectFullMesh(store, device);
  gloo::BarrierAllToOne barrier(context);
  if (rank == 0) std::printf("# gloo all_reduce f32 sum, %d ranks (time_us per algorithm; best busbw)\n# %12s %10s %10s %10s %10s %8s %8s %s\n",
                             size, "size", "ring", "ring_chunk", "halv_doubl", "bcube", "algbw", "busbw", "best");
  for (long bytes = min_bytes; bytes <= max_bytes; bytes *= factor) {
    const long count = bytes / 4;
    std::vector<float> data(count, 1.0f);
    std::vector<float*> ptrs{data.data()};
    const int n = bytes >= (64 << 20) ? std::max(3, iters / 4) : iters;
    const char* names[] = {"ring", "ring_chunked", "halving_doubling", "bcube"};
    double times[4];
    for (int a = 0; a < 4; ++a) {
      std::unique_ptr<gloo::Algorithm> algo;
      if (a == 0) algo = std::make_unique<gloo::AllreduceRing<float>>(context, ptrs, count);
      if (a == 1) algo = std::make_unique<gloo::AllreduceRingChunked<float>>(context, ptrs, count);
      if (a == 2) algo = std::make_unique<gloo::AllreduceHalvingDoubling<float>>(context, ptrs, count);
      if (a == 3) algo = std::make_unique<gloo::AllreduceBcube<float>>(context, ptrs, count);
      for (int i = 0; i < 3; ++i) algo->run();
      barrier.run();
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < n; ++i) algo->run();
      times[a] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / n;
      barrier.run();
    }
    int best = 0;
    for (int a = 1; a < 4; ++a) if (times[a] < times[best]) best = a;
    const double algbw = bytes / times[best] / 1e3;
    if (rank == 0) std::printf("  %12ld %10.2f %10.2f %10.2f %10.2f %8.3f %8.3f %s\n", bytes, times[0], times[1], times[2], times[3], algbw,
                               algbw * 2.0 * (size - 1) / size, names[best]);
    std::fflush(stdout);
  }
  return 0;
}
