// The README's example, as written there: a training step whose all_reduce overlaps the next compute.
// Run: weft-run -n 4 -- example-all-reduce
#include <cstdio>
#include <vector>

#include <weft/weft.hpp>

float compute_something_else(std::vector<float>& activations) {
  for (float& a : activations) a = a * 0.5f + 1.0f;
  return activations[0];
}

weft::Task<void> train_step(weft::Group& group, std::vector<float>& grads, std::vector<float>& activations) {
  auto reduced = group.all_reduce(grads);   // starts now; runs on the loop
  // Compute on a compute thread while the loop moves the gradients (compute placed right here would run
  // on the loop's own thread and stall it).
  co_await weft::offload([&] { compute_something_else(activations); });
  co_await std::move(reduced);              // resumes when every rank has contributed
}

int main() {
  weft::Loop loop;                                       // one event loop, own progress thread
  weft::Group group = weft::Group::create(loop).get();   // rank, size, store from the environment
  std::vector<float> grads(1 << 20, 1.0f);
  std::vector<float> activations(1 << 16, 1.0f);
  weft::sync_wait(loop, train_step(group, grads, activations));
  const float expected = float(group.size());
  std::size_t wrong = 0;
  for (float g : grads) wrong += g != expected;
  std::printf("rank %d of %d: grads[0] = %g (expected %g), %zu wrong, activations[0] = %g\n", group.rank(), group.size(),
              grads[0], expected, wrong, activations[0]);
  return wrong == 0 && activations[0] == 1.5f ? 0 : 1;
}
