// The Open MPI side of bench/RESULTS.md: an MPI collective (f32; sum where it reduces) timed like
// weft-bench: time per op = the slowest rank's mean, size = the full array (nccl-tests), busbw = algbw x the
// collective's factor. Not part of weft.
//   mpirun -n 2 --mca btl tcp,self mpi-allreduce-bench MINBYTES MAXBYTES FACTOR ITERS [COLLECTIVE]
//   COLLECTIVE: all_reduce (default), all_gather, all_gatherv, reduce_scatter (MPI_Reduce_scatter, the
//   v-form), broadcast, all_to_all, all_to_allv (the v-forms with equal counts), ping_pong (half
//   the round trip between ranks 0 and 1), stream (rank 0 to 1, 64 messages in flight: time per message)
// (ping_pong and stream as weft-bench times them, and as OSU's osu_latency and osu_bw do.)
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const long min_bytes = argc > 1 ? std::atol(argv[1]) : 8;
  const long max_bytes = argc > 2 ? std::atol(argv[2]) : 1 << 26;
  const long factor = argc > 3 ? std::atol(argv[3]) : 2;
  const int iters = argc > 4 ? std::atoi(argv[4]) : 20;
  const std::string collective = argc > 5 ? argv[5] : "all_reduce";
  const double p = size;
  double bus = 2 * (p - 1) / p;
  if (collective == "all_gather" || collective == "all_gatherv" || collective == "reduce_scatter" || collective == "all_to_all" ||
      collective == "all_to_allv") {
    bus = (p - 1) / p;
  }
  const bool point_to_point = collective == "ping_pong" || collective == "stream";
  if (collective == "broadcast" || point_to_point) bus = 1;
  const long unit = 4L * (collective == "all_reduce" || collective == "broadcast" || point_to_point ? 1 : size);
  constexpr int window = 64;
  std::vector<MPI_Request> requests(window);
  if (rank == 0) std::printf("# mpi %s f32, %d ranks\n# %12s %12s %10s %8s %8s\n", collective.c_str(), size, "size", "count", "time_us", "algbw", "busbw");
  for (long requested = min_bytes; requested <= max_bytes; requested *= factor) {
    const long bytes = requested / unit * unit;
    const int block = static_cast<int>(bytes / unit);  // elements per rank block (or all, for the unblocked)
    std::vector<float> in(static_cast<std::size_t>(bytes / 4 + 1), 1.0f), out(static_cast<std::size_t>(bytes / 4 + 1));
    std::vector<int> counts(static_cast<std::size_t>(size), block), displs(static_cast<std::size_t>(size));
    for (int i = 0; i < size; ++i) displs[static_cast<std::size_t>(i)] = i * block;
    auto run = [&] {
      if (collective == "all_reduce") MPI_Allreduce(in.data(), out.data(), block, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      else if (collective == "all_gather") MPI_Allgather(in.data(), block, MPI_FLOAT, out.data(), block, MPI_FLOAT, MPI_COMM_WORLD);
      else if (collective == "all_gatherv") MPI_Allgatherv(in.data(), block, MPI_FLOAT, out.data(), counts.data(), displs.data(), MPI_FLOAT, MPI_COMM_WORLD);
      else if (collective == "all_to_allv") MPI_Alltoallv(in.data(), counts.data(), displs.data(), MPI_FLOAT, out.data(), counts.data(), displs.data(), MPI_FLOAT, MPI_COMM_WORLD);
      else if (collective == "reduce_scatter") MPI_Reduce_scatter(in.data(), out.data(), counts.data(), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      else if (collective == "broadcast") MPI_Bcast(in.data(), block, MPI_FLOAT, 0, MPI_COMM_WORLD);
      else if (collective == "all_to_all") MPI_Alltoall(in.data(), block, MPI_FLOAT, out.data(), block, MPI_FLOAT, MPI_COMM_WORLD);
      else if (collective == "ping_pong" && rank == 0) {
        MPI_Send(in.data(), block, MPI_FLOAT, 1, 0, MPI_COMM_WORLD);
        MPI_Recv(out.data(), block, MPI_FLOAT, 1, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      } else if (collective == "ping_pong" && rank == 1) {
        MPI_Recv(out.data(), block, MPI_FLOAT, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        MPI_Send(out.data(), block, MPI_FLOAT, 0, 0, MPI_COMM_WORLD);
      } else if (collective == "stream" && rank == 0) {
        for (auto& r : requests) MPI_Isend(in.data(), block, MPI_FLOAT, 1, 0, MPI_COMM_WORLD, &r);
        MPI_Waitall(window, requests.data(), MPI_STATUSES_IGNORE);
        MPI_Recv(out.data(), 0, MPI_FLOAT, 1, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      } else if (collective == "stream" && rank == 1) {
        for (auto& r : requests) MPI_Irecv(out.data(), block, MPI_FLOAT, 0, 0, MPI_COMM_WORLD, &r);
        MPI_Waitall(window, requests.data(), MPI_STATUSES_IGNORE);
        MPI_Send(out.data(), 0, MPI_FLOAT, 0, 1, MPI_COMM_WORLD);
      }
    };
    const int n = bytes >= (64 << 20) ? std::max(3, iters / 4) : iters;
    for (int i = 0; i < 3; ++i) run();
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    for (int i = 0; i < n; ++i) run();
    double us = (MPI_Wtime() - t0) * 1e6 / n, worst = 0;
    if (collective == "ping_pong") us /= 2;
    if (collective == "stream") us /= window;
    MPI_Allreduce(&us, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    const double algbw = bytes / worst / 1e3;
    if (rank == 0) std::printf("  %12ld %12ld %10.3f %8.3f %8.3f\n", bytes, bytes / 4, worst, algbw, algbw * bus);
  }
  MPI_Finalize();
}
