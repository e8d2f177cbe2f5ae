// Bootstrap: configuration from each environment convention, IPv6 loopback, binding to a named interface.
#include <catch2/catch.hpp>

#include <cstdio>
#include <fstream>
#include <map>

#include <unistd.h>

#include "support/harness.hpp"
#include "algorithms/selection.hpp"

using namespace weft;
using namespace weft::test;

namespace {

Options from(std::map<std::string, std::string> env) {
  Options o;
  o.from_environment([&](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
  return o;
}

}  // namespace

TEST_CASE("weft's own variables configure a rank", "[bootstrap][env]") {
  auto o = from({{"WEFT_RANK", "2"}, {"WEFT_WORLD_SIZE", "4"}, {"WEFT_STORE", "10.1.2.3:4000"}, {"WEFT_IFNAME", "eth1"}});
  CHECK(o.rank == 2);
  CHECK(o.world_size == 4);
  CHECK(o.store == "10.1.2.3:4000");
  CHECK(o.interface == "eth1");
}

TEST_CASE("torchrun's variables configure a rank", "[bootstrap][env]") {
  auto o = from({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "node7"}, {"MASTER_PORT", "29400"}});
  CHECK(o.rank == 1);
  CHECK(o.world_size == 2);
  CHECK(o.store == "node7:29400");
  auto v6 = from({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "::1"}, {"MASTER_PORT", "29401"}});
  CHECK(v6.store == "[::1]:29401");
}

TEST_CASE("Open MPI's, PMI's and Slurm's variables configure a rank", "[bootstrap][env]") {
  auto ompi = from({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "5"}});
  CHECK(ompi.rank == 3);
  CHECK(ompi.world_size == 5);
  CHECK(ompi.store == "127.0.0.1:29500");
  auto pmi = from({{"PMI_RANK", "0"}, {"PMI_SIZE", "3"}, {"WEFT_STORE", "[fe80::1]:1234"}});
  CHECK(pmi.rank == 0);
  CHECK(pmi.world_size == 3);
  CHECK(pmi.store == "[fe80::1]:1234");
  auto slurm = from({{"SLURM_PROCID", "6"}, {"SLURM_NTASKS", "8"}, {"MASTER_ADDR", "head"}});
  CHECK(slurm.rank == 6);
  CHECK(slurm.world_size == 8);
  CHECK(slurm.store == "head:29500");
}

TEST_CASE("conventions are read in order: weft's first", "[bootstrap][env]") {
  auto o = from({{"WEFT_RANK", "1"}, {"WEFT_WORLD_SIZE", "2"}, {"RANK", "5"}, {"WORLD_SIZE", "9"}, {"SLURM_PROCID", "7"}, {"SLURM_NTASKS", "8"}});
  CHECK(o.rank == 1);
  CHECK(o.world_size == 2);
  auto t = from({{"RANK", "5"}, {"WORLD_SIZE", "9"}, {"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "1"}});
  CHECK(t.rank == 5);
  CHECK(t.world_size == 9);
}

TEST_CASE("a malformed or missing variable is an error that names it", "[bootstrap][env]") {
  CHECK_THROWS_WITH(from({{"WEFT_RANK", "x1"}, {"WEFT_WORLD_SIZE", "2"}}), Catch::Contains("WEFT_RANK='x1' is not an integer"));
  CHECK_THROWS_WITH(from({{"WEFT_RANK", "3"}, {"WEFT_WORLD_SIZE", "2"}}), Catch::Contains("WEFT_RANK=3 is out of range"));
  CHECK_THROWS_WITH(from({{"RANK", "0"}}), Catch::Contains("RANK and WORLD_SIZE must be set together"));
  CHECK_THROWS_WITH(from({}), Catch::Contains("no rank and world size"));
  {  // One of the two given as an Option (Python's Group.create(world_size=2)): the error says which is missing.
    Options o;
    o.world_size = 2;
    CHECK_THROWS_WITH(o.from_environment([](const char*) -> const char* { return nullptr; }),
                      Catch::Contains("no rank (the world size was given)"));
  }
  CHECK_THROWS_WITH(from({{"WEFT_RANK", "0"}, {"WEFT_WORLD_SIZE", "2"}, {"WEFT_STORE", "nohostport"}}), Catch::Contains("expected host:port"));
  CHECK_THROWS_WITH(from({{"WEFT_RANK", "0"}, {"WEFT_WORLD_SIZE", "2"}, {"WEFT_STORE", "::1:80"}}), Catch::Contains("[address]:port"));
  // Port 0: rank 0 served the store on a port the kernel picked, and every rank (rank 0 too) then said
  // "rank 0 never served the store at 127.0.0.1:0" after the whole bootstrap timeout.
  CHECK_THROWS_WITH(from({{"WEFT_RANK", "1"}, {"WEFT_WORLD_SIZE", "2"}, {"WEFT_STORE", "127.0.0.1:0"}}), Catch::Contains("has port 0"));
  CHECK(from({{"WEFT_RANK", "0"}, {"WEFT_WORLD_SIZE", "1"}, {"WEFT_STORE", "127.0.0.1:0"}}).store == "127.0.0.1:0");  // no store for 1 rank
  CHECK_THROWS_WITH(from({{"WEFT_RANK", "0"}, {"WEFT_WORLD_SIZE", "2"}, {"WEFT_PIPELINE_DEPTH", "0"}}), Catch::Contains("WEFT_PIPELINE_DEPTH=0 is out of range"));
}

TEST_CASE("ranks meet over IPv6 loopback", "[bootstrap][ipv6]") {
  if (free_port(true) == 0) {
    WARN("skipped: no IPv6 loopback on this machine");
    return;
  }
  Options o;
  o.store = "[::1]:" + std::to_string(free_port(true));
  const long before = checks_made.load();
  run_ranks(3, [](Group& g) {
    std::vector<double> v(100, 1.5);
    g.all_reduce(v).get();
    check(v[99] == 4.5, "all_reduce over IPv6");
  }, o);
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("ranks bind to the interface they are told", "[bootstrap][ifname]") {
  Options o;
  o.interface = "lo";
  const long before = checks_made.load();
  run_ranks(2, [](Group& g) {
    std::vector<std::int32_t> v{g.rank() + 1};
    g.all_reduce(v).get();
    check(v[0] == 3, "all_reduce over lo");
  }, o);
  REQUIRE(checks_made.load() > before);
  Options bad;
  bad.interface = "no-such-interface0";
  bad.bootstrap_timeout = std::chrono::seconds(3);  // rank 1 may find rank 0's store already gone
  CHECK_THROWS_WITH(run_ranks(2, [](Group&) {}, bad), Catch::Contains("interface 'no-such-interface0'"));
}

TEST_CASE("WEFT_ALGO chooses algorithms by size, and a malformed value says what was expected", "[bootstrap][algo]") {
  algorithms::Selection s;
  CHECK(s.choose("all_reduce", 8, 4) == "recursive_doubling");
  CHECK(s.choose("all_reduce", 1 << 20, 4) == "rabenseifner");
  CHECK(s.choose("all_reduce", 1 << 20, 2) == "bidirectional_ring");
  CHECK(s.choose("all_reduce", 64 << 20, 4) == "ring");
  CHECK(s.choose("broadcast", 8, 4) == "chain");
  CHECK(s.choose("broadcast", 8, 8) == "binomial");
  s.override_with("all_reduce:recursive_doubling@0-16K,rabenseifner@16K-1M,ring", "WEFT_ALGO");
  CHECK(s.choose("all_reduce", 16383, 4) == "recursive_doubling");
  CHECK(s.choose("all_reduce", 16384, 4) == "rabenseifner");
  CHECK(s.choose("all_reduce", (1 << 20) - 1, 4) == "rabenseifner");
  CHECK(s.choose("all_reduce", 1 << 20, 4) == "ring");
  s.override_with("all_reduce:tree@1K-2K; broadcast:binomial", "WEFT_ALGO");
  CHECK(s.choose("all_reduce", 1500, 4) == "tree");
  CHECK(s.choose("all_reduce", 8, 4) == "recursive_doubling");  // outside every range: the built-in table
  CHECK(s.choose("broadcast", 8, 4) == "binomial");
  algorithms::Selection t;
  CHECK_THROWS_WITH(t.override_with("all_reduce=ring", "WEFT_ALGO"), Catch::Contains("has no ':'") && Catch::Contains("Expected collective:algorithm"));
  CHECK_THROWS_WITH(t.override_with("allreduce:ring", "WEFT_ALGO"), Catch::Contains("unknown collective 'allreduce'"));
  CHECK_THROWS_WITH(t.override_with("all_reduce:bruck", "WEFT_ALGO"), Catch::Contains("'bruck' is not an algorithm of all_reduce (valid: ring, bidirectional_ring, recursive_doubling"));
  CHECK_THROWS_WITH(t.override_with("all_reduce:ring@16K", "WEFT_ALGO"), Catch::Contains("has no '-'"));
  CHECK_THROWS_WITH(t.override_with("all_reduce:ring@1X-2K", "WEFT_ALGO"), Catch::Contains("'1X' is not a size"));
  CHECK_THROWS_WITH(t.override_with("all_reduce:ring@2K-1K", "WEFT_ALGO"), Catch::Contains("is empty"));
  // Group::create refuses it before anything starts.
  Loop loop(Loop::Options{std::chrono::microseconds(0)});
  Options o;
  o.rank = 0;
  o.world_size = 1;
  o.algorithms = "all_reduce:fastest";
  CHECK_THROWS_WITH(Group::create(loop, o), Catch::Contains("WEFT_ALGO='all_reduce:fastest'"));
}

TEST_CASE("a tuning file is loaded before WEFT_ALGO, and a bad one is refused by name", "[bootstrap][algo]") {
  const std::string path = "/tmp/weft-test-tuning-" + std::to_string(::getpid()) + ".txt";
  {
    std::ofstream f(path);
    f << "# written by a test\nall_reduce:tree@0-1K,ring\n";
  }
  Loop loop(Loop::Options{std::chrono::microseconds(0)});
  Options o;
  o.rank = 0;
  o.world_size = 1;
  o.tuning_file = path;
  Group g = Group::create(loop, o).get();
  CHECK(g.algorithm_for("all_reduce", 100) == "tree");
  CHECK(g.algorithm_for("all_reduce", 1 << 20) == "ring");
  o.algorithms = "all_reduce:rabenseifner@0-1K";  // WEFT_ALGO wins over the file
  Group h = Group::create(loop, o).get();
  CHECK(h.algorithm_for("all_reduce", 100) == "rabenseifner");
  g.override_algorithms("all_reduce:recursive_doubling");
  CHECK(g.algorithm_for("all_reduce", 1 << 20) == "recursive_doubling");
  CHECK_THROWS_WITH(g.override_algorithms("all_reduce:quick"), Catch::Contains("'quick' is not an algorithm"));
  {
    std::ofstream f(path);
    f << "all_reduce ring\n";
  }
  CHECK_THROWS_WITH(Group::create(loop, o), Catch::Contains("the tuning file " + path) && Catch::Contains("has no ':'"));
  std::remove(path.c_str());
  o.tuning_file = "/nonexistent/weft-tuning.txt";
  CHECK_THROWS_WITH(Group::create(loop, o), Catch::Contains("cannot read the tuning file '/nonexistent/weft-tuning.txt'") &&
                                               Catch::Contains("No such file or directory"));
  // A directory opens and reads as an empty file: it was taken as a file without choices.
  o.tuning_file = "/tmp";
  CHECK_THROWS_WITH(Group::create(loop, o), Catch::Contains("cannot read the tuning file '/tmp'") && Catch::Contains("it is a directory"));
}
