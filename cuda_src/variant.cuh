// cuflash: the score pipeline of every kernel family, forward and backward, as one template
// parameter (DESIGN.md, "Modifiers"): which (query, key) pairs are visible, and how a raw score
// S = Q K^T is transformed before the softmax. Each kernel takes `typename Variant` where it
// used to take `bool CAUSAL`, and asks the Variant every question about visibility:
//
//   tile classification (whole tiles, analytic; rows and keys as half-open ranges):
//     key_begin / key_end      the keys that query rows [m_begin, m_end) can see
//     query_begin / query_end  the queries that can see keys [n_begin, n_end)
//     tile_invisible           no (row, key) pair of the tile is visible: skip its math
//     needs_mask               some pair of the tile is masked: evaluate the element mask
//   element mask (one row or one key at a time):
//     key_last / key_first     the visible keys of query row i (clipped to Lk)
//     query_first / query_last the visible queries of key j
//     masked / visible         whether the pair (i, j) is masked / visible
//   transform                  the score modifier (identity today; softcap goes here)
//
// The run-time part (scale, causal offset) is VariantParams, which travels in the kernel's
// parameter block; the compile-time part is the template argument. Under Variant<false> and
// Variant<true> every function below reduces to exactly the arithmetic the kernels had inline
// before (tools/sass_identity.py checks that the machine code did not change), and the
// compile-time flags kKeyLo / kKeyHi let a kernel drop a bound that does not exist.
//
// Adding a sliding window (keys i + off - left .. i + off + right visible to query i) means, for
// correct results, changing this file only: set kKeyLo, and give key_first, query_last,
// masked and the tile predicates their lower bounds; the kernels already evaluate both ends of
// the element mask where the flags say so (the lower ends are not yet exercised by any
// specialisation). For speed it also means starting the kernels' tile loops at key_begin /
// ending them at query_end: today they start at key tile 0 and end at Lq, because even a
// constant-0 start through these functions changed the register allocation of fwd_sm80 and
// bwd_sm80 (checked with tools/sass_identity.py), which this refactoring was not to do.
//
// The integer arguments are taken by const reference on purpose: the front end simplifies a
// callee before inlining it, and there a comparison of a by-value argument with an expression
// gets its operands commuted (j > i + off becomes i + off < j), which survives inlining and
// changes the machine code; by reference the operands keep the order they have at the call.
#pragma once

namespace cuflash {

// Run-time part of the score pipeline, inside the parameter block as `var` (mirrored by the
// launcher's NumPy dtype: do not reorder).
struct VariantParams {
  double scale;        // tau, the softmax scale
  double scale_log2;   // tau * log2(e): the kernels fold the scale into exp2
  int causal_offset;   // under causal: key j visible to query i iff j <= i + causal_offset
  int pad_;
};

// The modifiers issue adds further template parameters WITH DEFAULTS, so that the spelling
// cuflash::Variant<true> / cuflash::Variant<false> (the launcher's name expressions) stays valid.
template <bool CAUSAL>
struct Variant {
  static constexpr bool kCausal = CAUSAL;
  // Which ends of a query row's visible key interval are real bounds: kKeyHi, the row sees keys
  // only up to key_last(i) < Lk - 1 for some rows (causal); kKeyLo, it sees them only from
  // key_first(i) > 0 for some rows (a window; no variant has it yet). Where a flag is false,
  // the matching bound is 0 or Lk - 1 and the kernels skip evaluating it.
  static constexpr bool kKeyLo = false;
  static constexpr bool kKeyHi = CAUSAL;

  // ---- score transform, applied to every raw score S_ij = q_i . k_j before masking and the
  //      softmax. Identity today: the scale tau is folded into exp2 (P = exp2(S tau log2(e) - m)),
  //      not applied here. A softcap (cap tanh(S tau / cap)) goes here, with its derivative in
  //      the backward's dS.
  template <typename Acc>
  static __device__ __forceinline__ Acc transform(const VariantParams&, Acc s) { return s; }

  template <int NT>
  static __device__ __forceinline__ void transform_tile(const VariantParams& v, float (&s)[NT][4]) {
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[t][e] = transform(v, s[t][e]);
  }

  // ---- tile classification
  // One past the last key that query rows [., m_end) can see (at most Lk).
  static __device__ __forceinline__ int key_end(const VariantParams& v, const int& m_end, const int& Lk) {
    return CAUSAL ? min(Lk, m_end + v.causal_offset) : Lk;
  }
  // The first key that query rows [m_begin, .) can see (a window would raise it; no kernel
  // loop starts here yet: see the header).
  static __device__ __forceinline__ int key_begin(const VariantParams&, const int& /*m_begin*/) { return 0; }
  // The first query that can see a key of [n_begin, .): under causal, i >= j - causal_offset.
  static __device__ __forceinline__ int query_begin(const VariantParams& v, const int& n_begin) {
    return CAUSAL ? max(0, n_begin - v.causal_offset) : 0;
  }
  // One past the last query that can see a key of [., n_end) (a window would lower it; no
  // kernel loop ends here yet: see the header).
  static __device__ __forceinline__ int query_end(const VariantParams&, const int& /*n_end*/, const int& Lq) { return Lq; }

  // Rows [m_begin, m_end) x keys [n_begin, n_end) hold no visible pair (past the diagonal of
  // the last row): the tile changes nothing for these rows, so their math can be skipped.
  static __device__ __forceinline__ bool tile_invisible(const VariantParams& v, const int& /*m_begin*/, const int& m_end,
                                                        const int& n_begin, const int& /*n_end*/) {
    return CAUSAL && n_begin > m_end - 1 + v.causal_offset;
  }
  // Some pair of the tile is masked by the variant (keys past Lk are the caller's question):
  // the last key crosses the diagonal of the first row.
  static __device__ __forceinline__ bool needs_mask(const VariantParams& v, const int& m_begin, const int& /*m_end*/,
                                                    const int& /*n_begin*/, const int& n_end) {
    return CAUSAL && n_end - 1 > m_begin + v.causal_offset;
  }

  // ---- element mask
  // The last key query row i sees, clipped to the keys that exist.
  static __device__ __forceinline__ int key_last(const VariantParams& v, const int& i, const int& Lk) {
    return CAUSAL ? min(Lk - 1, i + v.causal_offset) : Lk - 1;
  }
  // The first key query row i sees (only evaluated where kKeyLo).
  static __device__ __forceinline__ int key_first(const VariantParams&, const int& /*i*/) { return 0; }
  // The first query that sees key j (only evaluated where kKeyHi; may be negative).
  static __device__ __forceinline__ int query_first(const VariantParams& v, const int& j) { return j - v.causal_offset; }
  // The last query that sees key j (only evaluated where kKeyLo).
  static __device__ __forceinline__ int query_last(const VariantParams&, const int& /*j*/) { return 1 << 30; }
  // Whether the pair (query i, key j < Lk) is masked, and its negation (both, so that each
  // kernel keeps the comparison it had: the compiler does not turn one into the other).
  static __device__ __forceinline__ bool masked(const VariantParams& v, const int& i, const int& j) {
    return CAUSAL && j > i + v.causal_offset;
  }
  static __device__ __forceinline__ bool visible(const VariantParams& v, const int& i, const int& j) {
    return !CAUSAL || j <= i + v.causal_offset;
  }
};

}  // namespace cuflash
