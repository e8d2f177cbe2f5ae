#include "transports/shm/lendable.hpp"

#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>

namespace weft::shm {

bool kernel_can_read(const void* data, std::size_t bytes) noexcept {
  if (bytes == 0) return true;
  const auto* at = static_cast<const char*>(data);
  char got[2];
  iovec local{got, bytes > 1 ? 2u : 1u};
  iovec remote[2] = {{const_cast<char*>(at), 1}, {const_cast<char*>(at + bytes - 1), 1}};
  for (;;) {
    const ssize_t n = ::process_vm_readv(::getpid(), &local, 1, remote, bytes > 1 ? 2 : 1, 0);
    if (n >= 0) return static_cast<std::size_t>(n) == local.iov_len;
    if (errno != EINTR) return false;
  }
}

}  // namespace weft::shm
