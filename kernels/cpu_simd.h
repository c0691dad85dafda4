// Vector helpers shared by the CPU kernels (cpu_ops.cpp, cpu_attention.cpp); part of the
// library's source for cpu_attention.py's cache key.
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>

namespace folio_simd {

// exp on 16 lanes, for x within [-104, 88]: Cephes' expf (x = n ln2 + r, a degree-7 polynomial in
// r, scaled by 2^n), ~1 ulp as glibc's and Sleef's are. glibc's expf is a scalar call in these
// loops, or libmvec's 8-lane AVX2 one at best: most of silu_mul's time, ~5 % of decode attention's.
__attribute__((always_inline)) inline __m512 exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2 in two parts: r exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// the first n (< 16) lanes, or all 16
inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1); }

// s[i] = exp(s[i] - m) for i < n, in place (arguments below -104 taken as -104: e^-104 is 0 in
// float32); returns their sum. A softmax's numerators, for m >= every s[i].
inline float exp_minus_sum(float* s, int64_t n, float m) {
  __m512 sum = _mm512_setzero_ps();
  const __m512 mv = _mm512_set1_ps(m), lo = _mm512_set1_ps(-104.f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = first_lanes(n - i);
    const __m512 e = exp16(_mm512_max_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), mv), lo));
    _mm512_mask_storeu_ps(s + i, k, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
  }
  return _mm512_reduce_add_ps(sum);
}

}  // namespace folio_simd
#endif
