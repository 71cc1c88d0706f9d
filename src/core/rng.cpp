// defines: the Rng stream (splitmix64 of seed + counter) and its derived distributions.
#include "core/rng.h"

#include <cmath>
#include <numbers>

#include "core/error.h"

namespace moetrain {

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

uint64_t hash_string(std::string_view text) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

Rng Rng::for_key(uint64_t seed, std::string_view key) { return Rng(splitmix64(seed) ^ hash_string(key), 0); }

uint64_t Rng::next_u64() { return splitmix64(seed_ ^ splitmix64(counter_++)); }

double Rng::uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }

double Rng::normal() {
  const double u1 = 1.0 - uniform();  // (0, 1]: log stays finite
  const double u2 = uniform();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

uint64_t Rng::below(uint64_t bound) {
  MT_CHECK(bound > 0, "rng: below(0)");
  // Rejection keeps the distribution exactly uniform.
  const uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
  uint64_t x;
  do {
    x = next_u64();
  } while (x >= limit);
  return x % bound;
}

}  // namespace moetrain
