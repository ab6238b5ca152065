// The optimization switch (nanovllm.cu section 2, used by Part II): --plain and --opt parse as documented,
// every named optimization exists as a field of Optimizations and a line of --help, and the switch travels
// to the tensor-parallel workers with the rest of Config. No GPU needed.
#define NANOVLLM_TESTING
#include "../../nanovllm.cu"
#include "../test.h"

static int count_on(const Optimizations& o) {
  int n = 0;
  for (const OptimizationInfo& k : kOptimizations) n += o.*k.on;
  return n;
}
static const int kNumOptimizations = (int)(sizeof kOptimizations / sizeof kOptimizations[0]);

// Every field of Optimizations has exactly one name, and every name one field.
TEST(every_optimization_is_named_once) {
  CHECK_EQ(sizeof(Optimizations), (size_t)kNumOptimizations * sizeof(bool));
  std::set<std::string> names;
  for (const OptimizationInfo& k : kOptimizations) {
    CHECK_MSG(names.insert(k.name).second, "name %s twice", k.name);
    Optimizations o;
    parse_optimizations("none", o);
    o.*k.on = true;
    CHECK_MSG(count_on(o) == 1, "%s sets %d fields", k.name, count_on(o));
    CHECK_MSG(std::string(k.what).find("section") != std::string::npos || std::string(k.what).find("(1") != std::string::npos,
              "%s: its description names no section", k.name);
  }
  CHECK_EQ((int)names.size(), 7);
  for (const char* n : {"pdl", "gemv", "cluster_merge", "fused_rope", "oneshot_allreduce", "fast_sampler", "persistent"})
    CHECK_MSG(names.count(n), "no optimization named %s", n);
}

// Every optimization is on by default except section 22's persistent kernel, which is not yet faster than
// the rest on an H100 (README): it runs with --opt all or --opt persistent.
TEST(defaults_are_all_but_persistent) {
  Optimizations o;
  CHECK_EQ(count_on(o), kNumOptimizations - 1);
  CHECK(!o.persistent);
  CHECK_EQ(optimizations_str(o), std::string("all except persistent"));
  Config c;
  CHECK_EQ(count_on(c.opt), kNumOptimizations - 1);
  CHECK_EQ(parse_optimizations("all", o), std::string(""));
  CHECK_EQ(optimizations_str(o), std::string("all"));
}

TEST(parse_lists_left_to_right) {
  Optimizations o;
  CHECK_EQ(parse_optimizations("none", o), std::string(""));
  CHECK_EQ(count_on(o), 0);
  CHECK_EQ(optimizations_str(o), std::string("none (Part I alone)"));
  CHECK_EQ(parse_optimizations("gemv,+pdl", o), std::string(""));
  CHECK(o.gemv && o.pdl && !o.fused_rope && !o.cluster_merge && !o.oneshot_allreduce && !o.fast_sampler);
  CHECK_EQ(optimizations_str(o), std::string("pdl gemv"));
  CHECK_EQ(parse_optimizations("all,-fused_rope,-fast_sampler", o), std::string(""));
  CHECK(!o.fused_rope && !o.fast_sampler && o.gemv && o.cluster_merge && o.pdl && o.oneshot_allreduce);
  CHECK_EQ(parse_optimizations("-pdl,none,cluster_merge", o), std::string(""));  // none resets what came before
  CHECK_EQ(count_on(o), 1);
  CHECK(o.cluster_merge);
  CHECK_EQ(parse_optimizations("all", o), std::string(""));
  CHECK_EQ(count_on(o), kNumOptimizations);
}

TEST(parse_refuses_what_it_does_not_know) {
  Optimizations o;
  std::string e = parse_optimizations("none,fused_gemv", o);
  CHECK_MSG(e.find("unknown optimization 'fused_gemv'") != std::string::npos, "%s", e.c_str());
  for (const OptimizationInfo& k : kOptimizations) CHECK_MSG(e.find(k.name) != std::string::npos, "%s", e.c_str());
  CHECK(!parse_optimizations("", o).empty());
  CHECK(!parse_optimizations("gemv,", o).empty());  // an empty item is an unknown name
  CHECK(!parse_optimizations("-none", o).empty());
  CHECK(!parse_optimizations("+all", o).empty());
  CHECK(!parse_optimizations("GEMV", o).empty());
}

// --plain and --opt on the command line, as main() sees them; --help lists every name.
TEST(command_line_flags) {
  auto parse = [](std::vector<const char*> args) {
    args.insert(args.begin(), "nanovllm");
    return parse_args((int)args.size(), const_cast<char**>(args.data()));
  };
  CHECK_EQ(count_on(parse({"model", "p.txt"}).config.opt), kNumOptimizations - 1);  // all but persistent
  CHECK_EQ(count_on(parse({"--plain", "model"}).config.opt), 0);
  Cli c = parse({"--opt", "-pdl", "--opt=-gemv"});
  CHECK(!c.config.opt.pdl && !c.config.opt.gemv && c.config.opt.fused_rope);
  c = parse({"--plain", "--opt", "fast_sampler"});
  CHECK_EQ(count_on(c.config.opt), 1);
  CHECK(c.config.opt.fast_sampler);
  for (const OptimizationInfo& k : kOptimizations)
    CHECK_MSG(std::string(kUsage).find(k.name) != std::string::npos, "--help does not name %s", k.name);
  CHECK(std::string(kUsage).find("--plain") != std::string::npos);
}

// The workers build their engine from Config as JSON (section 25): the switch must survive the trip.
TEST(switch_travels_to_the_workers) {
  Config c;
  parse_optimizations("none,gemv,oneshot_allreduce", c.opt);
  Config back = config_from_json(config_to_json(c));
  for (const OptimizationInfo& k : kOptimizations)
    CHECK_MSG(back.opt.*k.on == c.opt.*k.on, "%s did not travel", k.name);
}

int main(int argc, char** argv) { return test_main(argc, argv); }
