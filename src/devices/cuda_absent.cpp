// Built where CUDA is not (nvcc not found, or -Dcuda=disabled): the backend says why it is missing.
#include "devices/backend.hpp"

namespace weft::gpu::detail {

std::unique_ptr<Backend> make_cuda_backend(std::string& why_not) {
  why_not = "weft was built without CUDA (nvcc not found at configure time, or -Dcuda=disabled)";
  return nullptr;
}

}  // namespace weft::gpu::detail
