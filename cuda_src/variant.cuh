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
//   transform                  identity (the modifiers' transforms: Mod::score, kNatural)
//
// The run-time part (scale, causal offset) is VariantParams, which travels in the kernel's
// parameter block; the compile-time part is the template argument. Under Variant<false> and
// Variant<true> every function below reduces to exactly the arithmetic the kernels had inline
// before (tools/sass_identity.py checks that the machine code did not change), and the
// compile-time flags kKeyLo / kKeyHi let a kernel drop a bound that does not exist.
//
// The sliding window (keys i + diag - left .. i + diag + right visible to query i, bounds in
// Params::mod) is in the (v, m, ...) overloads below: kKeyLo / kKeyHi are set for it, and the
// kernels start their key-tile loops at key_begin (forward) and end their query-tile loops at
// query_end (bwd_sm80, bwd_sm90) only where kKeyLo holds, so the loops of plain attention keep their
// constant start and their parameter bound (a constant 0 start through these functions, or a
// register copy of Lq, changed the register allocation of fwd_sm80 and bwd_sm80: checked with
// tools/sass_identity.py).
//
// The integer arguments are taken by const reference on purpose: the front end simplifies a
// callee before inlining it, and there a comparison of a by-value argument with an expression
// gets its operands commuted (j > i + off becomes i + off < j), which survives inlining and
// changes the machine code; by reference the operands keep the order they have at the call.
//
// The modifiers (DESIGN.md "Modifiers": window, softcap, ALiBi, bias, mask, score_mod, mask_mod,
// block_mask, sink) are further template parameters WITH DEFAULTS, so Variant<true> and
// Variant<false> still name plain causal / non-causal attention and compile to the same code as
// before (every modifier hook below is behind a compile-time flag). Their run-time values are
// Params::mod (ModifierParams, modifiers.cuh). The overloads that take (v, m, ...) add the
// window's bounds to the causal ones; the kernels call those, and under a Variant without a
// window they are exactly the (v, ...) ones.
#pragma once
#include "modifiers.cuh"

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
// SOFTCAP is the softcap's build in the tensor-core families (softcap_of, bwd_io::p_ds_pair):
// 0 none, 1 (spelled `true`) c tanh.approx(y), one MUFU operation a score, with a share of the
// forward's exponentials on the FMA pipe (kPolyShare), 3 the same without that share
// (CUFLASH_SOFTCAP_POLY=0), 2 the session-7 build c - 2c / (2^{2y log2 e} + 1) on ex2.approx
// and rcp.approx (CUFLASH_SOFTCAP_TANH=0, and float16 always: _variant);
// 4 and 5 are 1 and 3 with the forwards' softmax on a fixed offset instead of a running max
// (kFixedOffset; CUFLASH_SOFTCAP_FIXED, where the cap and Lk allow it: _variant.softcap_offset),
// 6 is 4 with the other share of the exponentials on the FMA pipe (CUFLASH_SOFTCAP_SHARE=alt);
// + 8: bwd_sm90 computes the softcap alone on its plain path (kSoftcapBwdPlain,
// CUFLASH_SOFTCAP_BWD; the forwards ignore the bit);
// the other kernels compute tanhf (Mod::score_row) under all of them. ALIBI likewise: 0 none, 1 (`true`)
// the forwards keep ALiBi-alone scores raw (kAlibiRawUnits), 2 in natural units as in session 7
// (CUFLASH_ALIBI_RAW=0).
// CUFLASH_ALIBI_ROW_OFFSET 0 (cuflash/_variant.py's A/B switch, in the Variant's prelude): ALiBi's
// causal raw-units build adds its whole distance term to every score (kAlibiRowOffset off).
#ifndef CUFLASH_ALIBI_ROW_OFFSET
#define CUFLASH_ALIBI_ROW_OFFSET 1
#endif
template <bool CAUSAL, bool WINDOW = false, int SOFTCAP = 0, int ALIBI = 0,
          typename BiasT = void, bool MASK = false, typename ScoreMod = NoScoreMod,
          typename MaskMod = NoMaskMod, bool BLOCK_MASK = false, bool SINK = false>
struct Variant {
  // The modifiers' hooks (modifiers.cuh): item state, score transform and its gradient, the
  // element masks of arrays and user functions, the sink's start of the online softmax.
  using Mod = ModVariant<CAUSAL, WINDOW, (SOFTCAP != 0), (ALIBI != 0), BiasT, MASK, ScoreMod, MaskMod,
                        BLOCK_MASK, SINK>;
  static constexpr bool kCausal = CAUSAL;
  static constexpr bool kWindow = WINDOW;
  static constexpr bool kSink = SINK;
  // softcap on the special-function unit's tanh (SOFTCAP 1, 3-6), else (2) on its ex2 and rcp
  static constexpr int kSoftcapBuild = SOFTCAP & 7;   // (bit 8: kSoftcapBwdPlain below)
  static constexpr bool kSoftcapTanh = kSoftcapBuild == 1 || kSoftcapBuild >= 3;
  // SOFTCAP 1 (the default) also computes a share of the softmax's exponentials on the FMA
  // pipe (online_softmax.cuh ex2_poly): with tanh.approx the special-function unit does 2
  // operations a score and is the forward's bottleneck (bench/NOTES.md, session 8). The
  // number of 8-column tiles (of NT) a thread emulates: about 1 in 8 at d = 128, 3 in 8 at
  // d <= 64 (where the tensor work a score halves); 0 for SOFTCAP 3 (CUFLASH_SOFTCAP_POLY=0).
  // With the fixed offset (SOFTCAP 4) the loop is ~100 instructions shorter a tile and the
  // exponential on the FMA pipe 7 instructions more than ex2.approx's 2, not 11 (ex2_poly_fixed).
  // Session 10's call 1 measured the share LOSING at d = 64 (282 TFLOP/s against 308 without
  // it: the loop is latency-bound there, issue slots 58% busy, not pipe-bound as session 8's
  // model had it), neutral at d = 128. So: none at d <= 64, 2 in 8 at d = 128 (8 of 32);
  // SOFTCAP 6 the other arm of an A/B (CUFLASH_SOFTCAP_SHARE=alt): 2 in 8 at d <= 64, 1 in 8
  // at d = 128 (bench/NOTES.md, session 10).
  // The builds that may send exponentials to the FMA pipe at all (3 and 5 are the A/B arms
  // without the share): a kernel's own tile argument may set their share (fwd_sm90ws's POLY).
  static constexpr bool kPolyCapable = kSoftcapBuild == 1 || kSoftcapBuild == 4 || kSoftcapBuild == 6;
  template <int NT, int HEAD_DIM>
  static constexpr int kPolyShare = kSoftcapBuild == 1 ? (HEAD_DIM <= 64 ? (3 * NT + 7) / 8 : (NT + 7) / 8)
                                  : kSoftcapBuild == 4 ? (HEAD_DIM <= 64 ? 0 : (2 * NT + 7) / 8)
                                  : kSoftcapBuild == 6 ? (HEAD_DIM <= 64 ? (2 * NT + 7) / 8 : (NT + 7) / 8) : 0;
  // softcap is the only score transform (and no sink starts the softmax): the tensor-core
  // kernels keep the scores in units of c, tanh(S tau / c), and fold c into the softmax's exp2
  // multiplier (sl2 = c log2(e) in place of log2(e)): one FMUL a score fewer, in both passes
  static constexpr bool kCapUnits = (SOFTCAP != 0) && (ALIBI == 0) && !Mod::kAfterAlibi && !SINK;
  // SOFTCAP 4-6 with kCapUnits: the softcap alone bounds every score to [-c, c], so the
  // forwards' softmax runs on one fixed offset, with no running max and no rescale of O
  // (online_softmax.cuh fixed_offset_softmax_scores); bfloat16 only, as the tanh build (P can
  // exceed 1 there, up to 2^88 / Lk, far beyond float16's range).
  static constexpr bool kFixedOffset = (kSoftcapBuild >= 4) && kCapUnits;
  // ALiBi is the only score transform (no sink): the tensor-core forwards (modify_score_tile)
  // keep the raw products S and add - (slope / tau) |i + diag - j|, the softmax folding tau
  // log2(e) into its exp2 as plain attention does: one FMUL (S tau) a score fewer
  static constexpr bool kAlibiRawUnits = (ALIBI == 1) && (SOFTCAP == 0) && !Mod::kAfterAlibi && !SINK;
  // ... and under causal every visible pair has j <= i + causal_offset <= i + diag (the host
  // gives top-left causal with Lq > Lk the ALIBI = 2 build: cuflash/_variant.py), so |i + diag -
  // j| = (i + diag - col0) - (j - col0): the score is a row term, - (slope / tau) (i + diag -
  // col0), plus (slope / tau) (j - col0), one FFMA a score with the column as an immediate. A
  // kernel that carries the row term in its softmax (modify_score_tile<Var, true> hands it out,
  // online_softmax_scores<., ., true> takes it in: fwd_sm90ws) saves the FADD of the distance.
  static constexpr bool kAlibiRowOffset = CUFLASH_ALIBI_ROW_OFFSET && kAlibiRawUnits && CAUSAL;
  // Scores go through Mod::score in natural-log units (s * scale, then steps 2-5) and the
  // online softmax runs with log2(e) in place of scale * log2(e); the sink's row start is in
  // those units too. Without it the kernels fold the scale into exp2 as before.
  static constexpr bool kNatural = Mod::kTransforms || SINK;
  // An element mask that is not an interval of keys per row (a bool array, a mask_mod): every
  // tile that is not known full evaluates it pair by pair (pair_visible).
  static constexpr bool kPairMask = MASK || Mod::kHasMaskMod;
  // SOFTCAP + 8 (the tanh builds), the softcap alone and no pair mask: bwd_sm90 takes its plain
  // path with the softcap's two steps in it (th = tanh.approx(S tau / c) in place of S, P =
  // exp2(th c log2(e) - L log2(e)), dS = P (1 - th^2) o (dP - D): the chain rule folded into P
  // once P^T is packed for dV), not the per-element path of bwd_io::p_ds_pair
  static constexpr bool kSoftcapBwdPlain = (SOFTCAP & 8) && kSoftcapTanh && kCapUnits && !kPairMask;
  // The per-block item state (slopes, sinks, bias/mask pointers, user b and h) is needed.
  static constexpr bool kItem = kNatural || kPairMask;
  static constexpr bool kHasBias = Mod::kHasBias;
  static constexpr bool kBlockMask = BLOCK_MASK;   // a block mask classifies the mask_mod's tiles
  // The backward's dS needs the modifiers' chain rule (softcap, score_mod) or writes dbias.
  static constexpr bool kGrad = (SOFTCAP != 0) || Mod::kHasBias || Mod::kHasScoreMod;
  template <class Acc> using Item = typename Mod::template ItemOf<Acc>;
  // Which ends of a query row's visible key interval are real bounds: kKeyHi, the row sees keys
  // only up to key_last(i) < Lk - 1 for some rows (causal); kKeyLo, it sees them only from
  // key_first(i) > 0 for some rows (a window; no variant has it yet). Where a flag is false,
  // the matching bound is 0 or Lk - 1 and the kernels skip evaluating it.
  static constexpr bool kKeyLo = WINDOW;
  static constexpr bool kKeyHi = CAUSAL || WINDOW;

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
  // ---- the same questions with the window's bounds (Params::mod): key j is visible to query i
  //      when i + diag - left <= j <= i + diag + right, a bound < 0 being unbounded. Without a
  //      window each is the causal-only function above.
  static __device__ __forceinline__ int key_end(const VariantParams& v, const ModifierParams& m, const int& m_end, const int& Lk) {
    int e = key_end(v, m_end, Lk);
    if (WINDOW && m.window_right >= 0) e = min(e, m_end + m.diag + m.window_right);
    return e;
  }
  static __device__ __forceinline__ int key_begin(const VariantParams& v, const ModifierParams& m, const int& m_begin) {
    if (WINDOW && m.window_left >= 0) return max(0, m_begin + m.diag - m.window_left);
    return key_begin(v, m_begin);
  }
  static __device__ __forceinline__ int query_begin(const VariantParams& v, const ModifierParams& m, const int& n_begin) {
    int b = query_begin(v, n_begin);
    if (WINDOW && m.window_right >= 0) b = max(b, n_begin - m.diag - m.window_right);
    return b;
  }
  static __device__ __forceinline__ int query_end(const VariantParams& v, const ModifierParams& m, const int& n_end, const int& Lq) {
    int e = query_end(v, n_end, Lq);
    if (WINDOW && m.window_left >= 0) e = min(e, max(0, n_end - m.diag + m.window_left));
    return e;
  }
  static __device__ __forceinline__ bool tile_invisible(const VariantParams& v, const ModifierParams& m, const int& m_begin,
                                                        const int& m_end, const int& n_begin, const int& n_end) {
    bool out = tile_invisible(v, m_begin, m_end, n_begin, n_end);
    if (WINDOW && m.window_right >= 0) out = out || n_begin > m_end - 1 + m.diag + m.window_right;
    if (WINDOW && m.window_left >= 0) out = out || n_end - 1 < m_begin + m.diag - m.window_left;
    return out;
  }
  static __device__ __forceinline__ bool needs_mask(const VariantParams& v, const ModifierParams& m, const int& m_begin,
                                                    const int& m_end, const int& n_begin, const int& n_end) {
    if (kPairMask) return true;   // a bool mask / mask_mod: every tile evaluates it
    return needs_bound_mask(v, m, m_begin, m_end, n_begin, n_end);
  }
  // causal's and the window's bounds alone: what a block mask's tile needs besides the pair
  // masks, which its list entry's kind switches (a full tile: none; fwd_sm90, fwd_sm80)
  static __device__ __forceinline__ bool needs_bound_mask(const VariantParams& v, const ModifierParams& m, const int& m_begin,
                                                          const int& m_end, const int& n_begin, const int& n_end) {
    bool out = needs_mask(v, m_begin, m_end, n_begin, n_end);
    if (WINDOW && m.window_right >= 0) out = out || n_end - 1 > m_begin + m.diag + m.window_right;
    if (WINDOW && m.window_left >= 0) out = out || n_begin < m_end - 1 + m.diag - m.window_left;
    return out;
  }
  static __device__ __forceinline__ int key_last(const VariantParams& v, const ModifierParams& m, const int& i, const int& Lk) {
    int e = key_last(v, i, Lk);
    if (WINDOW && m.window_right >= 0) e = min(e, i + m.diag + m.window_right);
    return e;
  }
  static __device__ __forceinline__ int key_first(const VariantParams& v, const ModifierParams& m, const int& i) {
    if (WINDOW && m.window_left >= 0) return i + m.diag - m.window_left;
    return key_first(v, i);
  }
  // (only evaluated where kKeyHi; may be negative)
  static __device__ __forceinline__ int query_first(const VariantParams& v, const ModifierParams& m, const int& j) {
    int f = CAUSAL ? query_first(v, j) : -(1 << 30);
    if (WINDOW && m.window_right >= 0) f = max(f, j - m.diag - m.window_right);
    return f;
  }
  // (only evaluated where kKeyLo)
  static __device__ __forceinline__ int query_last(const VariantParams& v, const ModifierParams& m, const int& j) {
    if (WINDOW && m.window_left >= 0) return j - m.diag + m.window_left;
    return query_last(v, j);
  }
  static __device__ __forceinline__ bool visible(const VariantParams& v, const ModifierParams& m, const int& i, const int& j) {
    bool out = visible(v, i, j);
    if (WINDOW && m.window_right >= 0) out = out && j <= i + m.diag + m.window_right;
    if (WINDOW && m.window_left >= 0) out = out && j >= i + m.diag - m.window_left;
    return out;
  }

  // ---- the modifiers' per-element hooks (everything below is only called where its flag is on)
  // The item state of launch-local batch item b, or an empty one where nothing needs it.
  template <class Acc, class P>
  static __device__ __forceinline__ Item<Acc> item(const P& p, int b) {
    if constexpr (kItem) return Mod::template item<Acc>(p.mod, p.batch_shape, b);
    else return Item<Acc>{};
  }
  // Steps 2-5 on the raw dot product x of the pair (i, j) (rows and keys clamped into the
  // problem so that a padded row or key never reads outside the bias), then, in a tile that
  // needs it, the element mask of a bool array / mask_mod: the modified score, natural units.
  // `row` is Mod::at_row(m, item, min(i, Lq - 1)), computed once per row by the caller.
  template <class Acc, class It>
  static __device__ __forceinline__ Acc score(const ModifierParams& m, const It& row, Acc x, Acc scale,
                                              int i, int j, int Lq, int Lk) {
    return Mod::score_row(m, row, x * scale, min(i, Lq - 1), min(j, Lk - 1));
  }
  template <class It>
  static __device__ __forceinline__ bool pair_visible(const ModifierParams& m, const It& row, int causal_offset,
                                                      int i, int j, int Lq, int Lk) {
    return Mod::visible_row(m, row, causal_offset, min(i, Lq - 1), min(j, Lk - 1));
  }
  template <class It>
  static __device__ __forceinline__ It at_row(const ModifierParams& m, const It& it, int i, int Lq) {
    if constexpr (kItem) return Mod::at_row(m, it, min(i, Lq - 1));
    else return it;
  }
};

// The special-function unit's 2^x, 1/x and tanh (mma_sm80.cuh; the host emulation has its own).
__device__ __forceinline__ float ex2_approx(float x);
__device__ __forceinline__ float rcp_approx(float x);
__device__ __forceinline__ float tanh_approx(float x);

// The tensor-core forwards' score tile (mma.sync / wgmma accumulator layout, online_softmax.cuh:
// s[t][e] is row row0 + 8 (e / 2), key col0 + 8 t + e % 2): raw products -> modified scores in
// natural units (Var::kNatural), and -inf where the element mask hides a pair (pair_mask: a
// tile that Var::kPairMask does not know to be full). Plain variants never call it.
//
// Steps 2-3 (softcap, ALiBi) are computed here a row at a time, with the fewest instructions a
// score, since they sit between the S and the P V products of every tile (bench/NOTES.md "fwd
// modifier cost (session 7)", "softcap and ALiBi cost (session 8)"); Mod::score_row computes the
// same values for the other kernels:
// - softcap (Var::kSoftcapTanh, the default): c tanh(y), y = x scale / c, as FMUL, tanh.approx,
//   FMUL: 3 instructions and ONE special-function operation a score (softmax's ex2 is the
//   other), against 2 in the build below. At d = 128 a score costs 512 tensor FLOPs, ~0.125
//   SM-cycles, and the special-function unit does 16 operations a cycle an SM (0.0625 cycles
//   each): 3 of them a score (the build below) make it the bottleneck, 2 match the tensor time.
//   Error: tanh.approx's relative error is at most 2^-11 (PTX ISA), so |c tanh.approx(y) -
//   c tanh(y)| <= 2^-11 |c tanh(y)|, an eighth of bfloat16's ulp at the score (the kit's naive
//   computation stores the capped score in T: a rounding of up to 2^-9 relative in bfloat16).
//   bfloat16 only (cuflash/_variant.py): in float16 that rounding is 2^-12, and the emulated
//   tests with 2^-11 injected (tests/emu) fail the kit's lse bound, so float16 takes the build
//   below. FlashAttention 2/3 compute their softcap with tanh.approx too. Numerics: tanh.approx(+-inf) = +-1, so x = +-inf gives +-c as tanhf does; a NaN
//   stays NaN; masked pairs get -inf after this (mask_scores, the element mask), never before.
// - softcap, the session-7 build (SOFTCAP = 2, CUFLASH_SOFTCAP_TANH=0): c tanh(y) =
//   c - 2c / (2^{x k2} + 1), k2 = 2 scale log2(e) / c: FMUL, ex2.approx, FADD, rcp.approx, FFMA
//   (2 special-function operations). Error at most ~3.5e-7 c (ex2's 2^-22 relative error and
//   rcp's 1 ulp, at most halved by the tanh's slope); below |y| = 1/4, where that is a large
//   relative error, the odd series of tanh to y^9 instead (5 FMA-pipe instructions, session 10). Numerics: x k2 > 128 gives 2^{x k2} = +inf,
//   1 / inf = 0, so c; x k2 < -126 flushes to 0, 1 / 1 = 1, so -c; x = +-inf gives +-c; NaN
//   stays NaN. With CUFLASH_SOFTCAP_RCP_FMA=1 (an experiment, off by default) its reciprocal
//   runs on the FMA pipe instead: u = 2^{-|x| k2} = e^{-2|y|} in [0, 1], tanh|y| = 2 / (1 + u) -
//   1, 1 / (1 + u) from a quadratic seed (relative error 1.0%) and two Newton steps (1e-8), the
//   sign of x put back: 11 instructions, error ~2.7e-7 c (simulated). u = 0 (|x| k2 > 126, or
//   x = +-inf) gives +-c; x = +-0 gives +-0; a NaN stays NaN.
// - ALiBi: - slope |i + diag - j| as one FADD and one FFMA a score (|.| is a free operand
//   modifier), from the row's distance to the thread's first column converted once; integer
//   distances below 2^24 are exact in float, so the value is the integer path's. ALiBi alone
//   (Var::kAlibiRawUnits, the default: CUFLASH_ALIBI_RAW) adds - (slope / tau) |.| to the raw
//   product instead and leaves tau log2(e) to the softmax's exp2, as plain attention does: the
//   FMUL x tau a score goes (the score's rounding moves by at most an ulp of float32).
#ifndef CUFLASH_SOFTCAP_RCP_FMA
#define CUFLASH_SOFTCAP_RCP_FMA 0
#endif
// softcap_of's multiplier of the raw product x: scale / c (tanh build), 2 scale log2(e) / c
template <bool TANH>
__device__ __forceinline__ float softcap_k(float scale, float inv_cap) {
  return TANH ? scale * inv_cap : 2.f * 1.4426950408889634f * scale * inv_cap;
}
// (a template, so that sources without mma_sm80.cuh's special-function wrappers never instantiate it)
template <bool TANH, class F>
__device__ __forceinline__ F softcap_of(F x, F k, F cap) {
  if constexpr (TANH) {
    return cap * tanh_approx(x * k);
  } else {
#if CUFLASH_SOFTCAP_RCP_FMA
    const float u = ex2_approx(-fabsf(x) * k);
    const float d = 1.f + u;
    float r = fmaf(fmaf(0.32319388f, u, -0.80798954f), u, 0.98986351f);
    r = fmaf(r, fmaf(-d, r, 1.f), r);
    r = fmaf(r, fmaf(-d, r, 1.f), r);
    return copysignf(fmaf(2.f * cap, r, -cap), x);
#else
    // |y| < 1/4 (y = x k ln(2) / 2 = x scale / c): tanh y by its odd series to y^9 (truncation
    // 8.5e-9 y, rounding a few ulps), because c - 2c / (e^{2y} + 1) cancels there: its absolute
    // error ~3.5e-7 c is a large relative one for small scores (session 10's campaign: float16,
    // c = 50, logits ~0.01, lse 3.4e-6 off against the kit's bound of 1.1e-6). x = +-inf or NaN
    // fails the test and takes the ex2 / rcp form, as before.
    const float y = x * k * 0.34657359f, y2 = y * y;
    const float series = fmaf(fmaf(fmaf(fmaf(0.021869488f, y2, -0.053968254f), y2, 0.13333334f),
                                   y2, -0.33333334f), y2, 1.f);
    const float far = fmaf(-2.f * cap, rcp_approx(ex2_approx(x * k) + 1.f), cap);
    return fabsf(y) < 0.25f ? cap * (y * series) : far;
#endif
  }
}

// ROW_OFFSET (a kernel whose softmax takes a per-row offset) with Var::kAlibiRowOffset: the
// ALiBi term of each of the thread's two rows at the thread's first column, col0, is written to
// row_off instead of being added to every score (the scores stay "shifted": the true score is
// s + row_off[r]; the offset is the thread's own, col0 differing within a quad); otherwise
// row_off is not written.
template <class Var, bool ROW_OFFSET = false, int NT, class It>
__device__ __forceinline__ void modify_score_tile(float (&s)[NT][4], const VariantParams& v, const ModifierParams& m,
                                                  const It& it, int row0, int col0, int Lq, int Lk, bool pair_mask,
                                                  float* row_off = nullptr) {
  using Mod = typename Var::Mod;
  constexpr bool kRowOffset = ROW_OFFSET && Var::kAlibiRowOffset;
  const float scale = static_cast<float>(v.scale);
  // softcap: the multiplier of the raw product (softcap_k) and c
  const float k2 = Mod::kHasSoftcap ? softcap_k<Var::kSoftcapTanh>(scale, m.inv_softcap) : 0.f;
  const float cap = Var::kCapUnits ? 1.f : Mod::kHasSoftcap ? m.softcap : 0.f;   // (units of c: kCapUnits)
  float neg_slope = 0.f;
  // (kAlibiRawUnits: - slope / tau, the scores stay raw; it overflows to -inf, and a pair on
  // the diagonal gives NaN = 0 x inf, only for tau < slope / 3.4e38, a scale that makes every
  // half-type score 0 anyway)
  if constexpr (Mod::kHasAlibi) neg_slope = Var::kAlibiRawUnits ? -static_cast<float>(it.slope) / scale
                                                                : -static_cast<float>(it.slope);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = row0 + 8 * r;
    const It row = Var::at_row(m, it, i, Lq);
    if constexpr (Var::kNatural) {
      // ALiBi: i + diag - col0, the distance of the thread's first column (rows past Lq and
      // keys past Lk are never stored / masked after this: no clamping needed here)
      float dist0 = 0.f;
      if constexpr (Mod::kHasAlibi) dist0 = static_cast<float>(i + m.diag - col0);
      if constexpr (kRowOffset) row_off[r] = neg_slope * dist0;
      // score and element mask pair by pair (the order ptxas allocates best when both are on)
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = col0 + 8 * t + e;
          float& x = s[t][2 * r + e];
          if constexpr (Mod::kHasSoftcap) x = softcap_of<Var::kSoftcapTanh>(x, k2, cap);
          else if constexpr (!Var::kAlibiRawUnits) x *= scale;
          if constexpr (kRowOffset) x = fmaf(-neg_slope, static_cast<float>(8 * t + e), x);
          else if constexpr (Mod::kHasAlibi) x = fmaf(fabsf(dist0 - static_cast<float>(8 * t + e)), neg_slope, x);
          if constexpr (Mod::kAfterAlibi) x = Mod::score_after_alibi(m, row, x, min(i, Lq - 1), min(j, Lk - 1));
          if constexpr (Var::kPairMask)
            if (pair_mask && !Var::pair_visible(m, row, v.causal_offset, i, j, Lq, Lk)) x = -__int_as_float(0x7f800000);
        }
    } else if constexpr (Var::kPairMask) {
      if (pair_mask) {
        // the row's element mask as bits first (one register, not one per pending load)
        static_assert(NT <= 16, "2 NT bits in an unsigned");
        unsigned keep = 0u;
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            keep |= static_cast<unsigned>(Var::pair_visible(m, row, v.causal_offset, i, col0 + 8 * t + e, Lq, Lk)) << (2 * t + e);
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (!((keep >> (2 * t + e)) & 1u)) s[t][2 * r + e] = -__int_as_float(0x7f800000);
      }
    }
  }
}

// The sink's start of the online softmax in that layout: the four threads of a quad share a row
// and add their row sums at the end, so only the quad's first thread starts at l = 1.
template <class Var, int NR, class It>
__device__ __forceinline__ void sink_row_start(float (&m_i)[NR], float (&l_i)[NR], const It& it, int lane) {
  if constexpr (Var::kSink) {
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      float mx, l;
      Var::Mod::row_start(it, mx, l);
      m_i[r] = mx;
      l_i[r] = (lane % 4 == 0) ? l : 0.f;
    }
  }
}

}  // namespace cuflash
