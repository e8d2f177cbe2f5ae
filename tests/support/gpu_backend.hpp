#pragma once
// The GPU test programs' start: the backend WEFT_GPU asks for, or exit 77 (meson's skip) saying why it is
// missing (WEFT_GPU=cuda on a machine without a GPU).
#include <cstdlib>

#include <fmt/format.h>

#include <weft/error.hpp>
#include <weft/gpu.hpp>

namespace weft::test {

inline void need_backend() {
  try {
    (void)gpu::backend();
  } catch (const Error& e) {
    fmt::print("SKIP: {}\n", e.what());
    std::exit(77);
  }
}

}  // namespace weft::test
