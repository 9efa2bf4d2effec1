// cuflash: the online softmax of FlashAttention-2 on one 16-row slice of scores held in the
// tensor-core accumulator layout, shared by fwd_sm80 (mma.sync) and fwd_sm90 (wgmma): both
// leave S in the same per-thread layout, so one copy of the numerics serves both.
//
// Layout (mma.sync C fragment per 8-column tile t; lane l, g = l / 4, c = 2 (l % 4)):
//   s[t][0..1] = row g,     columns 8t + c, 8t + c + 1
//   s[t][2..3] = row g + 8, columns 8t + c, 8t + c + 1
// A thread therefore owns two rows (r = 0: g, r = 1: g + 8); the four threads of a quad share
// them, so row reductions are this thread's columns and then two xor-shuffles.
//
// Running state per row r: m_i[r], the max of the raw scores so far, and l_i[r], this thread's
// share of sum(exp2(s * sl2 - m_i * sl2)); sl2 = softmax scale * log2(e).
#pragma once
#include "mma_sm80.cuh"

namespace cuflash {

// -- mask: columns past last[r] and, where KEY_LO (a variant whose rows see keys only from
//    some key on: Variant::kKeyLo), columns before first[r] get -inf; both relative to this
//    thread's first column c.
template <bool KEY_LO = false, int NT>
__device__ __forceinline__ void mask_scores(float (&s)[NT][4], const int (&first)[2], const int (&last)[2]) {
  const float kNegInf = -__int_as_float(0x7f800000);
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t * 8 > last[r] || (KEY_LO && t * 8 < first[r])) s[t][2 * r] = kNegInf;
      if (t * 8 + 1 > last[r] || (KEY_LO && t * 8 + 1 < first[r])) s[t][2 * r + 1] = kNegInf;
    }
}

// -- the lower bound alone: columns before first[r] get -inf (fwd_sm90's lean window masks its
//    far-edge tiles so: one compare a score, where mask_scores<true> makes two)
template <int NT>
__device__ __forceinline__ void mask_scores_before(float (&s)[NT][4], const int (&first)[2]) {
  const float kNegInf = -__int_as_float(0x7f800000);
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t * 8 < first[r]) s[t][2 * r] = kNegInf;
      if (t * 8 + 1 < first[r]) s[t][2 * r + 1] = kNegInf;
    }
}

// One step of the online softmax for a new score tile S_ij of NT 8-column tiles, in two
// parts so that a caller can rescale O later (fwd_sm90 does, once the wgmma still writing O
// has finished):
//   online_softmax_scores: m_new = max(m_i, rowmax(S_ij)), P_ij = exp2(S_ij sl2 - m_new sl2)
//     in place of S_ij, alpha = exp2(m_i sl2 - m_new sl2), l_i = alpha l_i + rowsum(P_ij);
//   rescale_rows:          O_i = diag(alpha) O_i.
// 2^x on the FMA pipe, for x <= 0 (FlashAttention-4's emulation of the exponential, for a
// share of P where the special-function unit is the bottleneck: the softcap's tanh.approx
// takes it once more a score). Cody-Waite: x = j + f, j = round(x) from the 1.5 2^23 shift
// (t's low mantissa bits hold j, exactly: |x| <= 126 < 2^22), f = x - j in [-1/2, 1/2] exactly;
// 2^f by a degree-5 fit of the relative error (max 2.2e-7 = 2^-22 evaluated in float32, as
// accurate as ex2.approx); 2^j by adding j to the exponent field: t << 23 is j << 23 mod 2^32
// (t's high bits 0x4B400000 shift out). ~11 FMA-pipe / ALU instructions for one MUFU.EX2.
// Why degree 5: P is rounded to 16 bits for the P V product, but the row sum l (so lse = m +
// log l) adds the float32 P. Session 8's degree-3 fit (7.5e-5) put lse 2.4e-5 off in a row with
// two visible keys, ten times the kit's bound (session 9's campaign, pinned in
// tests/test_testing.py's CAMPAIGN_FAILURES); degree 4 (2.7e-6) would still be at that bound's
// floor.
// Numerics: x < -126 (x = -inf: a masked score) gives exactly 0 by the final select, as
// ex2.approx.ftz flushes there (the intermediates are garbage or NaN then, never used): a row
// with no visible key keeps l = 0, so o = 0 and lse = -inf; x slightly above 0 (the max's
// rounding) gives j = 0; a NaN x gives 0 here (the row's other scores and m carry the NaN).
__device__ __forceinline__ float ex2_poly(float x) {
  const float t = x + 12582912.f;
  const float f = x - (t - 12582912.f);
  const float p = fmaf(fmaf(fmaf(fmaf(fmaf(0.00132763083f, f, 0.00967548508f), f, 0.0555071309f), f,
                                  0.240221202f), f, 0.693146944f), f, 1.00000012f);
  const float r = __int_as_float(static_cast<int>(__float_as_uint(p) + (__float_as_uint(t) << 23)));
  return x >= -126.f ? r : 0.f;
}

// The softcap's bounded scores (Var::kFixedOffset: softcap the only score transform, scores in
// units of c, tanh.approx's th in [-1, 1]): in base 2 a score is x = th a, a = c log2(e) (sl2),
// so every score of every row lies in [-a, a] and the softmax needs no running max: one offset
// mo for all rows and tiles, P = 2^(x - mo), l = sum P, lse = (mo + log2 l) ln 2, and no
// rescale of l and O (alpha = 1): the row max's FMNMX and shuffles, the alpha ex2 and the
// diag(alpha) O FMULs leave the loop. FlashAttention's max is only there to keep exp2 in
// range; the cap bounds the range instead. mo (an integer, so that ex2_poly_fixed's shift is
// exact) is the largest with which a row whose max score is the lowest possible, -a, still
// keeps every term within 2^-(24 + lg) of its max a normal float (lg = ceil(log2 Lk): 2^-24 of
// the row's sum at most flushes away, below float32's rounding): mo <= 102 - lg - a; and at
// most floor(a), where P <= 2 (small caps: then the usual bound). Numerics: P <= 2^(a - mo),
// at most 2^(2a - 101 + lg); the host takes this build only where P Lk stays <= 2^88, so O = sum P
// v overflows only for |v| > 2^40 (cuflash/_variant.py softcap_offset); masked scores (-inf)
// give P = 0 as before, so a row with no visible key keeps l = 0: o = 0, lse = -inf.
__device__ __forceinline__ float softcap_offset(float a, int Lk) {
  const int lg = 32 - __clz(max(Lk, 2) - 1);   // ceil(log2 Lk)
  return fminf(floorf(a), floorf(static_cast<float>(102 - lg) - a));
}

// 2^(s sl2 - mo) on the FMA pipe for the fixed offset (c1 = 1.5 2^23 - mo, exact: mo is an
// integer): ex2_poly's Cody-Waite in 3 instructions instead of 4: t = 1.5 2^23 + round(s sl2 -
// mo) in one FFMA (the product exact inside the fma, one rounding to t's integer grid), then
// c1 - t = -(mo + j) exactly (two integers near 1.5 2^23) and f = s sl2 - mo - j in one more
// FFMA, one rounding, |f| <= 1/2; 2^f by ex2_poly's degree-5 fit, j added to the exponent
// field. s finite is in [-1, 1] here, so x = s sl2 - mo >= -a - mo >= lg - 102 > -126: never
// flushed;
// s = -inf (a masked pair) gives 0 by the select (t, f are garbage there), as does a NaN
// (ex2_poly does the same; the tiles on the special-function unit keep a NaN).
__device__ __forceinline__ float ex2_poly_fixed(float s, float sl2, float c1) {
  const float t = fmaf(s, sl2, c1);
  const float f = fmaf(s, sl2, c1 - t);
  const float p = fmaf(fmaf(fmaf(fmaf(fmaf(0.00132763083f, f, 0.00967548508f), f, 0.0555071309f), f,
                                  0.240221202f), f, 0.693146944f), f, 1.00000012f);
  const float r = __int_as_float(static_cast<int>(__float_as_uint(p) + (__float_as_uint(t) << 23)));
  return s >= -2.f ? r : 0.f;
}

// The softmax step with the fixed offset mo (softcap_offset): P_ij = 2^(S_ij sl2 - mo) in place
// of S_ij, l_i += rowsum(P_ij); no max, no alpha. POLY_T as below (ex2_poly_fixed).
template <int NT, int POLY_T = 0>
__device__ __forceinline__ void fixed_offset_softmax_scores(float (&s)[NT][4], float (&l_i)[2], float sl2, float mo) {
  const float c1 = 12582912.f - mo;
  float rowsum[2] = {0.f, 0.f};
#pragma unroll
  for (int t = 0; t < NT; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      s[t][e] = (POLY_T > 0 && t >= NT - POLY_T) ? ex2_poly_fixed(s[t][e], sl2, c1) : ex2_approx(fmaf(s[t][e], sl2, -mo));
    rowsum[0] += s[t][0] + s[t][1];
    rowsum[1] += s[t][2] + s[t][3];
  }
  l_i[0] += rowsum[0];
  l_i[1] += rowsum[1];
}

// POLY_T > 0: the last POLY_T of the NT 8-column tiles take ex2_poly instead of ex2.approx
// (a Variant's kPolyShare: the softcap on tanh.approx); 0 compiles to the code without it.
// OFFSET: this thread's scores of row r are shifted, their true values s + off[r] (ALiBi's row
// term, modify_score_tile<Var, true>; per thread: the four threads of a quad hold different
// columns of the row, so different offsets): each thread's max is shifted back to true units
// before the quad's shuffles and m_i (which stays in true units, as lse needs), and P's
// exponent subtracts the thread's (m_new - off[r]) sl2. Numerics:
// the shifted scores and m_new - off[r] are rounded at the magnitude of the ALiBi term, as the
// unshifted path rounds s - slope |i + diag - j| (the kit's 4 eps L noise); a row that has seen
// only masked keys keeps m = -inf (-inf + off = -inf) and subtracts 0, as below.
template <int NT, int POLY_T = 0, bool OFFSET = false>
__device__ __forceinline__ void online_softmax_scores(float (&s)[NT][4], float (&m_i)[2], float (&l_i)[2],
                                                      float (&alpha)[2], float sl2, const float* off = nullptr) {
  const float kNegInf = -__int_as_float(0x7f800000);
  // -- m_ij = rowmax(S_ij), m_new = max(m_i, m_ij): this thread's columns, then its quad
  float m_new[2] = {OFFSET ? kNegInf : m_i[0], OFFSET ? kNegInf : m_i[1]};
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    m_new[0] = fmaxf(m_new[0], fmaxf(s[t][0], s[t][1]));
    m_new[1] = fmaxf(m_new[1], fmaxf(s[t][2], s[t][3]));
  }
  float m_scaled[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if constexpr (OFFSET) m_new[r] += off[r];   // (this thread's offset, before the quad meets)
    m_new[r] = fmaxf(m_new[r], __shfl_xor_sync(0xffffffffu, m_new[r], 1));
    m_new[r] = fmaxf(m_new[r], __shfl_xor_sync(0xffffffffu, m_new[r], 2));
    if constexpr (OFFSET) m_new[r] = fmaxf(m_i[r], m_new[r]);
    // A row that has seen only masked keys still has max -inf: subtract 0 instead, so that
    // exp2(-inf - 0) = 0 rather than exp2(-inf - -inf) = NaN.
    m_scaled[r] = (m_new[r] == kNegInf) ? 0.f : m_new[r] * sl2;
    // -- rescale factor exp2(m_i - m_new); m_i = -inf gives 0 (l_i and O are still 0 then)
    alpha[r] = ex2_approx(m_i[r] * sl2 - m_scaled[r]);
    m_i[r] = m_new[r];
    if constexpr (OFFSET) m_scaled[r] = (m_new[r] == kNegInf) ? 0.f : (m_new[r] - off[r]) * sl2;
  }
  // -- P_ij = exp2(S_ij * scale*log2e - m_new); update l_i
  float rowsum[2] = {0.f, 0.f};
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (POLY_T > 0 && t >= NT - POLY_T) {
      s[t][0] = ex2_poly(fmaf(s[t][0], sl2, -m_scaled[0]));
      s[t][1] = ex2_poly(fmaf(s[t][1], sl2, -m_scaled[0]));
      s[t][2] = ex2_poly(fmaf(s[t][2], sl2, -m_scaled[1]));
      s[t][3] = ex2_poly(fmaf(s[t][3], sl2, -m_scaled[1]));
    } else {
      s[t][0] = ex2_approx(fmaf(s[t][0], sl2, -m_scaled[0]));
      s[t][1] = ex2_approx(fmaf(s[t][1], sl2, -m_scaled[0]));
      s[t][2] = ex2_approx(fmaf(s[t][2], sl2, -m_scaled[1]));
      s[t][3] = ex2_approx(fmaf(s[t][3], sl2, -m_scaled[1]));
    }
    rowsum[0] += s[t][0] + s[t][1];
    rowsum[1] += s[t][2] + s[t][3];
  }
  l_i[0] = l_i[0] * alpha[0] + rowsum[0];
  l_i[1] = l_i[1] * alpha[1] + rowsum[1];
}

// -- O_i = diag(alpha) O_i
template <int NO>
__device__ __forceinline__ void rescale_rows(float (&o)[NO][4], const float (&alpha)[2]) {
#pragma unroll
  for (int t = 0; t < NO; ++t) {
    o[t][0] *= alpha[0]; o[t][1] *= alpha[0];
    o[t][2] *= alpha[1]; o[t][3] *= alpha[1];
  }
}

// Both parts at once.
template <int POLY_T = 0, int NT, int NO>
__device__ __forceinline__ void online_softmax_step(float (&s)[NT][4], float (&m_i)[2], float (&l_i)[2],
                                                    float (&o)[NO][4], float sl2) {
  float alpha[2];
  online_softmax_scores<NT, POLY_T>(s, m_i, l_i, alpha, sl2);
  rescale_rows(o, alpha);
}

// P_ij's k16 slice kk as the A operand of P V (mma.sync m16n8k16 and wgmma register-A share
// this layout): columns 16kk..16kk+15 are the 8-column tiles 2kk and 2kk+1.
template <typename T, int NT>
__device__ __forceinline__ void p_fragment(unsigned (&a)[4], const float (&s)[NT][4], int kk) {
  a[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
  a[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
  a[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  a[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// -- epilogue of one row pair: l_i over the quad; returns 1 / l_i (0 for a row with no visible
//    key) and writes L_i = m_i + log(l_i) (-inf for such a row) for rows < Lq.
__device__ __forceinline__ void finish_rows(float (&inv_l)[2], float (&l_i)[2], const float (&m_i)[2],
                                            float sl2, int row, int Lq, float* lse_row0) {
  const float kNegInf = -__int_as_float(0x7f800000);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_i[r] += __shfl_xor_sync(0xffffffffu, l_i[r], 1);
    l_i[r] += __shfl_xor_sync(0xffffffffu, l_i[r], 2);
    // l_i == 0 only for a row with no visible key: O = 0 and lse = -inf. A NaN l_i (NaN in
    // this row's inputs) propagates to this row's outputs only.
    inv_l[r] = (l_i[r] == 0.f) ? 0.f : 1.f / l_i[r];
    const int gi = row + 8 * r;
    if ((threadIdx.x & 3) == 0 && gi < Lq) {
      lse_row0[gi] = (l_i[r] == 0.f) ? kNegInf : (m_i[r] * sl2 + __log2f(l_i[r])) * 0.69314718055994531f;
    }
  }
}

}  // namespace cuflash
