// The score pipeline of DESIGN.md "Modifiers" for the kernels: one template, ModVariant, whose
// hooks every kernel family calls (docs/modifiers.md shows where). It computes what
// cuflash/_pipeline.py computes on NumPy blocks, element by element; tests/test_modifiers_variant.py
// compiles this header for the host with g++ and checks it against that module, and compiles
// it with NVRTC for sm_80 and sm_90a.
//
// A modifier that is off is a template argument that makes its code vanish: with every
// argument at its default the hooks compile to nothing and kTransforms is false, so a kernel
// keeps today's folding of scale * log2(e) into its exp2.
//
// Units: scores are natural-log units here (s = scale * q.k); a kernel that works in base 2
// multiplies score()'s result (and row_start's row_max) by log2(e).
#pragma once

// A bias element as float (the half types add overloads where their headers are included).
template <class T> __device__ __forceinline__ float cuflash_bias_to_float(T x) { return static_cast<float>(x); }

namespace cuflash {

#ifndef CUFLASH_CAPTURED_ARRAY
#define CUFLASH_CAPTURED_ARRAY
// An array a user function reads (cuflash.captured): pointer, shape, strides in elements.
struct CapturedArray {
  const void* ptr;
  long long shape[4];
  long long stride[4];
};
#endif

enum TileKind : int { kTileEmpty = 0, kTilePartial = 1, kTileFull = 2 };

// Run-time values of the modifiers, mirrored by cuflash/_modifier_params.py (MODIFIER_PARAMS).
// Batch strides are over the launch's (merged, <= 4) batch dims, 0 where broadcast, in elements.
struct ModifierParams {
  const void* bias;                 // element (item, i, j): bias + item offset + i*bias_row + j*bias_col
  const bool* mask;                 // likewise with the mask_* strides
  const void* alibi_slopes;         // the kernel's accumulation type (float, or double for
  const void* sink;                 // float64 inputs), one per batch item (broadcast by strides)
  const int* block_list;            // block mask tile lists (ModVariant::tile_list), or null
  float* dbias;                     // backward with a bias: dL/dbias of every (item, i, j),
                                    // item x Lq x Lk float32, C order (the host sums it over the
                                    // bias's broadcast dims); null otherwise
  long long bias_batch_stride[4];
  long long mask_batch_stride[4];
  long long slope_batch_stride[4];
  long long sink_batch_stride[4];
  long long block_batch_stride[4];
  long long bias_row, bias_col, mask_row, mask_col;
  CapturedArray captured[4];        // score_mod's slots first, then mask_mod's
  float softcap, inv_softcap;
  int window_left, window_right;    // -1: unbounded
  int diag;                         // Lk - Lq: the diagonal of ALiBi and of the window
  int heads;                        // H: the user functions' b = item / H, h = item % H
  int batch_base;                   // global flat index of this launch's first batch item
  int list_tq, list_tk, list_bwd;   // block mask lists: query tiles, key tiles, transpose's start
  int mask_mod_captured_base;       // slot of mask_mod's first captured array
  int pad_;
};

struct NoScoreMod {};
struct NoMaskMod {};

namespace mod_detail {
template <class A, class B> struct same { static constexpr bool value = false; };
template <class A> struct same<A, A> { static constexpr bool value = true; };
template <bool C, class A, class B> struct pick { using type = A; };
template <class A, class B> struct pick<false, A, B> { using type = B; };
__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }
template <class T> __device__ __forceinline__ float to_float(T x) { return static_cast<float>(x); }
template <class Acc> __device__ __forceinline__ Acc neg_inf_of() { return neg_inf(); }
template <> __device__ __forceinline__ double neg_inf_of<double>() { return -__longlong_as_double(0x7ff0000000000000LL); }
__device__ __forceinline__ float tanh_of(float x) { return tanhf(x); }
__device__ __forceinline__ double tanh_of(double x) { return tanh(x); }
// softcap's s / c: float multiplies by the reciprocal; double divides (the exact path)
__device__ __forceinline__ float div_cap(float s, const float cap, const float inv) { return s * inv; }
__device__ __forceinline__ double div_cap(double s, const float cap, const float) { return s / static_cast<double>(cap); }
// (a bias of __half / __nv_bfloat16: cuflash_bias_to_float's overloads in common.cuh, found by
// argument-dependent lookup where the kernel is instantiated)
template <class Acc, class T> __device__ __forceinline__ Acc load_as(const T* p) { return static_cast<Acc>(cuflash_bias_to_float(*p)); }
template <> __device__ __forceinline__ double load_as<double, double>(const double* p) { return *p; }
}  // namespace mod_detail

// Per batch item, computed once per thread block; Acc is the kernel's accumulation type.
template <typename BiasT, typename Acc = float>
struct ItemState {
  int ub, uh;                   // the user functions' b and h
  Acc slope, sink;
  const BiasT* bias;            // this item's bias at (0, 0)
  const bool* mask;
  const int* list;              // this item's block mask tile lists
};

template <bool kCausal = false, bool kWindow = false, bool kSoftcap = false,
          bool kAlibi = false, typename BiasT = void, bool kMask = false,
          typename ScoreMod = NoScoreMod, typename MaskMod = NoMaskMod,
          bool kBlockMask = false, bool kSink = false>
struct ModVariant {
  static constexpr bool kHasBias = !mod_detail::same<BiasT, void>::value;
  static constexpr bool kHasScoreMod = !mod_detail::same<ScoreMod, NoScoreMod>::value;
  static constexpr bool kHasMaskMod = !mod_detail::same<MaskMod, NoMaskMod>::value;
  static_assert(!kBlockMask || kHasMaskMod, "a block mask classifies a mask_mod's tiles");
  // false: the kernel keeps folding scale * log2(e) into its exp2 (today's fast path)
  static constexpr bool kTransforms = kSoftcap || kAlibi || kHasBias || kHasScoreMod;
  static constexpr bool kHasSoftcap = kSoftcap, kHasAlibi = kAlibi;
  // steps 4-5 (score_after_alibi) do something
  static constexpr bool kAfterAlibi = kHasBias || kHasScoreMod;
  // false: every pair of a tile that tile_kind() does not call empty is visible
  static constexpr bool kElementMask = kCausal || kWindow || kMask || kHasMaskMod;
  using Bias = typename mod_detail::pick<kHasBias, BiasT, float>::type;
  template <class Acc> using ItemOf = ItemState<Bias, Acc>;
  using Item = ItemOf<float>;

  // (1) Once per block: batch item `item` (launch-local, C order over batch_shape[4]).
  template <class Acc = float>
  __device__ __forceinline__ static ItemOf<Acc> item(const ModifierParams& m,
                                                     const int* batch_shape, int item) {
    ItemOf<Acc> it;
    const int g = m.batch_base + item;
    it.ub = g / m.heads;
    it.uh = g % m.heads;
    long long ob = 0, om = 0, osl = 0, osk = 0, obk = 0;
    int r = item;
#pragma unroll
    for (int d = 3; d >= 0; --d) {
      const int idx = r % batch_shape[d];
      r /= batch_shape[d];
      ob += idx * m.bias_batch_stride[d];
      om += idx * m.mask_batch_stride[d];
      osl += idx * m.slope_batch_stride[d];
      osk += idx * m.sink_batch_stride[d];
      obk += idx * m.block_batch_stride[d];
    }
    it.slope = kAlibi ? static_cast<const Acc*>(m.alibi_slopes)[osl] : Acc(0);
    it.sink = kSink ? static_cast<const Acc*>(m.sink)[osk] : mod_detail::neg_inf_of<Acc>();
    it.bias = kHasBias ? static_cast<const Bias*>(m.bias) + ob : nullptr;
    it.mask = kMask ? m.mask + om : nullptr;
    it.list = kBlockMask ? m.block_list + obk : nullptr;
    return it;
  }

  // (2) Keys [lo, hi) that causal and the window leave visible to some row of [i0, i1);
  //     rows [lo, hi) that see some key of [j0, j1) (the backward walks key tiles).
  __device__ __forceinline__ static void key_range(const ModifierParams& m, int causal_offset,
                                                   int Lk, int i0, int i1, int& lo, int& hi) {
    long long l = 0, h = Lk;
    if (kCausal) h = h < (long long)i1 + causal_offset ? h : (long long)i1 + causal_offset;
    if (kWindow && m.window_right >= 0) {
      const long long e = (long long)i1 + m.diag + m.window_right;
      h = h < e ? h : e;
    }
    if (kWindow && m.window_left >= 0) {
      const long long b = (long long)i0 + m.diag - m.window_left;
      l = l > b ? l : b;
    }
    if (i1 <= i0 || l >= h) { lo = hi = 0; return; }
    lo = static_cast<int>(l);
    hi = static_cast<int>(h);
  }
  __device__ __forceinline__ static void query_range(const ModifierParams& m, int causal_offset,
                                                     int Lq, int j0, int j1, int& lo, int& hi) {
    long long l = 0, h = Lq;
    if (kCausal) l = l > (long long)j0 - causal_offset ? l : (long long)j0 - causal_offset;
    if (kWindow && m.window_right >= 0) {
      const long long b = (long long)j0 - m.diag - m.window_right;
      l = l > b ? l : b;
    }
    if (kWindow && m.window_left >= 0) {
      const long long e = (long long)j1 - m.diag + m.window_left;
      h = h < e ? h : e;
    }
    if (j1 <= j0 || l >= h) { lo = hi = 0; return; }
    lo = static_cast<int>(l);
    hi = static_cast<int>(h);
  }

  // (3) The kind of the tile rows [i0, i1) x keys [j0, j1) (ends clipped to Lq, Lk) that
  //     causal and the window give analytically: empty (never load it), full (skip visible()),
  //     else partial. A mask array or a mask_mod is always partial here: a block mask's kinds
  //     come with its tile lists (3b).
  template <class It>
  __device__ __forceinline__ static TileKind tile_kind(const ModifierParams& m, const It& it,
                                                       int causal_offset, int i0, int i1,
                                                       int j0, int j1) {
    bool empty = false, full = true;
    const long long a0 = i0, a1 = (long long)i1 - 1, b0 = j0, b1 = (long long)j1 - 1;
    if (kCausal) {                                   // visible iff j <= i + off
      empty |= b0 > a1 + causal_offset;
      full &= b1 <= a0 + causal_offset;
    }
    if (kWindow && m.window_left >= 0) {             // visible iff j >= i + diag - left
      empty |= b1 < a0 + m.diag - m.window_left;
      full &= b0 >= a1 + m.diag - m.window_left;
    }
    if (kWindow && m.window_right >= 0) {            // visible iff j <= i + diag + right
      empty |= b0 > a1 + m.diag + m.window_right;
      full &= b1 <= a0 + m.diag + m.window_right;
    }
    if (kMask || kHasMaskMod) full = false;
    return empty ? kTileEmpty : (full ? kTileFull : kTilePartial);
  }

  // (3b) A block mask's tile lists, FlexAttention's kv_num_blocks / kv_indices on the
  //      kernel's own tiles (cuflash/_block_mask.py TileLists: built on the host once per block
  //      mask and kernel tile shape, from the map's empty / partial / full blocks). kKeys: the
  //      key tiles query tile t visits (the forward); otherwise the query tiles key tile t
  //      visits (the backward). A list holds only tiles that some of their pairs may be
  //      visible in ("empty tiles are never loaded"), ascending; an entry is
  //      tile << kListShift | the kind (TileKind, 2 bits) of each row slice of the query tile
  //      (a warpgroup's or warp's rows in the forward; the whole tile in the transpose). A loop
  //      reads entry v + 1 or v + 2 while it computes on entry v: no division and no walk
  //      over empty tiles, and the kind (full: no mask_mod) comes with the entry. Both
  //      directions are read from one kind matrix of the same tiles, so the forward's pairs
  //      and the backward's are the same, and a key tile's transpose list holds query tile a
  //      exactly when a's list holds it (the deterministic backward's count).
  static constexpr int kListShift = 16;
  static constexpr int kListEnd = 0x7fffffff;      // after a list's last entry: its tile >= any end
  // The list of tile t (its entries, then kListEnd at least twice: a loop reads the entry after
  // next without a count); `count` its length (the deterministic backward's and the tests').
  template <bool kKeys, class It>
  __device__ __forceinline__ static const int* tile_list(const ModifierParams& m, const It& it,
                                                         int t, int& count) {
    if (kKeys) {
      count = it.list[t];
      return it.list + m.list_tq + (long long)t * (m.list_tk + 2);
    }
    count = it.list[m.list_bwd + t];
    return it.list + m.list_bwd + m.list_tk + (long long)t * (m.list_tq + 2);
  }
  // Entry v (at most the list's length + 1); kListEnd from the first tile >= end on (the
  // analytic causal / window bound of the loop).
  __device__ __forceinline__ static int list_entry(const int* list, int v, int end) {
    const int e = list[v];
    return (e >> kListShift) < end ? e : kListEnd;
  }
  __device__ __forceinline__ static int entry_tile(int e) { return e >> kListShift; }
  // (a mask array besides the block mask: its pairs are evaluated in every tile the list holds)
  __device__ __forceinline__ static TileKind entry_kind(int e, int slice) {
    const int k = (e >> (2 * slice)) & 3;
    return static_cast<TileKind>(kMask && k == kTileFull ? kTilePartial : k);
  }

  // (4) Steps 2-5 on s = scale * q.k (natural-log units), in the accumulation type Acc (the
  //     traced score_mod too: its apply / dscore are templates on the float type).
  template <class Acc, class It>
  __device__ __forceinline__ static Acc score(const ModifierParams& m, const It& it, Acc s,
                                              int i, int j) {
    return score_row(m, at_row(m, it, i), s, i, j);
  }
  // The item state with the bias and mask pointers at row i (what score_row / visible_row
  // take: a kernel computes it once per row and reuses it along the row).
  template <class It>
  __device__ __forceinline__ static It at_row(const ModifierParams& m, const It& it, int i) {
    It r = it;
    if (kHasBias) r.bias += (long long)i * m.bias_row;
    if (kMask) r.mask += (long long)i * m.mask_row;
    return r;
  }
  template <class Acc, class It>
  __device__ __forceinline__ static Acc score_row(const ModifierParams& m, const It& it, Acc s,
                                                  int i, int j) {
    if (kSoftcap) s = static_cast<Acc>(m.softcap) * mod_detail::tanh_of(mod_detail::div_cap(s, m.softcap, m.inv_softcap));
    return score_after_softcap(m, it, s, i, j);
  }
  // Steps 3-5 alone (ALiBi, bias, score_mod), on a score that has been through step 2 (the
  // tensor-core backwards compute the softcap on the special-function unit: bwd_io p_ds_pair).
  template <class Acc, class It>
  __device__ __forceinline__ static Acc score_after_softcap(const ModifierParams& m, const It& it, Acc s,
                                                            int i, int j) {
    if (kAlibi) {
      const int dist = i + m.diag - j;
      s -= it.slope * static_cast<Acc>(dist < 0 ? -dist : dist);
    }
    return score_after_alibi(m, it, s, i, j);
  }
  // Steps 4-5 alone (bias, score_mod), on a score that has been through steps 2-3 (the
  // tensor-core forwards compute those a row at a time: variant.cuh, modify_score_tile).
  template <class Acc, class It>
  __device__ __forceinline__ static Acc score_after_alibi(const ModifierParams& m, const It& it, Acc s,
                                                          int i, int j) {
    if (kHasBias) s += mod_detail::load_as<Acc>(it.bias + j * static_cast<int>(m.bias_col));
    if constexpr (kHasScoreMod) s = ScoreMod::apply(s, it.ub, it.uh, i, j, m.captured);
    return s;
  }

  // (4b) ALiBi as a term of a base-2 exponent, for a kernel that keeps the scale folded into
  //      its exp2 (bwd_sm90's plain path: ALiBi the only score transform). The bias is added
  //      to the scaled score and nothing non-linear follows before the exponential, so
  //        exp(tau S - slope |dist| - L) = exp2(S tau log2(e) - slope log2(e) |dist| - L log2(e)),
  //      dist = i + diag - j: x = S tau log2(e) - L log2(e) in, x - slope log2(e) |dist| out
  //      (one FFMA; |dist| is an operand modifier). dist is a float holding an integer, exact
  //      below 2^24. x = -inf (a dead row: L = +inf) stays -inf, so P = 0 there as before; a
  //      masked pair's x may be anything, the kernel selects its P and dS to 0 afterwards.
  template <class It>
  __device__ __forceinline__ static float alibi_slope_log2(const It& it) {
    return kAlibi ? static_cast<float>(it.slope) * 1.4426950408889634f : 0.f;
  }
  __device__ __forceinline__ static float alibi_exp2(float x, float slope_log2, float dist) {
    return fmaf(fabsf(dist), -slope_log2, x);
  }

  // (5) Step 6 for one pair of a partial tile.
  template <class It>
  __device__ __forceinline__ static bool visible(const ModifierParams& m, const It& it,
                                                 int causal_offset, int i, int j) {
    return visible_row(m, at_row(m, it, i), causal_offset, i, j);
  }
  template <class It>
  __device__ __forceinline__ static bool visible_row(const ModifierParams& m, const It& it,
                                                     int causal_offset, int i, int j) {
    bool v = true;
    if (kCausal) v &= (long long)j <= (long long)i + causal_offset;
    if (kWindow && m.window_left >= 0) v &= (long long)j >= (long long)i + m.diag - m.window_left;
    if (kWindow && m.window_right >= 0) v &= (long long)j <= (long long)i + m.diag + m.window_right;
    // (column offsets in 32 bits: the launcher checks that (Lk - 1) * mask_col fits)
    if (kMask) v &= it.mask[j * static_cast<int>(m.mask_col)];
    if constexpr (kHasMaskMod)
      v = v && MaskMod::apply(it.ub, it.uh, i, j, m.captured + m.mask_mod_captured_base);
    return v;
  }

  // (6) Step 7: the online softmax starts from the sink, a key with score `sink` and value 0.
  template <class Acc, class It>
  __device__ __forceinline__ static void row_start(const It& it, Acc& row_max, Acc& row_sum) {
    row_max = kSink ? it.sink : mod_detail::neg_inf_of<Acc>();
    row_sum = (kSink && it.sink != mod_detail::neg_inf_of<Acc>()) ? Acc(1) : Acc(0);
  }

  // (7) Backward of steps 2-5: s = scale * q.k (recomputed), ds = dL/d score(s). Returns
  //     dL/ds and writes dL/dbias; both 0 where ds == 0 (a hidden pair: the derivatives there
  //     are never evaluated, they may be NaN at a score of -inf).
  template <class Acc, class It>
  __device__ __forceinline__ static Acc grad(const ModifierParams& m, const It& it, Acc s,
                                             Acc ds, int i, int j, Acc& dbias) {
    Acc th = Acc(0), t = s;
    if (kSoftcap && ds != Acc(0)) {
      th = mod_detail::tanh_of(mod_detail::div_cap(s, m.softcap, m.inv_softcap));
      t = static_cast<Acc>(m.softcap) * th;
    }
    return grad_capped(m, it, th, t, ds, i, j, dbias);
  }
  // The same, given step 2's th = tanh(s / c) and t = c th (s itself where there is no softcap),
  // which a kernel computed for P already: softcap's chain rule is then d(c tanh(s / c))/ds =
  // 1 - th^2, one FFMA on the capped score, no second tanh.
  template <class Acc, class It>
  __device__ __forceinline__ static Acc grad_capped(const ModifierParams& m, const It& it, Acc th, Acc t,
                                                    Acc ds, int i, int j, Acc& dbias) {
    dbias = Acc(0);
    if (!kSoftcap && !kHasScoreMod) {
      if (kHasBias) dbias = ds;
      return ds;
    }
    // (softcap alone needs no test of ds: th is in [-1, 1] (+-1 at a score of +-inf), so
    // 1 - th^2 is finite and a ds of 0 gives 0, without two compares and selects a pair)
    Acc g = ds;
    if constexpr (kHasScoreMod) {
      if (ds == Acc(0)) return Acc(0);
      if (kAlibi) {
        const int dist = i + m.diag - j;
        t -= it.slope * static_cast<Acc>(dist < 0 ? -dist : dist);
      }
      if (kHasBias) t += mod_detail::load_as<Acc>(it.bias + ((long long)i * m.bias_row + (long long)j * m.bias_col));
      g *= ScoreMod::dscore(t, it.ub, it.uh, i, j, m.captured);
    }
    if (kHasBias) dbias = g;
    if (kSoftcap) g *= Acc(1) - th * th;
    return g;
  }
};

}  // namespace cuflash
