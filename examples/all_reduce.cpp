// The README's example: every rank adds its vector into everybody's. Run: weft-run -n 4 -- example-all-reduce
#include <cstdio>
#include <vector>

#include <weft/weft.hpp>

weft::Task<void> step(weft::Group& group, std::vector<float>& grads) {
  co_await group.all_reduce(grads, weft::ReduceOp::sum);  // the future starts at once; co_await it
}

int main() {
  weft::Loop loop;                                   // one event loop, on its own progress thread
  weft::Group group = weft::Group::create(loop).get();  // rank, size and store from the environment
  std::vector<float> grads(1024, float(group.rank() + 1));
  weft::sync_wait(loop, step(group, grads));
  const float expected = float(group.size() * (group.size() + 1) / 2);
  std::printf("rank %d of %d: grads[0] = %g (expected %g)\n", group.rank(), group.size(), grads[0], expected);
  return grads[0] == expected ? 0 : 1;
}
