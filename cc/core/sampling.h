// What the CPU and the CUDA sample ops share, written once for both (TF_HSM_HOST_DEVICE):
// the counter-based generator that gives row i at path depth d its uniform number, and
// the draw of a child from a node's logits. A sample is then the same class on either
// device for the same seed, up to the logits' last bits.
#ifndef TF_HSM_CC_CORE_SAMPLING_H_
#define TF_HSM_CC_CORE_SAMPLING_H_

#include <cmath>
#include <cstdint>

#include "cc/core/host_device.h"

namespace tf_hsm {
namespace sampling {

// The splitmix64 finaliser: a bijection of 64-bit words that mixes every input bit.
TF_HSM_HOST_DEVICE std::uint64_t Mix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// A uniform double in [0, 1) for (seed, row, step).
TF_HSM_HOST_DEVICE double Uniform(std::uint64_t seed, std::int64_t row, std::int64_t step) {
  const std::uint64_t x = Mix64(Mix64(Mix64(seed) + static_cast<std::uint64_t>(row)) +
                                static_cast<std::uint64_t>(step));
  return static_cast<double>(x >> 11) * 0x1.0p-53;
}

// Draws j with probability softmax(z / temperature)[j] by inverting the cumulative sum
// (accumulated in double) at u in [0, 1). z is overwritten. -1 when the logits hold NaN
// or +inf, or are all -inf (a -inf logit alone just masks its child).
// exp_in_place(z, K) sets z[j] = exp(z[j]) for j < K: the device's own exp (the CPU
// core's vector exp, CUDA's exp), so that each device draws as its log-probabilities
// are computed.
template <typename T, typename ExpInPlace>
TF_HSM_HOST_DEVICE std::int64_t PickSlot(T* z, std::int64_t K, T temperature, double u,
                                         const ExpInPlace& exp_in_place) {
  const T inf = static_cast<T>(HUGE_VAL);
  T m = -inf;
  for (std::int64_t j = 0; j < K; ++j) {
    if (z[j] != z[j]) return -1;  // NaN
    m = z[j] > m ? z[j] : m;
  }
  if (m == -inf || m == inf) return -1;  // some logit +inf, or all -inf
  for (std::int64_t j = 0; j < K; ++j) z[j] = (z[j] - m) / temperature;
  exp_in_place(z, K);
  double total = 0;
  for (std::int64_t j = 0; j < K; ++j) total += static_cast<double>(z[j]);
  const double target = u * total;
  double acc = 0;
  std::int64_t last = -1;
  for (std::int64_t j = 0; j < K; ++j) {
    if (!(z[j] > T(0))) continue;
    acc += static_cast<double>(z[j]);
    last = j;
    if (acc > target) return j;
  }
  return last;  // u * total rounded up to total
}

}  // namespace sampling
}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_SAMPLING_H_
