// The few vector primitives the int16-activation kernels are written over (int16_activations.cpp: q4_1, q8_0, q5_0,
// q5_1, iq4_nl; kquant_int16.cpp: q3_k, q4_k, q5_k, q6_k), so that one source builds for AVX-512 VNNI and for AVX2.
//
// 16 lanes of int32 or float32 (one per output row of a group of 16) and 64 bytes: one AVX-512 register each, or two
// AVX2 ones (lanes 0-7, 8-15; bytes 0-31, 32-63). dot4 is VPDPBUSD on AVX-512 VNNI; on AVX2 the same products as
// VPMADDUBSW (unsigned by signed bytes, pairs summed into int16) then VPMADDWD by ones (pairs into int32). Those int16
// pairs saturate above 32,767, so on AVX2 a format's unsigned codes must stay below 128 (q4: 15, q5: 31, q6: 63);
// q8_0's and iq4_nl's signed codes take dot4_signed instead (llama.cpp's trick: |q| as the unsigned bytes, x with
// q's sign, which with |x| <= 127 stays within 2 x 128 x 127).
#pragma once

#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <cstring>

#include "int16_activations.h"

namespace lmserve_int16 {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
constexpr bool kAvx512 = true;
using I32 = __m512i;
using F32 = __m512;
using U8 = __m512i;
template <bool kHalves>
inline void split(const float* x, int64_t M, int64_t K, Activations& a) {
  split_rows<kHalves>(x, M, K, a);
}
inline U8 load64(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline void store64(uint8_t* p, U8 a) { _mm512_storeu_si512(p, a); }
inline U8 and8(U8 a, int mask) { return _mm512_and_si512(a, _mm512_set1_epi8(static_cast<char>(mask))); }
inline U8 or8(U8 a, U8 b) { return _mm512_or_si512(a, b); }
template <int N> inline U8 shift_left16(U8 a) { return _mm512_slli_epi16(a, N); }
template <int N> inline U8 shift_right16(U8 a) { return _mm512_srli_epi16(a, N); }
inline I32 zero_i() { return _mm512_setzero_si512(); }
inline F32 zero_f() { return _mm512_setzero_ps(); }
// acc + per lane n: the 4 unsigned bytes 4n..4n+3 of q times the 4 signed bytes at x.
inline I32 dot4(I32 acc, U8 q, const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm512_dpbusd_epi32(acc, q, _mm512_set1_epi32(v));
}
// acc + the dot products of rows[0..count) with the 4 activations each at x + 4j (count a multiple of kPerWiden).
template <int kPerWiden>
inline I32 dot_rows(I32 acc, const U8* rows, int count, const int8_t* x) {
  for (int j = 0; j < count; ++j) acc = dot4(acc, rows[j], x + 4 * j);
  return acc;
}
inline I32 add_i(I32 a, I32 b) { return _mm512_add_epi32(a, b); }
inline I32 sub_i(I32 a, int32_t b) { return _mm512_sub_epi32(a, _mm512_set1_epi32(b)); }
inline I32 shift_left32_8(I32 a) { return _mm512_slli_epi32(a, 8); }
inline F32 to_float(I32 a) { return _mm512_cvtepi32_ps(a); }
inline F32 set1(float v) { return _mm512_set1_ps(v); }
inline F32 mul(F32 a, F32 b) { return _mm512_mul_ps(a, b); }
inline F32 add(F32 a, F32 b) { return _mm512_add_ps(a, b); }
inline F32 fmadd(F32 a, F32 b, F32 c) { return _mm512_fmadd_ps(a, b, c); }
inline F32 fnmadd(F32 a, F32 b, F32 c) { return _mm512_fnmadd_ps(a, b, c); }
inline F32 loadu(const float* p) { return _mm512_loadu_ps(p); }
inline void storeu(float* p, F32 a) { _mm512_storeu_ps(p, a); }
inline F32 widen16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline F32 bytes_unsigned(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline F32 bytes_signed(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// Each byte (a code in 0..15) replaced by table[code]: VPSHUFB within each 16-byte lane (iq4_nl's values).
inline U8 lookup16(U8 codes, const uint8_t table[16]) {
  return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table))), codes);
}
// Integer sub-block scales folded into the products (kquant_int16.cpp's per-256 activations): a block's 16 scale
// bytes, one per output lane (AVX-512: as int32; AVX2: as two equal int16 per lane, what VPMADDWD pairs them with).
using Scales = __m512i;
inline Scales scales_unsigned(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline Scales scales_signed(const uint8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// acc + scale x (the dot products of rows[0..count) with the 4 activations each at x + 4j), per lane.
template <int kPerWiden>
inline I32 dot_rows_scaled(I32 acc, const U8* rows, int count, const int8_t* x, Scales scale) {
  I32 dot = _mm512_setzero_si512();
  for (int j = 0; j < count; ++j) dot = dot4(dot, rows[j], x + 4 * j);
  return _mm512_add_epi32(acc, _mm512_mullo_epi32(dot, scale));
}
// Lane n: the 16-bit pair (a[n], b[n]) of two rows of 16 bytes (unsigned or signed), for madd_pairs.
inline I32 byte_pairs(const uint8_t* a, const uint8_t* b, bool is_signed) {
  const __m128i va = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  const __m128i vb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  const __m128i low = _mm_unpacklo_epi8(va, vb), high = _mm_unpackhi_epi8(va, vb);
  const __m256i lo = is_signed ? _mm256_cvtepi8_epi16(low) : _mm256_cvtepu8_epi16(low);
  const __m256i hi = is_signed ? _mm256_cvtepi8_epi16(high) : _mm256_cvtepu8_epi16(high);
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
// acc + per lane: pairs' first 16-bit value x packed's low half + its second x packed's high half.
inline I32 madd_pairs(I32 acc, I32 pairs, int32_t packed) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi32(packed)));
}
inline I32 sub_i(I32 a, I32 b) { return _mm512_sub_epi32(a, b); }
template <int N> inline I32 shift_left32(I32 a) { return _mm512_slli_epi32(a, N); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LMSERVE_INT16_KERNELS_AVX2 1
constexpr bool kAvx512 = false;
// split_rows_avx2 (on), or split_rows_portable as before it (off: the op set_avx2_split(false),
// LMSERVE_DISABLE_CPU_FEATURES=avx2-split), for tests and benchmarks of that path. Set before a model runs, not
// during: the two round a block's float sum in another order (the int8 halves are the same).
inline std::atomic<bool> avx2_vector_split{true};
struct I32 { __m256i lo, hi; };
struct F32 { __m256 lo, hi; };
using U8 = I32;
template <bool kHalves>
inline void split(const float* x, int64_t M, int64_t K, Activations& a) {
  if (avx2_vector_split.load(std::memory_order_relaxed)) split_rows_avx2(x, M, K, a);
  else split_rows_portable(x, M, K, a);
}
inline U8 load64(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline void store64(uint8_t* p, U8 a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), a.lo);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 32), a.hi);
}
inline U8 and8(U8 a, int mask) {
  const __m256i m = _mm256_set1_epi8(static_cast<char>(mask));
  return {_mm256_and_si256(a.lo, m), _mm256_and_si256(a.hi, m)};
}
inline U8 or8(U8 a, U8 b) { return {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
template <int N> inline U8 shift_left16(U8 a) { return {_mm256_slli_epi16(a.lo, N), _mm256_slli_epi16(a.hi, N)}; }
template <int N> inline U8 shift_right16(U8 a) { return {_mm256_srli_epi16(a.lo, N), _mm256_srli_epi16(a.hi, N)}; }
inline I32 zero_i() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline F32 zero_f() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline I32 dot4(I32 acc, U8 q, const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  const __m256i b = _mm256_set1_epi32(v), ones = _mm256_set1_epi16(1);
  return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(_mm256_maddubs_epi16(q.lo, b), ones)),
          _mm256_add_epi32(acc.hi, _mm256_madd_epi16(_mm256_maddubs_epi16(q.hi, b), ones))};
}
// dot_rows on AVX2: kPerWiden VPMADDUBSW results summed in int16 before one VPMADDWD widens them (3 instructions a
// row become ~2). Exact while kPerWiden x 2 x (largest code) x 127 <= 32,767: 8 rows of 4-bit codes, 4 of 5-bit, 2 of
// 6-bit (split_rows_portable keeps |x| <= 127).
template <int kPerWiden>
inline I32 dot_rows(I32 acc, const U8* rows, int count, const int8_t* x) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int j = 0; j < count; j += kPerWiden) {
    __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
    for (int w = 0; w < kPerWiden; ++w) {
      int32_t v;
      std::memcpy(&v, x + 4 * (j + w), 4);
      const __m256i b = _mm256_set1_epi32(v);
      lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(rows[j + w].lo, b));
      hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(rows[j + w].hi, b));
    }
    acc = {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(lo, ones)), _mm256_add_epi32(acc.hi, _mm256_madd_epi16(hi, ones))};
  }
  return acc;
}
// q8_0 on AVX2: q as signed bytes (the packed q + 128 with its top bit flipped); the products as dot4's from |q| and
// x given q's sign. Exact while |x| <= 127 (split_rows_portable's halves).
inline U8 flip_top_bits(U8 a) {
  const __m256i top = _mm256_set1_epi8(static_cast<char>(0x80));
  return {_mm256_xor_si256(a.lo, top), _mm256_xor_si256(a.hi, top)};
}
inline U8 abs8(U8 q) { return {_mm256_sign_epi8(q.lo, q.lo), _mm256_sign_epi8(q.hi, q.hi)}; }
inline I32 dot4_signed(I32 acc, U8 magnitude, U8 q, const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  const __m256i b = _mm256_set1_epi32(v), ones = _mm256_set1_epi16(1);
  return {_mm256_add_epi32(acc.lo,
                           _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude.lo, _mm256_sign_epi8(b, q.lo)), ones)),
          _mm256_add_epi32(acc.hi,
                           _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude.hi, _mm256_sign_epi8(b, q.hi)), ones))};
}
inline I32 add_i(I32 a, I32 b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline I32 sub_i(I32 a, int32_t b) {
  const __m256i v = _mm256_set1_epi32(b);
  return {_mm256_sub_epi32(a.lo, v), _mm256_sub_epi32(a.hi, v)};
}
inline I32 shift_left32_8(I32 a) { return {_mm256_slli_epi32(a.lo, 8), _mm256_slli_epi32(a.hi, 8)}; }
inline F32 to_float(I32 a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline F32 set1(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline F32 mul(F32 a, F32 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F32 add(F32 a, F32 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F32 fmadd(F32 a, F32 b, F32 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline F32 fnmadd(F32 a, F32 b, F32 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline F32 loadu(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void storeu(float* p, F32 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline F32 widen16(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
inline F32 bytes_unsigned(const uint8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))),
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))))};
}
inline F32 bytes_signed(const uint8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))))};
}
inline U8 lookup16(U8 codes, const uint8_t table[16]) {
  const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table)));
  return {_mm256_shuffle_epi8(t, codes.lo), _mm256_shuffle_epi8(t, codes.hi)};
}
using Scales = I32;  // lane n: the 16-bit pair (sc[n], sc[n])
inline Scales scales_unsigned(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v)), _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(v, v))};
}
inline Scales scales_signed(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi8_epi16(_mm_unpacklo_epi8(v, v)), _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(v, v))};
}
// dot_rows with each output's scale as VPMADDWD's multiplier in place of ones: the scale costs no instruction.
template <int kPerWiden>
inline I32 dot_rows_scaled(I32 acc, const U8* rows, int count, const int8_t* x, Scales scale) {
  for (int j = 0; j < count; j += kPerWiden) {
    __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
    for (int w = 0; w < kPerWiden; ++w) {
      int32_t v;
      std::memcpy(&v, x + 4 * (j + w), 4);
      const __m256i b = _mm256_set1_epi32(v);
      lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(rows[j + w].lo, b));
      hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(rows[j + w].hi, b));
    }
    acc = {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(lo, scale.lo)),
           _mm256_add_epi32(acc.hi, _mm256_madd_epi16(hi, scale.hi))};
  }
  return acc;
}
inline I32 byte_pairs(const uint8_t* a, const uint8_t* b, bool is_signed) {
  const __m128i va = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  const __m128i vb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  const __m128i low = _mm_unpacklo_epi8(va, vb), high = _mm_unpackhi_epi8(va, vb);
  if (is_signed) return {_mm256_cvtepi8_epi16(low), _mm256_cvtepi8_epi16(high)};
  return {_mm256_cvtepu8_epi16(low), _mm256_cvtepu8_epi16(high)};
}
inline I32 madd_pairs(I32 acc, I32 pairs, int32_t packed) {
  const __m256i b = _mm256_set1_epi32(packed);
  return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(pairs.lo, b)), _mm256_add_epi32(acc.hi, _mm256_madd_epi16(pairs.hi, b))};
}
inline I32 sub_i(I32 a, I32 b) { return {_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)}; }
template <int N> inline I32 shift_left32(I32 a) { return {_mm256_slli_epi32(a.lo, N), _mm256_slli_epi32(a.hi, N)}; }
#endif

#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)) || \
    defined(LMSERVE_INT16_KERNELS_AVX2)
#define LMSERVE_INT16_KERNELS 1
constexpr int64_t kGroup = 16;  // output rows per group: one I32 / F32 of lanes
// The block 4 KB ahead is asked for, so that few-row products do not wait on memory (as quantized_linear.cpp).
constexpr int64_t kPrefetchAhead = 4096;

inline void prefetch_block(const uint8_t* block, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchAhead + line), _MM_HINT_T0);
}

// 4 chunks of 64 bytes, chunk c holding row 2c in its low nibbles and row 2c + 1 in its high ones, as 8 rows.
inline void low_nibbles(const uint8_t* quants, U8 rows[8]) {
  for (int c = 0; c < 4; ++c) {
    const U8 v = load64(quants + 64 * c);
    rows[2 * c] = and8(v, 0x0F);
    rows[2 * c + 1] = and8(shift_right16<4>(v), 0x0F);
  }
}

// a shifted left by N bits in each 16-bit lane, or right by -N.
template <int N>
inline U8 shift16(U8 a) {
  if constexpr (N >= 0) return shift_left16<N>(a);
  else return shift_right16<-N>(a);
}

// One more bit per code: 64 bytes whose byte 4n + e holds in bit j that bit of row j's byte 4n + e, ORed into rows'
// bit kBit (16-bit shifts; what crosses into the other byte is masked off).
template <int kBit>
inline void bit_plane(const uint8_t* packed, U8 rows[8]) {
  const U8 bits = load64(packed);
  constexpr int mask = 1 << kBit;
  rows[0] = or8(rows[0], and8(shift16<kBit>(bits), mask));
  rows[1] = or8(rows[1], and8(shift16<kBit - 1>(bits), mask));
  rows[2] = or8(rows[2], and8(shift16<kBit - 2>(bits), mask));
  rows[3] = or8(rows[3], and8(shift16<kBit - 3>(bits), mask));
  rows[4] = or8(rows[4], and8(shift16<kBit - 4>(bits), mask));
  rows[5] = or8(rows[5], and8(shift16<kBit - 5>(bits), mask));
  rows[6] = or8(rows[6], and8(shift16<kBit - 6>(bits), mask));
  rows[7] = or8(rows[7], and8(shift16<kBit - 7>(bits), mask));
}

// The fifth bit of q5_0, q5_1 and q5_k codes.
inline void fifth_bits(const uint8_t* packed, U8 rows[8]) { bit_plane<4>(packed, rows); }

// The packers' chunks from a block's codes (q[n]: output row n's 32 codes), each row's bytes built in one SSE register:
// byte by byte, these loops were most of a 3B model's packing (docs/benchmarks.md, "Packing with byte shuffles").

// Two chunks of 64 bytes from bits `shift`, `shift` + 1 of the block's codes: chunk h holds row 4h + r's at bits 2r
// (q6_k's top bits; q3_k's and q2_k's low ones).
inline void two_bit_chunks(uint8_t* out, const uint8_t* const q[kGroup], int shift) {
  const __m128i three = _mm_set1_epi8(3), count = _mm_cvtsi32_si128(shift);
  for (int n = 0; n < kGroup; ++n)
    for (int h = 0; h < 2; ++h) {
      // Codes 16h .. 16h + 15 as four dwords D_r (codes 16h + 4r + e, e = 0..3); byte e of the result is
      // D_0[e] | D_1[e] << 2 | D_2[e] << 4 | D_3[e] << 6 (each at most 3: no bit crosses a byte).
      const __m128i x =
          _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q[n] + 16 * h)), count), three);
      const __m128i packed = _mm_or_si128(
          _mm_or_si128(x, _mm_slli_epi32(_mm_srli_si128(x, 4), 2)),
          _mm_or_si128(_mm_slli_epi32(_mm_srli_si128(x, 8), 4), _mm_slli_epi32(_mm_srli_si128(x, 12), 6)));
      const int32_t bytes = _mm_cvtsi128_si32(packed);
      std::memcpy(out + 64 * h + 4 * n, &bytes, 4);
    }
}

// Four chunks of 64 bytes from the low 4 bits of the block's codes: chunk c holds row 2c's in the low nibbles and row
// 2c + 1's in the high ones, row j of lane n being codes 4j .. 4j + 3 of output n (so byte 4n + e of chunk c is
// code 8c + e | code 8c + 4 + e << 4).
inline void nibble_chunks(uint8_t* out, const uint8_t* const q[kGroup]) {
  const __m128i low = _mm_set1_epi8(0x0F);
  // Within each 16 codes: 0-3 and 8-11 (the low nibbles' codes of chunks 2p and 2p + 1), then 4-7 and 12-15.
  const __m128i order = _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
  for (int n = 0; n < kGroup; ++n) {
    const __m128i first = _mm_shuffle_epi8(_mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q[n])), low), order);
    const __m128i second =
        _mm_shuffle_epi8(_mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q[n] + 16)), low), order);
    // Low nibbles of chunks 0-3 (8 bytes of each half), then the high nibbles' codes: at most 15, so the 16-bit
    // shift moves no bit into the next byte.
    const __m128i packed = _mm_or_si128(_mm_unpacklo_epi64(first, second),
                                        _mm_slli_epi16(_mm_unpackhi_epi64(first, second), 4));
    alignas(16) int32_t chunk[4];
    _mm_store_si128(reinterpret_cast<__m128i*>(chunk), packed);
    for (int c = 0; c < 4; ++c) std::memcpy(out + 64 * c + 4 * n, &chunk[c], 4);
  }
}

// The chunk of 64 bytes bit_plane reads: byte 4n + e holds in bit j bit `bit` of code 4j + e of output n (q5's fifth
// bit, q3_k's third).
inline void bit_plane_chunk(uint8_t* out, const uint8_t* const q[kGroup], int bit) {
  // Codes e-major within each 16 (4j + e -> 4e + j): then the halves' dwords interleaved, so that bytes 8e .. 8e + 7
  // of the pair hold code 4j + e for j = 0..7, and the byte sign bits (the bit shifted to the top) are byte e.
  const __m128i order = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m128i top = _mm_set1_epi8(static_cast<char>(0x80)), count = _mm_cvtsi32_si128(7 - bit);
  for (int n = 0; n < kGroup; ++n) {
    const __m128i first = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q[n])), order);
    const __m128i second = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q[n] + 16)), order);
    // The 16-bit shift carries other bits into the next byte, but only the top bit of each byte is kept.
    const int low = _mm_movemask_epi8(_mm_and_si128(_mm_sll_epi16(_mm_unpacklo_epi32(first, second), count), top));
    const int high = _mm_movemask_epi8(_mm_and_si128(_mm_sll_epi16(_mm_unpackhi_epi32(first, second), count), top));
    const uint32_t bytes = static_cast<uint32_t>(low) | (static_cast<uint32_t>(high) << 16);
    std::memcpy(out + 4 * n, &bytes, 4);
  }
}

// A packed weight checked against its shape: `group_bytes` bytes per 16 output rows.
inline void check_packed_weight(const at::Tensor& weight, const char* name, int64_t N, int64_t K, int64_t width,
                                int64_t group_bytes) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte && weight.is_contiguous(),
              "packed weight must be a contiguous uint8 CPU tensor");
  TORCH_CHECK(K > 0 && K % width == 0, name, " needs in_features that are a positive multiple of ", width, ", got ", K);
  TORCH_CHECK(N > 0 && N % kGroup == 0, "out_features must be a positive multiple of 16, got ", N);
  const int64_t expected = N / kGroup * group_bytes;
  TORCH_CHECK(weight.numel() == expected, "packed weight has ", weight.numel(), " bytes, expected ", expected, " for ",
              N, " x ", K);
}

// Activation bytes a block of rows may take while the groups pass over it: a share of a core's L2 (1-2 MiB on the
// kinds this runs on), the weights' group and the output rows beside them.
constexpr int64_t kRowBlockBytes = 256 * 1024;

// Every group of 16 outputs against every row, `tile(rows, group, row, n0)` taking up to kTileRows rows at a time
// from `row`: the groups spread over the threads, each row computed alone. `row_bytes`: the activation bytes a row's
// tile reads. Rows go in blocks that stay in the core's cache while the thread's groups pass over them: a prompt's
// rows (2,048 of 1,536 inputs: 6 MB of 16-bit activations) outgrow it, and each group read them all again from
// memory (at 2,048 rows, 0.7-0.8x the speed a row had at 256). The tiles are the same ones, so are the results.
template <int kTileRows, class Tile>
inline void for_each_tile(int64_t M, int64_t N, int64_t group_bytes, int64_t row_bytes, const uint8_t* weight,
                          Tile tile) {
  const int64_t block_rows = std::max<int64_t>(1, kRowBlockBytes / std::max<int64_t>(1, row_bytes) / kTileRows) *
                             kTileRows;
  at::parallel_for(0, N / kGroup, 1, [&](int64_t begin, int64_t end) {
    for (int64_t first = 0; first < M; first += block_rows) {
      const int64_t last = std::min(M, first + block_rows);
      for (int64_t g = begin; g < end; ++g)
        for (int64_t row = first; row < last; row += kTileRows)
          tile(static_cast<int>(std::min<int64_t>(kTileRows, last - row)), weight + g * group_bytes, row, g * kGroup);
    }
  });
}
#endif

}  // namespace lmserve_int16
