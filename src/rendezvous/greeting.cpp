#include "rendezvous/greeting.hpp"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <fmt/format.h>

#include "core/bytes.hpp"
#include "core/log.hpp"
#include "core/deadline.hpp"

namespace weft::greeting {
namespace {

using asio::awaitable;
using asio::use_awaitable;
using asio::ip::tcp;

// Hello: 0 magic u32 | 4 version u16 | 6 role u8 | 7 flags u8 (bit 0: has a secret) | 8 nonce [32]
// Details: 0 rank i32 | 4 world_size u32 | 8 job length u16 | 10 integrity u8 | 11 zero u8 | 12 selection u64 | 20 job id
constexpr std::uint8_t flag_secret = 1;

// Labels keep the proofs apart, so that no proof can be replayed as another.
constexpr const char* acceptor_label = "weft greeting v2: accepting side";
constexpr const char* connector_label = "weft greeting v2: connecting side, with its details";
constexpr const char* acceptor_details_label = "weft greeting v2: accepting side's details";
constexpr const char* frames_from_connector_label = "weft frames v1: from the connecting side";
constexpr const char* frames_from_acceptor_label = "weft frames v1: from the accepting side";

bool pairs(Role mine, Role theirs) {
  return (mine == Role::store_client && theirs == Role::store) || (mine == Role::peer && theirs == Role::rank) ||
         (mine == Role::store && theirs == Role::store_client) || (mine == Role::rank && theirs == Role::peer);
}

// How a role is named in a refusal, so that the text reads the same on both sides of the connection.
const char* role_name(Role role) {
  switch (role) {
    case Role::store_client: return "the connecting rank";
    case Role::peer: return "the connecting rank";
    case Role::store: return "the store";
    case Role::rank: return "the accepting rank";
  }
  return "?";
}

std::string job_text(const std::string& job) { return job.empty() ? std::string("(none)") : "'" + job + "'"; }

std::array<std::byte, nonce_size> fresh_nonce() {
  std::array<std::byte, nonce_size> nonce{};
  if (RAND_bytes(reinterpret_cast<unsigned char*>(nonce.data()), static_cast<int>(nonce.size())) != 1) {
    throw std::runtime_error("RAND_bytes failed: no randomness for the greeting's nonce");
  }
  return nonce;
}

awaitable<std::vector<std::byte>> read_hello(tcp::socket& socket, Hello& out) {
  // The magic first: a stranger that sends a few bytes of something else is refused at once rather
  // than waited for until the greeting's time is up.
  std::vector<std::byte> bytes(hello_size);
  co_await asio::async_read(socket, asio::buffer(bytes.data(), 4), use_awaitable);
  if (le::get_u32(bytes.data()) != magic) {
    // The first bytes as text where they are text: "GET ", "HTTP", "SSH-" say who answered.
    std::string text;
    for (int i = 0; i < 4; ++i) {
      const auto c = static_cast<unsigned char>(bytes[static_cast<std::size_t>(i)]);
      if (c < 0x20 || c > 0x7e) {
        text.clear();
        break;
      }
      text += static_cast<char>(c);
    }
    throw Refused(fmt::format("not a weft greeting (magic 0x{:08x}{}, expected 0x{:08x})", le::get_u32(bytes.data()),
                              text.empty() ? "" : fmt::format(": '{}'", text), magic));
  }
  co_await asio::async_read(socket, asio::buffer(bytes.data() + 4, hello_size - 4), use_awaitable);
  std::string error;
  auto decoded = decode_hello(bytes.data(), error);
  if (!decoded) throw Refused(error);
  out = *decoded;
  co_return bytes;
}

awaitable<std::vector<std::byte>> read_details(tcp::socket& socket, Details& out) {
  std::vector<std::byte> bytes(details_fixed_size);
  co_await asio::async_read(socket, asio::buffer(bytes), use_awaitable);
  std::string error;
  const auto job = job_length(bytes.data(), error);
  if (!job) throw Refused(error);
  bytes.resize(details_fixed_size + *job);
  co_await asio::async_read(socket, asio::buffer(bytes.data() + details_fixed_size, *job), use_awaitable);
  auto decoded = decode_details(bytes.data(), bytes.size(), error);
  if (!decoded) throw Refused(error);
  out = std::move(*decoded);
  co_return bytes;
}

awaitable<Verdict> read_verdict(tcp::socket& socket) {
  std::array<std::byte, verdict_header_size> header{};
  co_await asio::async_read(socket, asio::buffer(header), use_awaitable);
  std::string error;
  const auto length = reason_length(header.data(), error);
  if (!length) throw Refused(error);
  Verdict verdict{le::get_u32(header.data()), std::string(*length, '\0')};
  co_await asio::async_read(socket, asio::buffer(verdict.reason), use_awaitable);
  co_return verdict;
}

awaitable<std::array<std::byte, proof_size>> read_proof(tcp::socket& socket) {
  std::array<std::byte, proof_size> proof{};
  co_await asio::async_read(socket, asio::buffer(proof), use_awaitable);
  co_return proof;
}

awaitable<void> write_all(tcp::socket& socket, const std::vector<std::byte>& bytes) {
  co_await asio::async_write(socket, asio::buffer(bytes), use_awaitable);
}

std::vector<std::byte> concat(std::vector<std::byte> a, const std::vector<std::byte>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::vector<std::byte> proof_bytes(const std::array<std::byte, proof_size>& p) { return {p.begin(), p.end()}; }

std::string mismatched_proof(Role theirs, Role mine) {
  return fmt::format("the proof of the shared secret from {} does not match the secret of {} (a different WEFT_SECRET?)",
                     role_name(theirs), role_name(mine));
}

// What the other side's hello must agree with, told before anybody proved the secret: roles that pair
// and whether there is a secret (nothing about the job). Returns a refusal reason or "".
std::string hello_disagreement(const Local& local, const Hello& theirs) {
  const char* me = role_name(local.role);
  const char* them = role_name(theirs.role);
  if (!pairs(local.role, theirs.role)) {
    return fmt::format("{} was greeted by a process that calls itself {}", me, them);
  }
  if (theirs.has_secret != !local.secret.empty()) {
    const char* with = theirs.has_secret ? them : me;
    const char* without = theirs.has_secret ? me : them;
    return fmt::format("{} has a shared secret and {} has none (set WEFT_SECRET or WEFT_SECRET_FILE on every rank)", with, without);
  }
  return {};
}

// What the other side's details must agree with whatever its role: the job, and what frames carry.
std::string details_disagreement(const Local& local, Role their_role, const Details& theirs) {
  if (theirs.job != local.job) {
    return fmt::format("{} belongs to job {} and {} to job {} (WEFT_JOB_ID)", role_name(their_role), job_text(theirs.job),
                       role_name(local.role), job_text(local.job));
  }
  if (theirs.integrity != local.integrity) {
    return fmt::format("{} checks frames with '{}' and {} with '{}' (WEFT_INTEGRITY must be the same on every rank)",
                       role_name(their_role), to_string(theirs.integrity), role_name(local.role), to_string(local.integrity));
  }
  if (theirs.selection != local.selection) {
    return fmt::format("{} selects or cuts algorithms differently from {} (WEFT_ALGO, WEFT_TUNING's file, WEFT_SEGMENT_BYTES "
                       "and WEFT_DETERMINISTIC, or their Options, must be the same on every rank: a rank that runs another "
                       "plan waits for messages its peers never send)", role_name(their_role), role_name(local.role));
  }
  return {};
}

Greeting greeting_of(const Hello& hello, Details details) {
  return Greeting{hello.role, hello.has_secret, details.rank, details.world_size, std::move(details.job), details.integrity,
                  details.selection, {}, {}};
}

Details details_of(const Local& local) {
  return Details{local.rank, static_cast<std::uint32_t>(local.world_size), local.job, local.integrity, local.selection};
}

}  // namespace

std::vector<std::byte> encode(const Hello& h) {
  std::vector<std::byte> out(hello_size);
  std::byte* p = out.data();
  le::put_u32(p, magic);
  p[4] = static_cast<std::byte>(version & 0xff);
  p[5] = static_cast<std::byte>(version >> 8);
  p[6] = static_cast<std::byte>(h.role);
  p[7] = static_cast<std::byte>(h.has_secret ? flag_secret : 0);
  std::copy(h.nonce.begin(), h.nonce.end(), p + 8);
  return out;
}

std::optional<Hello> decode_hello(const std::byte* p, std::string& error) {
  if (le::get_u32(p) != magic) {
    error = fmt::format("not a weft greeting (magic 0x{:08x}, expected 0x{:08x})", le::get_u32(p), magic);
    return std::nullopt;
  }
  const unsigned v = static_cast<unsigned>(p[4]) | (static_cast<unsigned>(p[5]) << 8);
  if (v != version) {
    error = fmt::format("greeting version {} (this build speaks {})", v, version);
    return std::nullopt;
  }
  const auto role = static_cast<unsigned>(p[6]);
  if (role < 1 || role > 4) {
    error = fmt::format("unknown role {} in the greeting", role);
    return std::nullopt;
  }
  if ((static_cast<unsigned>(p[7]) & ~unsigned{flag_secret}) != 0) {
    error = fmt::format("unknown greeting flags 0x{:02x}", static_cast<unsigned>(p[7]));
    return std::nullopt;
  }
  Hello h;
  h.role = static_cast<Role>(role);
  h.has_secret = (static_cast<unsigned>(p[7]) & flag_secret) != 0;
  std::copy(p + 8, p + 8 + nonce_size, h.nonce.begin());
  return h;
}

std::vector<std::byte> encode(const Details& d) {
  std::vector<std::byte> out(details_fixed_size + d.job.size());
  std::byte* p = out.data();
  le::put_u32(p, static_cast<std::uint32_t>(d.rank));
  le::put_u32(p + 4, d.world_size);
  p[8] = static_cast<std::byte>(d.job.size() & 0xff);
  p[9] = static_cast<std::byte>(d.job.size() >> 8);
  p[10] = static_cast<std::byte>(d.integrity);
  le::put_u64(p + 12, d.selection);
  std::copy(reinterpret_cast<const std::byte*>(d.job.data()), reinterpret_cast<const std::byte*>(d.job.data()) + d.job.size(),
            p + details_fixed_size);
  return out;
}

std::optional<std::size_t> job_length(const std::byte* p, std::string& error) {
  const std::size_t job = static_cast<unsigned>(p[8]) | (static_cast<unsigned>(p[9]) << 8);
  if (job > max_job_bytes) {
    error = fmt::format("a job id of {} bytes in the greeting (limit {})", job, max_job_bytes);
    return std::nullopt;
  }
  return job;
}

std::optional<Details> decode_details(const std::byte* p, std::size_t size, std::string& error) {
  if (size < details_fixed_size) {
    error = fmt::format("greeting details of {} bytes (at least {})", size, details_fixed_size);
    return std::nullopt;
  }
  const auto job = job_length(p, error);
  if (!job) return std::nullopt;
  if (size != details_fixed_size + *job) {
    error = fmt::format("greeting details of {} bytes with a job id of {}", size, *job);
    return std::nullopt;
  }
  const auto integrity = static_cast<unsigned>(p[10]);
  if (integrity > static_cast<unsigned>(Integrity::hmac)) {
    error = fmt::format("unknown frame integrity {} in the greeting", integrity);
    return std::nullopt;
  }
  Details d;
  d.integrity = static_cast<Integrity>(integrity);
  d.rank = static_cast<std::int32_t>(le::get_u32(p));
  d.world_size = le::get_u32(p + 4);
  d.selection = le::get_u64(p + 12);
  d.job.assign(reinterpret_cast<const char*>(p + details_fixed_size), *job);
  return d;
}

std::vector<std::byte> encode(const Verdict& v) {
  const auto reason = v.reason.substr(0, max_reason_bytes);
  std::vector<std::byte> out(verdict_header_size + reason.size());
  le::put_u32(out.data(), v.status);
  le::put_u32(out.data() + 4, static_cast<std::uint32_t>(reason.size()));
  std::copy(reinterpret_cast<const std::byte*>(reason.data()), reinterpret_cast<const std::byte*>(reason.data()) + reason.size(),
            out.data() + verdict_header_size);
  return out;
}

std::optional<std::size_t> reason_length(const std::byte* header, std::string& error) {
  const auto length = le::get_u32(header + 4);
  if (length > max_reason_bytes) {
    error = fmt::format("a verdict with a reason of {} bytes (limit {})", length, max_reason_bytes);
    return std::nullopt;
  }
  return length;
}

std::array<std::byte, proof_size> proof(const std::string& secret, const char* label, const std::vector<std::byte>& a,
                                        const std::vector<std::byte>& b) {
  std::vector<unsigned char> message(label, label + std::char_traits<char>::length(label));
  message.push_back(0);
  const auto* ua = reinterpret_cast<const unsigned char*>(a.data());
  const auto* ub = reinterpret_cast<const unsigned char*>(b.data());
  message.insert(message.end(), ua, ua + a.size());
  message.insert(message.end(), ub, ub + b.size());
  std::array<std::byte, proof_size> out{};
  unsigned int length = 0;
  if (!HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()), message.data(), message.size(),
            reinterpret_cast<unsigned char*>(out.data()), &length) ||
      length != proof_size) {
    throw std::runtime_error("HMAC-SHA256 failed (OpenSSL)");
  }
  return out;
}

bool proofs_equal(const std::array<std::byte, proof_size>& a, const std::array<std::byte, proof_size>& b) {
  return CRYPTO_memcmp(a.data(), b.data(), proof_size) == 0;
}

std::string address_of(const tcp::endpoint& ep) {
  return ep.address().is_v6() ? fmt::format("[{}]:{}", ep.address().to_string(), ep.port())
                              : fmt::format("{}:{}", ep.address().to_string(), ep.port());
}

std::string remote_address(const tcp::socket& socket) {
  std::error_code ec;
  auto ep = socket.remote_endpoint(ec);
  if (ec) return "?";
  return address_of(ep);
}

RefusalLog::~RefusalLog() { say_suppressed(); }

void RefusalLog::say_suppressed() {
  if (suppressed_ == 0) return;
  log().warn("{}: refused {} more connection{} in {} s, not logged one by one (at most {} lines per {} s)", listener_,
             suppressed_, suppressed_ == 1 ? "" : "s", window_.count(), burst_, window_.count());
  suppressed_ = 0;
}

std::string RefusalLog::summary() const {
  if (total_ == 0) return {};
  return fmt::format("{} connection{} refused, the last from {}", total_, total_ == 1 ? "" : "s", last_);
}

void RefusalLog::refused(const std::string& from, const std::string& why) {
  ++total_;
  last_ = fmt::format("{}: {}", from, why);
  const auto now = std::chrono::steady_clock::now();
  if (now - window_start_ >= window_) {
    say_suppressed();
    window_start_ = now;
    logged_ = 0;
  }
  if (logged_ < burst_) {
    ++logged_;
    log().warn("{}: refused a connection from {}: {}", listener_, from, why);
  } else {
    ++suppressed_;
  }
}

// The exchange (C connects, A accepts; docs/PROTOCOL.md):
//   C -> A  hello C
//   A -> C  hello A, verdict A (roles, secret or not), [proof A = HMAC(acceptor || hC || hA)]
//   C -> A  verdict C (roles, secret, proof A), details C, [proof C = HMAC(connector || hC || hA || dC)]
//   A -> C  verdict (proof C, job, A's own checks: the only place a rank is reserved), details A,
//           [proof = HMAC(acceptor details || hC || hA || dC || dA)]
// Proofs travel only when there is a secret (both sides have one, or the greeting is refused), details
// only once the other side proved it. Each side refuses with a reason the other side is told, so both
// ends can say what went wrong.
awaitable<Greeting> connect(tcp::socket& socket, const Local& local, const std::string& remote) {
  const bool secret = !local.secret.empty();
  const auto my_hello = encode(Hello{local.role, secret, fresh_nonce()});
  co_await write_all(socket, my_hello);

  Hello their_hello;
  const auto their_hello_bytes = co_await read_hello(socket, their_hello);
  const auto verdict = co_await read_verdict(socket);
  if (verdict.status != 0) throw Refused(fmt::format("{} refused this rank: {}", remote, verdict.reason));
  const auto hellos = concat(my_hello, their_hello_bytes);
  std::string refusal = hello_disagreement(local, their_hello);
  if (refusal.empty() && secret) {
    const auto their_proof = co_await read_proof(socket);
    if (!proofs_equal(their_proof, proof(local.secret, acceptor_label, my_hello, their_hello_bytes))) {
      refusal = mismatched_proof(their_hello.role, local.role);
    }
  }
  // Named, not temporaries inside co_await: GCC 12 frees such temporaries twice.
  const auto my_details = encode(details_of(local));
  auto answer = encode(Verdict{refusal.empty() ? 0u : 1u, refusal});
  if (refusal.empty()) {
    answer = concat(std::move(answer), my_details);
    if (secret) answer = concat(std::move(answer), proof_bytes(proof(local.secret, connector_label, hellos, my_details)));
  }
  co_await write_all(socket, answer);
  if (!refusal.empty()) throw Refused(fmt::format("{}: {}", remote, refusal));

  const auto last = co_await read_verdict(socket);
  if (last.status != 0) throw Refused(fmt::format("{} refused this rank: {}", remote, last.reason));
  Details their_details;
  const auto their_details_bytes = co_await read_details(socket, their_details);
  if (secret) {
    const auto their_proof = co_await read_proof(socket);
    if (!proofs_equal(their_proof, proof(local.secret, acceptor_details_label, concat(hellos, my_details), their_details_bytes))) {
      throw Refused(fmt::format("{}: {}", remote, mismatched_proof(their_hello.role, local.role)));
    }
  }
  // The accepting side checked the job already; a side that says otherwise now is not a weft rank.
  refusal = details_disagreement(local, their_hello.role, their_details);
  if (!refusal.empty()) throw Refused(fmt::format("{}: {}", remote, refusal));
  auto theirs = greeting_of(their_hello, std::move(their_details));
  if (secret) {
    theirs.send_key = proof(local.secret, frames_from_connector_label, my_hello, their_hello_bytes);
    theirs.recv_key = proof(local.secret, frames_from_acceptor_label, my_hello, their_hello_bytes);
  }
  co_return theirs;
}

awaitable<Greeting> accept(tcp::socket& socket, const Local& local, const std::function<std::string(const Greeting&)>& check) {
  const bool secret = !local.secret.empty();
  Hello their_hello;
  const auto their_hello_bytes = co_await read_hello(socket, their_hello);
  const auto my_hello = encode(Hello{local.role, secret, fresh_nonce()});
  const auto hellos = concat(their_hello_bytes, my_hello);
  std::string refusal = hello_disagreement(local, their_hello);
  auto reply = concat(my_hello, encode(Verdict{refusal.empty() ? 0u : 1u, refusal}));
  if (refusal.empty() && secret) {
    reply = concat(std::move(reply), proof_bytes(proof(local.secret, acceptor_label, their_hello_bytes, my_hello)));
  }
  co_await write_all(socket, reply);
  if (!refusal.empty()) throw Refused(refusal);

  const auto verdict = co_await read_verdict(socket);
  if (verdict.status != 0) throw Refused(verdict.reason);
  Details their_details;
  const auto their_details_bytes = co_await read_details(socket, their_details);
  if (secret) {
    const auto their_proof = co_await read_proof(socket);
    if (!proofs_equal(their_proof, proof(local.secret, connector_label, hellos, their_details_bytes))) {
      refusal = mismatched_proof(their_hello.role, local.role);
    }
  }
  // Past the proof, a side that names this job is one of its processes, whatever else it says: a job
  // id both sides leave empty names no job unless the secret does.
  const bool of_this_job = refusal.empty() && their_details.job == local.job && (secret || !local.job.empty());
  const std::optional<int> member = of_this_job ? std::optional<int>(their_details.rank) : std::nullopt;
  if (refusal.empty()) refusal = details_disagreement(local, their_hello.role, their_details);
  auto theirs = greeting_of(their_hello, std::move(their_details));
  if (refusal.empty()) refusal = check(theirs);  // the other side proved the secret: it may claim now
  auto last = encode(Verdict{refusal.empty() ? 0u : 1u, refusal});
  if (refusal.empty()) {
    const auto my_details = encode(details_of(local));
    last = concat(std::move(last), my_details);
    if (secret) {
      last = concat(std::move(last), proof_bytes(proof(local.secret, acceptor_details_label, concat(hellos, their_details_bytes), my_details)));
    }
  }
  co_await write_all(socket, last);
  if (!refusal.empty()) throw Refused(refusal, member);
  if (secret) {
    theirs.send_key = proof(local.secret, frames_from_acceptor_label, their_hello_bytes, my_hello);
    theirs.recv_key = proof(local.secret, frames_from_connector_label, their_hello_bytes, my_hello);
  }
  co_return theirs;
}

awaitable<std::string> admit(tcp::socket& socket, const Local& local, const std::function<std::string(const Greeting&)>& check,
                              std::chrono::milliseconds timeout, Greeting* admitted, std::optional<int>* member) {
  try {
    if (auto theirs = co_await with_deadline(accept(socket, local, check), std::chrono::steady_clock::now() + timeout)) {
      if (admitted) *admitted = std::move(*theirs);
      co_return std::string();
    }
    co_return timeout.count() % 1000 == 0 ? fmt::format("no greeting within {} s", timeout.count() / 1000)
                                          : fmt::format("no greeting within {} ms", timeout.count());
  } catch (const Refused& e) {
    if (member) *member = e.member;
    co_return std::string(e.what());
  } catch (const std::system_error& e) {
    co_return fmt::format("the connection failed during the greeting: {}", e.code().message());
  }
}

PendingGreetings::Handle PendingGreetings::add(tcp::socket& socket, std::string from) {
  if (live_ >= limit_) {
    // The oldest greeting still running; evicted ones stay listed until their greeting notices the close.
    auto oldest = std::find_if(entries_.begin(), entries_.end(), [](const Entry& e) { return !e.evicted; });
    log_->refused(oldest->from, fmt::format("closed to make room: {} connections were still greeting (limit {})", live_, limit_));
    oldest->evicted = true;
    --live_;
    std::error_code ignored;
    oldest->socket->close(ignored);
  }
  ++live_;
  return entries_.insert(entries_.end(), Entry{&socket, std::move(from)});
}

bool PendingGreetings::remove(Handle handle) {
  const bool evicted = handle->evicted;
  if (!evicted) --live_;
  entries_.erase(handle);
  return evicted;
}

void PendingGreetings::close_all() {
  std::error_code ignored;
  for (auto& entry : entries_) entry.socket->close(ignored);
}

}  // namespace weft::greeting
