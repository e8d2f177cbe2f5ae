// The Gloo side of bench/RESULTS.md: each of Gloo's algorithms for a collective, f32 (sum) over its TCP
// transport, timed like weft-bench; prints each and the best. all_reduce: ring, ring_chunked,
// halving_doubling, bcube; all_gather: ring (AllgatherRing), allgather (gloo::allgather); broadcast:
// one_to_all (BroadcastOneToAll), broadcast (gloo::broadcast); reduce_scatter: halving_doubling (its only
// one). Sizes as weft-bench and nccl-tests count them: all_gather's and reduce_scatter's are the whole
// buffer, a block per rank. Ranks come from weft-run's environment; rendezvous through a file store. Not
// part of weft.
//   weft-run -n 2 -- gloo-allreduce-bench MINBYTES MAXBYTES FACTOR ITERS [COLLECTIVE]
#include <gloo/allgather.h>
#include <gloo/allgather_ring.h>
#include <gloo/allreduce_bcube.h>
#include <gloo/allreduce_halving_doubling.h>
#include <gloo/allreduce_ring.h>
#include <gloo/allreduce_ring_chunked.h>
#include <gloo/barrier_all_to_one.h>
#include <gloo/broadcast.h>
#include <gloo/broadcast_one_to_all.h>
#include <gloo/reduce_scatter.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

#include <chrono>
#include <functional>
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
  const std::string collective = argc > 5 ? argv[5] : "all_reduce";
  std::vector<const char*> names;
  if (collective == "all_reduce") names = {"ring", "ring_chunked", "halving_doubling", "bcube"};
  else if (collective == "all_gather") names = {"ring", "allgather"};
  else if (collective == "broadcast") names = {"one_to_all", "broadcast"};
  else if (collective == "reduce_scatter") names = {"halving_doubling"};
  else {
    std::fprintf(stderr, "gloo-allreduce-bench: no collective '%s' (all_reduce, all_gather, broadcast, reduce_scatter)\n",
                 collective.c_str());
    return 2;
  }
  const double bus = collective == "all_reduce" ? 2.0 * (size - 1) / size : collective == "broadcast" ? 1.0 : 1.0 * (size - 1) / size;
  const long unit = collective == "all_gather" || collective == "reduce_scatter" ? 4L * size : 4L;
  if (rank == 0) {
    std::printf("# gloo %s f32%s, %d ranks (time_us per algorithm; best busbw)\n# %12s", collective.c_str(),
                collective == "all_reduce" || collective == "reduce_scatter" ? " sum" : "", size, "size");
    for (const char* name : names) std::printf(" %10.10s", name);
    std::printf(" %8s %8s %s\n", "algbw", "busbw", "best");
  }
  for (long requested = min_bytes; requested <= max_bytes; requested *= factor) {
    const long bytes = requested / unit * unit;
    const long count = bytes / 4;              // the whole buffer's elements
    const long block = bytes / unit;           // a rank's block (all_gather, reduce_scatter) or all of it
    std::vector<float> data(static_cast<std::size_t>(count) + 1, 1.0f), out(static_cast<std::size_t>(count) + 1);
    std::vector<float*> ptrs{data.data()};
    std::vector<const float*> in_ptrs{data.data()};
    const int n = bytes >= (64 << 20) ? std::max(3, iters / 4) : iters;
    std::vector<double> times(names.size());
    for (std::size_t a = 0; a < names.size(); ++a) {
      const std::string name = names[a];
      std::unique_ptr<gloo::Algorithm> algo;
      std::function<void()> call;
      if (collective == "all_reduce") {
        if (name == "ring") algo = std::make_unique<gloo::AllreduceRing<float>>(context, ptrs, count);
        if (name == "ring_chunked") algo = std::make_unique<gloo::AllreduceRingChunked<float>>(context, ptrs, count);
        if (name == "halving_doubling") algo = std::make_unique<gloo::AllreduceHalvingDoubling<float>>(context, ptrs, count);
        if (name == "bcube") algo = std::make_unique<gloo::AllreduceBcube<float>>(context, ptrs, count);
      } else if (collective == "all_gather" && name == "ring") {
        algo = std::make_unique<gloo::AllgatherRing<float>>(context, in_ptrs, out.data(), static_cast<int>(block));
      } else if (collective == "all_gather") {
        call = [&] {
          gloo::AllgatherOptions opts(context);
          opts.setInput(data.data(), static_cast<std::size_t>(block));
          opts.setOutput(out.data(), static_cast<std::size_t>(count));
          gloo::allgather(opts);
        };
      } else if (collective == "broadcast" && name == "one_to_all") {
        algo = std::make_unique<gloo::BroadcastOneToAll<float>>(context, ptrs, count);
      } else if (collective == "broadcast") {
        call = [&] {
          gloo::BroadcastOptions opts(context);
          opts.setOutput(data.data(), static_cast<std::size_t>(count));
          opts.setRoot(0);
          gloo::broadcast(opts);
        };
      } else {
        algo = std::make_unique<gloo::ReduceScatterHalvingDoubling<float>>(
            context, ptrs, static_cast<int>(count), std::vector<int>(static_cast<std::size_t>(size), static_cast<int>(block)));
      }
      if (algo) call = [&] { algo->run(); };
      for (int i = 0; i < 3; ++i) call();
      barrier.run();
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < n; ++i) call();
      times[a] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / n;
      barrier.run();
    }
    std::size_t best = 0;
    for (std::size_t a = 1; a < names.size(); ++a) if (times[a] < times[best]) best = a;
    const double algbw = bytes / times[best] / 1e3;
    if (rank == 0) {
      std::printf("  %12ld", bytes);
      for (double t : times) std::printf(" %10.3f", t);
      std::printf(" %8.3f %8.3f %s\n", algbw, algbw * bus, names[best]);
    }
    std::fflush(stdout);
  }
  return 0;
}
