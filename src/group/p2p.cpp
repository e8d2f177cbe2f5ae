// Point-to-point: send and recv, each with its own deadline (a receive past it is withdrawn and the
// group stays usable; a send past it aborts the group, as it cannot be taken back).
#include "weft/group.hpp"

#include <algorithm>
#include <cstring>
#include <memory>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "group/checks.hpp"
#include "group/device_staging.hpp"
#include "group/state.hpp"

namespace weft {
namespace {

using namespace detail;

struct OpHook {
  bool finished = false;   // loop thread only
  bool timed_out = false;  // its deadline passed (the watchdog withdrew or aborted it)
  GroupState* g = nullptr;
  TransportOp* op = nullptr;
};

// A point-to-point operation's deadline: a receive still unmatched is withdrawn (the group stays usable);
// a send not written yet cannot be taken back from the receiver's view, so the group is aborted.
std::uint64_t watch_p2p(GroupState& g, const std::shared_ptr<OpHook>& hook, std::chrono::milliseconds timeout, bool is_send) {
  if (timeout.count() <= 0) return 0;
  const std::uint64_t id = g.p2p_ids++;
  std::function<void()> expire;
  if (is_send) {
    expire = [hook] {
      if (hook->finished) return;
      hook->timed_out = true;
      auto& g = *hook->g;
      g.transport->abort_context(g.context, Errc::timeout,
                                 fmt::format("a send from rank {} to rank {} [tag {}] passed its deadline: the receiver did not take it "
                                             "(a send cannot be withdrawn once started)",
                                             g.rank, g.group_rank(hook->op->peer), hook->op->key.tag));
    };
  } else {
    expire = [hook] {
      if (hook->finished) return;
      hook->timed_out = true;  // before: a withdrawn receive resumes its coroutine inside cancel_recv
      if (!hook->g->transport->cancel_recv(*hook->op)) hook->timed_out = false;  // it matched: let it finish
    };
  }
  g.watch(GroupState::Watched{id, std::chrono::steady_clock::now(), timeout, nullptr, std::move(expire)});
  return id;
}

// One send or receive: started on the transport, watched by its deadline, and cancellable through the
// awaiting task's stop token. Cancelling a receive withdraws it; a send on the wire cannot be taken back
// from the receiver's view, so cancelling it aborts the group. `data` is only read by a send.
Task<void> p2p_task(std::shared_ptr<GroupState> g, bool sending, void* data, std::size_t bytes, int peer, std::uint32_t tag,
                    std::uint64_t op_seq, std::chrono::milliseconds timeout) {
  TransportOp op;
  auto hook = std::make_shared<OpHook>(OpHook{false, false, g.get(), &op});
  const std::stop_token token = co_await this_stop_token();
  std::optional<std::stop_callback<std::function<void()>>> on_stop;
  if (token.stop_possible()) {
    on_stop.emplace(token, std::function<void()>([g, hook, sending, tag, &op] {
      g->loop->post([g, hook, sending, tag, &op] {
        if (hook->finished) return;
        if (sending) {
          g->transport->abort_context(g->context, Errc::cancelled, fmt::format("rank {} cancelled a send [tag {}]", g->rank, tag));
        } else {
          g->transport->cancel_recv(op);
        }
      });
    }));
  }
  const std::uint64_t watch_id = watch_p2p(*g, hook, timeout, sending);
  const int transport_peer = g->members[static_cast<std::size_t>(peer)];
  const MessageKey key{g->context, 0, tag};
  if (sending) {
    g->transport->start_send(transport_peer, key, data, bytes, op);
  } else {
    g->transport->start_recv(transport_peer, key, data, bytes, op);
  }
  co_await op.wait();
  hook->finished = true;
  if (watch_id) g->unwatch(watch_id);
  on_stop.reset();
  const char* name = sending ? "send" : "recv";
  if (!sending && hook->timed_out) {
    throw_error(Errc::timeout, g->where(name, static_cast<std::int64_t>(op_seq), peer, tag),
                fmt::format("the receive from rank {} [tag {}] passed its deadline ({}) on rank {}; it was withdrawn and the "
                            "group stays usable", peer, tag, GroupState::duration_text(timeout), g->rank));
  }
  if (op.error()) {
    throw_error(static_cast<Errc>(op.error().value()), g->where(name, static_cast<std::int64_t>(op_seq), peer, tag), op.reason());
  }
}

}  // namespace

Future<void> Group::send(ConstBufferView data, int dst, std::uint32_t tag) {
  auto& g = live("send");
  check_usable(g, "send");
  check_rank(g, "send", "destination", dst);
  check_buffer(g, "send", "data", data.data, data.count, data.dtype, data.device);
  const auto timeout = timeout_.count() >= 0 ? timeout_ : g.options.timeout;
  if (on_device(data.device, data.bytes())) {
    detail::StagedCall staged{"send", data, BufferView{}, true, false, false};
    return run_staged(state_, stream_, staged, timeout_, [this, dst, tag, timeout](ConstBufferView in, BufferView, std::uint64_t, algo::StagedBuffers*) {
      return p2p_task(state_, true, const_cast<void*>(in.data), in.bytes(), dst, tag, 0, timeout);
    });
  }
  return spawn(*g.loop, p2p_task(state_, true, const_cast<void*>(data.data), data.bytes(), dst, tag, 0, timeout));
}

Future<void> Group::recv(BufferView data, int src, std::uint32_t tag) {
  auto& g = live("recv");
  check_usable(g, "recv");
  check_rank(g, "recv", "source", src);
  check_buffer(g, "recv", "data", data.data, data.count, data.dtype, data.device);
  const auto timeout = timeout_.count() >= 0 ? timeout_ : g.options.timeout;
  if (on_device(data.device, data.bytes())) {
    detail::StagedCall staged{"recv", ConstBufferView{}, data, false, true, false};
    return run_staged(state_, stream_, staged, timeout_, [this, src, tag, timeout](ConstBufferView, BufferView out, std::uint64_t, algo::StagedBuffers*) {
      return p2p_task(state_, false, out.data, out.bytes(), src, tag, 0, timeout);
    });
  }
  return spawn(*g.loop, p2p_task(state_, false, data.data, data.bytes(), src, tag, 0, timeout));
}

}  // namespace weft
