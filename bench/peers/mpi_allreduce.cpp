// The Open MPI side of bench/RESULTS.md: MPI_Allreduce (f32, sum) timed like weft-bench (time per op =
// the slowest rank's average; busbw = algbw x 2(n-1)/n). Not part of weft.
//   mpirun -n 2 --mca btl tcp,self mpi-allreduce-bench MINBYTES MAXBYTES FACTOR ITERS
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
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
  if (rank == 0) std::printf("# mpi all_reduce f32 sum, %d ranks\n# %12s %12s %10s %8s %8s\n", size, "size", "count", "time_us", "algbw", "busbw");
  for (long bytes = min_bytes; bytes <= max_bytes; bytes *= factor) {
    const long count = bytes / 4;
    std::vector<float> in(count, 1.0f), out(count);
    const int n = bytes >= (64 << 20) ? std::max(3, iters / 4) : iters;
    for (int i = 0; i < 3; ++i) MPI_Allreduce(in.data(), out.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    for (int i = 0; i < n; ++i) MPI_Allreduce(in.data(), out.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    double us = (MPI_Wtime() - t0) * 1e6 / n, worst = 0;
    MPI_Allreduce(&us, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    const double algbw = bytes / worst / 1e3;
    if (rank == 0) std::printf("  %12ld %12ld %10.2f %8.3f %8.3f\n", bytes, count, worst, algbw, algbw * 2.0 * (size - 1) / size);
  }
  MPI_Finalize();
}
