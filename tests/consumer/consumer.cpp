// A program of a user's own project that uses an installed weft (tests/consumer.sh builds it with
// pkg-config, Meson's dependency('weft') and CMake's find_package(weft)): an all_reduce from a coroutine,
// checked. Run on N ranks with weft-run; prints "consumer ok" on every rank.
#include <cstdio>
#include <vector>

#include <weft/weft.hpp>

weft::Task<int> run(weft::Loop& loop) {
  weft::Group group = co_await weft::Group::create(loop);
  std::vector<int> values(1000, group.rank() + 1);
  co_await group.all_reduce(values);
  const int expected = group.size() * (group.size() + 1) / 2;
  int wrong = 0;
  for (int v : values) wrong += v != expected;
  co_return wrong;
}

int main() {
  weft::Loop loop;
  const int wrong = weft::sync_wait(loop, run(loop));
  if (wrong) {
    std::printf("consumer: %d wrong elements\n", wrong);
    return 1;
  }
  std::printf("consumer ok\n");
  return 0;
}
