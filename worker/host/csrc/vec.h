// 16-float vectors for the CPU kernels: GCC/Clang vector extensions, which build to AVX-512,
// AVX2 (two registers a vector) or NEON, whichever the build targets.

#pragma once

#include <cstdint>
#include <cstring>

namespace conveyor {

constexpr int64_t kWidth = 16;  // floats per vector
typedef float vec __attribute__((vector_size(kWidth * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(kWidth * sizeof(int32_t))));

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof(v)); }

// A splat, not `vec{} + f`: adding f to a zero vector is an add the compiler must keep
// (-0.0 + 0.0 is +0.0), and it builds to a scalar add and a register-to-register broadcast
// on the shuffle port, which on AVX-512 is one of the two FMA ports. A splat builds to one
// broadcast load, or the FMA's own {1to16} operand, and leaves both FMA ports to the FMAs.
inline vec broadcast(float f) {
  return vec{f, f, f, f, f, f, f, f, f, f, f, f, f, f, f, f};
}

// The lane sums of 16 vectors as one vector (lane i: the sum of acc[i]), in 15 shuffle-and-add
// steps of a fixed tree instead of 240 scalar adds.
#if defined(__clang__) || __GNUC__ >= 12
#define CONVEYOR_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else  // GCC 11 and older: the same selection from the concatenation of a and b
#define CONVEYOR_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, ivec{__VA_ARGS__})
#endif

inline vec pair8(vec a, vec b) {  // [a0..7 + a8..15, b0..7 + b8..15]
  return CONVEYOR_SHUFFLE(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         CONVEYOR_SHUFFLE(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
inline vec pair4(vec a, vec b) {  // halves of 8 partial sums each -> quarters of 4
  return CONVEYOR_SHUFFLE(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         CONVEYOR_SHUFFLE(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
inline vec pair2(vec a, vec b) {  // quarters of 4 -> eighths of 2
  return CONVEYOR_SHUFFLE(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
         CONVEYOR_SHUFFLE(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
inline vec pair1(vec a, vec b) {  // eighths of 2 -> one sum a lane
  return CONVEYOR_SHUFFLE(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         CONVEYOR_SHUFFLE(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
inline vec lane_sums16(const vec* acc) {
  vec t[8], u[4];
  for (int i = 0; i < 8; ++i) t[i] = pair8(acc[2 * i], acc[2 * i + 1]);
  for (int i = 0; i < 4; ++i) u[i] = pair4(t[2 * i], t[2 * i + 1]);
  return pair1(pair2(u[0], u[1]), pair2(u[2], u[3]));
}

// e^x lane by lane, to within ~1 ulp (torch's own vectorised exp is as close, not equal):
// x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so r is exact), e^r by a degree-6
// polynomial (the Cephes coefficients), and 2^n put straight into the exponent bits. Below
// -87.3 (e^x under the smallest normal float) it is 0; above 88.7 it stays at ~2^128's
// neighbour rather than inf, which no caller here can tell apart.
inline vec vexp(vec x) {
  const vec lo = broadcast(-87.33654f), hi = broadcast(88.72283f);
  const ivec under = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  // Round to nearest by the 1.5 * 2^23 trick: the sum's low bits are n.
  const vec magic = broadcast(12582912.0f);
  const vec shifted = x * broadcast(1.44269504088896341f) + magic;
  const vec n = shifted - magic;
  vec r = x - n * broadcast(0.693359375f);
  r = r - n * broadcast(-2.12194440e-4f);
  vec p = broadcast(1.9875691500e-4f);
  p = p * r + broadcast(1.3981999507e-3f);
  p = p * r + broadcast(8.3334519073e-3f);
  p = p * r + broadcast(4.1665795894e-2f);
  p = p * r + broadcast(1.6666665459e-1f);
  p = p * r + broadcast(5.0000001201e-1f);
  p = p * (r * r) + r + broadcast(1.0f);
  // 2^n as two factors of 2^(n/2): each stays a normal float over the whole clamped range
  // (n from -126 to 128), where 2^128 itself would not.
  ivec ni = __builtin_convertvector(n, ivec);
  const ivec half = ni >> 1;
  vec s1, s2;
  const ivec b1 = (half + 127) << 23, b2 = (ni - half + 127) << 23;
  std::memcpy(&s1, &b1, sizeof(s1));
  std::memcpy(&s2, &b2, sizeof(s2));
  p = p * s1 * s2;
  return under ? vec{} : p;
}

}  // namespace conveyor
