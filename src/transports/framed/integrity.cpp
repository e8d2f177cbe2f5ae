#include "transports/framed/integrity.hpp"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>

#include <cstring>
#include <stdexcept>
#include <utility>

#include "core/bytes.hpp"


#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace weft {
namespace {

constexpr std::uint32_t castagnoli_reflected = 0x82F63B78;

struct Table {
  std::uint32_t entries[8][256];
  Table() {
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t crc = i;
      for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (castagnoli_reflected & (0u - (crc & 1)));
      entries[0][i] = crc;
    }
    for (std::uint32_t i = 0; i < 256; ++i) {
      for (int t = 1; t < 8; ++t) entries[t][i] = (entries[t - 1][i] >> 8) ^ entries[0][entries[t - 1][i] & 0xff];
    }
  }
};
const Table& table() {
  static const Table t;
  return t;
}

#if defined(__x86_64__)
// The crc32 instruction has a latency of 3 cycles and a throughput of 1: three streams over three
// adjacent blocks keep it busy, and the three CRCs are joined by "shifting" the first ones over the
// length of the blocks after them (multiplying by x^(8 * length) modulo the polynomial, through tables
// built once). The construction is Mark Adler's (crc32c.c, zlib licence), written here from its
// description.
constexpr std::size_t long_block = 8192;
constexpr std::size_t short_block = 256;

std::uint32_t gf2_times(const std::uint32_t* matrix, std::uint32_t vector) noexcept {
  std::uint32_t sum = 0;
  while (vector) {
    if (vector & 1) sum ^= *matrix;
    vector >>= 1;
    ++matrix;
  }
  return sum;
}

void gf2_square(std::uint32_t* square, const std::uint32_t* matrix) noexcept {
  for (int n = 0; n < 32; ++n) square[n] = gf2_times(matrix, matrix[n]);
}

// The operator that appends `length` zero bytes to a CRC's state.
void zeros_operator(std::uint32_t* even, std::size_t length) noexcept {
  std::uint32_t odd[32];
  odd[0] = castagnoli_reflected;  // one zero bit
  std::uint32_t row = 1;
  for (int n = 1; n < 32; ++n) {
    odd[n] = row;
    row <<= 1;
  }
  gf2_square(even, odd);  // two zero bits
  gf2_square(odd, even);  // four: odd now appends one zero byte
  do {
    gf2_square(even, odd);
    length >>= 1;
    if (length == 0) return;
    gf2_square(odd, even);
    length >>= 1;
  } while (length);
  for (int n = 0; n < 32; ++n) even[n] = odd[n];
}

struct Shift {
  std::uint32_t table[4][256];
  explicit Shift(std::size_t length) noexcept {
    std::uint32_t op[32];
    zeros_operator(op, length);
    for (std::uint32_t n = 0; n < 256; ++n) {
      for (int b = 0; b < 4; ++b) table[b][n] = gf2_times(op, n << (8 * b));
    }
  }
  std::uint32_t operator()(std::uint32_t crc) const noexcept {
    return table[0][crc & 0xff] ^ table[1][(crc >> 8) & 0xff] ^ table[2][(crc >> 16) & 0xff] ^ table[3][crc >> 24];
  }
};

__attribute__((target("sse4.2"))) std::uint32_t crc32c_sse42(std::uint32_t crc, const void* data, std::size_t size) noexcept {
  static const Shift over_long(long_block);
  static const Shift over_short(short_block);
  const auto* p = static_cast<const unsigned char*>(data);
  auto word = [](const unsigned char* at) {
    std::uint64_t w;
    std::memcpy(&w, at, 8);
    return w;
  };
  std::uint64_t c0 = ~crc;
  while (size > 0 && (reinterpret_cast<std::uintptr_t>(p) & 7) != 0) {
    c0 = _mm_crc32_u8(static_cast<std::uint32_t>(c0), *p++);
    --size;
  }
  for (const auto& [block, shift] : {std::pair{long_block, &over_long}, std::pair{short_block, &over_short}}) {
    while (size >= 3 * block) {
      std::uint64_t c1 = 0;
      std::uint64_t c2 = 0;
      for (const unsigned char* end = p + block; p < end; p += 8) {
        c0 = _mm_crc32_u64(c0, word(p));
        c1 = _mm_crc32_u64(c1, word(p + block));
        c2 = _mm_crc32_u64(c2, word(p + 2 * block));
      }
      c0 = (*shift)(static_cast<std::uint32_t>(c0)) ^ static_cast<std::uint32_t>(c1);
      c0 = (*shift)(static_cast<std::uint32_t>(c0)) ^ static_cast<std::uint32_t>(c2);
      p += 2 * block;
      size -= 3 * block;
    }
  }
  while (size >= 8) {
    c0 = _mm_crc32_u64(c0, word(p));
    p += 8;
    size -= 8;
  }
  while (size > 0) {
    c0 = _mm_crc32_u8(static_cast<std::uint32_t>(c0), *p++);
    --size;
  }
  return ~static_cast<std::uint32_t>(c0);
}
#endif

}  // namespace

std::uint32_t crc32c_portable(std::uint32_t crc, const void* data, std::size_t size) noexcept {
  const auto& t = table().entries;
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  while (size >= 8) {
    std::uint32_t lo;
    std::uint32_t hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= crc;
    crc = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^ t[3][hi & 0xff] ^
          t[2][(hi >> 8) & 0xff] ^ t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
    p += 8;
    size -= 8;
  }
  while (size-- > 0) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xff];
  return ~crc;
}

std::uint32_t crc32c(std::uint32_t crc, const void* data, std::size_t size) noexcept {
#if defined(__x86_64__)
  static const bool hardware = __builtin_cpu_supports("sse4.2");
  if (hardware) return crc32c_sse42(crc, data, size);
#endif
  return crc32c_portable(crc, data, size);
}

struct FrameSeal::Mac {
  EVP_MAC* mac = nullptr;
  EVP_MAC_CTX* ctx = nullptr;
  ~Mac() {
    EVP_MAC_CTX_free(ctx);
    EVP_MAC_free(mac);
  }
};

FrameSeal::FrameSeal(Integrity mode, const std::array<std::byte, 32>& key) : mode_(mode) {
  if (mode_ != Integrity::hmac) return;
  mac_ = std::make_unique<Mac>();
  mac_->mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  mac_->ctx = mac_->mac ? EVP_MAC_CTX_new(mac_->mac) : nullptr;
  char digest[] = "SHA256";
  const OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0), OSSL_PARAM_construct_end()};
  if (!mac_->ctx || !EVP_MAC_init(mac_->ctx, reinterpret_cast<const unsigned char*>(key.data()), key.size(), params)) {
    throw std::runtime_error("OpenSSL cannot make an HMAC-SHA256 for frame integrity");
  }
}

FrameSeal::FrameSeal() = default;
FrameSeal::~FrameSeal() = default;
FrameSeal::FrameSeal(FrameSeal&&) noexcept = default;
FrameSeal& FrameSeal::operator=(FrameSeal&&) noexcept = default;

std::size_t FrameSeal::trailer_size() const noexcept {
  switch (mode_) {
    case Integrity::off: return 0;
    case Integrity::crc32c: return 4;
    case Integrity::hmac: return 16;
  }
  return 0;
}

void FrameSeal::begin() {
  crc_ = 0;
  if (mode_ == Integrity::hmac) {
    // The key set at construction stays (a null key keeps it): only the state restarts.
    EVP_MAC_init(mac_->ctx, nullptr, 0, nullptr);
    std::byte counter[8];
    le::put_u64(counter, frames_);
    EVP_MAC_update(mac_->ctx, reinterpret_cast<const unsigned char*>(counter), sizeof counter);
  }
}

void FrameSeal::update(const void* data, std::size_t size) {
  if (size == 0) return;
  if (mode_ == Integrity::crc32c) crc_ = crc32c(crc_, data, size);
  else if (mode_ == Integrity::hmac) EVP_MAC_update(mac_->ctx, static_cast<const unsigned char*>(data), size);
}

void FrameSeal::finish(std::byte* out) {
  ++frames_;
  if (mode_ == Integrity::crc32c) {
    le::put_u32(out, crc_);
  } else if (mode_ == Integrity::hmac) {
    unsigned char full[32];
    std::size_t length = 0;
    EVP_MAC_final(mac_->ctx, full, &length, sizeof full);
    std::memcpy(out, full, 16);
  }
}

void FrameSeal::seal(std::byte* out) { finish(out); }

bool FrameSeal::check(const std::byte* trailer) {
  std::byte expected[max_trailer];
  finish(expected);
  return CRYPTO_memcmp(expected, trailer, trailer_size()) == 0;
}

}  // namespace weft
