// defines: Rng, a small counter-based random generator (splitmix64 over a 64-bit counter). Its
// whole state is two integers, so checkpoints save it exactly, and streams derived from
// (seed, key) let every parameter be initialised the same whatever the mesh or the order of work.
#pragma once

#include <cstdint>
#include <string_view>

namespace moetrain {

class Rng {
 public:
  explicit Rng(uint64_t seed = 0, uint64_t counter = 0) : seed_(seed), counter_(counter) {}
  // An independent stream named by `key` (a parameter name, "data", ...).
  static Rng for_key(uint64_t seed, std::string_view key);

  uint64_t next_u64();
  double uniform();                // [0, 1)
  double normal();                 // standard normal (Box-Muller, uses two draws)
  uint64_t below(uint64_t bound);  // uniform integer in [0, bound), bound > 0

  uint64_t seed() const { return seed_; }
  uint64_t counter() const { return counter_; }

 private:
  uint64_t seed_;
  uint64_t counter_;
};

uint64_t hash_string(std::string_view text);  // FNV-1a, stable across platforms

}  // namespace moetrain
