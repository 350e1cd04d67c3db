#include "cpu/strided_copy.h"

#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace torch_gradops {
namespace {

struct Dim {
  int64_t n;  // extent
  int64_t s;  // source stride (elements)
  int64_t t;  // destination stride (elements)
};

struct Bytes16 {
  uint64_t lo, hi;
};

// Tiles move at least this many bytes along each of their two dimensions (two cache lines: the
// hardware prefetchers fetch line pairs).
constexpr int64_t kTileBytes = 128;

// Copies rows i0..i1 x columns j0..j1 of a tile: V elements (contiguous on both sides) per
// (i, j); V = 0: a run of C < bytes <= 2C, moved as two overlapping C-byte blocks (fixed-size
// memcpys, which compile to plain moves; a loop of run-time length ran up to 2x slower than
// ATen's copy_ on runs of 3, 5, 6, 7 or 12 elements).
template <typename T, int V, int C = 0>
inline void copy_tile(T* dst, const T* src, int64_t i0, int64_t i1, int64_t ps, int64_t pt, int64_t j0, int64_t j1,
                      int64_t qs, int64_t qt, int64_t vec) {
  const int64_t nb = vec * static_cast<int64_t>(sizeof(T));
  for (int64_t i = i0; i < i1; ++i) {
    const T* s = src + i * ps;
    T* d = dst + i * pt;
    for (int64_t j = j0; j < j1; ++j) {
      const char* sv = reinterpret_cast<const char*>(s + j * qs);
      char* dv = reinterpret_cast<char*>(d + j * qt);
      if constexpr (V > 0) {
        std::memcpy(dv, sv, V * sizeof(T));
      } else {
        unsigned char head[C], tail[C];
        std::memcpy(head, sv, C);
        std::memcpy(tail, sv + nb - C, C);
        std::memcpy(dv, head, C);
        std::memcpy(dv + nb - C, tail, C);
      }
    }
  }
}

template <typename T, int V, int C = 0>
void copy_dims_v(T* dst0, const T* src0, const std::vector<Dim>& outer, const Dim* p, const Dim& q, int64_t vec) {
  const int64_t vbytes = vec * static_cast<int64_t>(sizeof(T));
  const int64_t tile = std::max<int64_t>(1, std::min<int64_t>(64, (kTileBytes + vbytes - 1) / vbytes));
  const int64_t np = p ? p->n : 1, ps = p ? p->s : 0, pt = p ? p->t : 0;
  const int64_t tile_p = p ? tile : 1, tile_q = p ? tile : q.n;
  std::vector<int64_t> idx(outer.size(), 0);
  int64_t so = 0, to = 0;  // offsets of the current outer index
  while (true) {
    const T* src = src0 + so;
    T* dst = dst0 + to;
    if (np <= tile_p && q.n <= tile_q) {
      copy_tile<T, V, C>(dst, src, 0, np, ps, pt, 0, q.n, q.s, q.t, vec);
    } else {
      for (int64_t i0 = 0; i0 < np; i0 += tile_p)
        for (int64_t j0 = 0; j0 < q.n; j0 += tile_q)
          copy_tile<T, V, C>(dst, src, i0, std::min(np, i0 + tile_p), ps, pt, j0, std::min(q.n, j0 + tile_q), q.s, q.t,
                          vec);
    }
    // Next outer index (the last outer dimension moves fastest).
    int64_t k = static_cast<int64_t>(outer.size()) - 1;
    for (; k >= 0; --k) {
      if (++idx[k] < outer[k].n) {
        so += outer[k].s;
        to += outer[k].t;
        break;
      }
      so -= (outer[k].n - 1) * outer[k].s;
      to -= (outer[k].n - 1) * outer[k].t;
      idx[k] = 0;
    }
    if (k < 0) return;
  }
}

template <typename T>
void copy_dims(char* dst_base, const char* src_base, const std::vector<Dim>& outer, const Dim* p, const Dim& q,
               int64_t vec) {
  T* dst = reinterpret_cast<T*>(dst_base);
  const T* src = reinterpret_cast<const T*>(src_base);
  switch (vec) {
    case 2: return copy_dims_v<T, 2>(dst, src, outer, p, q, vec);
    case 4: return copy_dims_v<T, 4>(dst, src, outer, p, q, vec);
    case 8: return copy_dims_v<T, 8>(dst, src, outer, p, q, vec);
    default: {  // runs of other lengths, 3 to 32 bytes (the caller takes no longer runs)
      const int64_t nb = vec * static_cast<int64_t>(sizeof(T));
      if (nb <= 4) return copy_dims_v<T, 0, 2>(dst, src, outer, p, q, vec);
      if (nb <= 8) return copy_dims_v<T, 0, 4>(dst, src, outer, p, q, vec);
      if (nb <= 16) return copy_dims_v<T, 0, 8>(dst, src, outer, p, q, vec);
      return copy_dims_v<T, 0, 16>(dst, src, outer, p, q, vec);
    }
  }
}

}  // namespace

bool strided_copy_cpu(at::Tensor& dst, const at::Tensor& src) {
  if (!dst.device().is_cpu() || !src.device().is_cpu() || dst.scalar_type() != src.scalar_type() ||
      dst.sizes() != src.sizes() || src.is_conj() || src.is_neg() || dst.is_conj() || dst.is_neg())
    return false;
  // Plain strided memory only (not sparse, mkldnn, quantized or a ZeroTensor without storage),
  // and no overlap between the two, where copy_ has rules of its own.
  for (const at::Tensor* t : {static_cast<const at::Tensor*>(&dst), &src})
    if (t->layout() != at::kStrided || !t->has_storage() || t->_is_zerotensor() || t->is_quantized()) return false;
  if (at::get_overlap_status(dst, src) != at::MemOverlapStatus::No) return false;
  const int64_t item = static_cast<int64_t>(src.element_size());
  if (item != 1 && item != 2 && item != 4 && item != 8 && item != 16) return false;
  if (dst.numel() == 0) return true;
  std::vector<Dim> dims;
  for (int64_t d = 0; d < src.dim(); ++d)
    if (src.size(d) != 1) dims.push_back({src.size(d), src.stride(d), dst.stride(d)});
  // Destination order: outermost first. Refuse a destination whose elements overlap (a stride
  // of 0, or dimensions that interleave), which copy_ handles by its own rules.
  std::stable_sort(dims.begin(), dims.end(), [](const Dim& a, const Dim& b) { return a.t > b.t; });
  for (size_t i = 0; i < dims.size(); ++i) {
    const int64_t inner = i + 1 < dims.size() ? dims[i + 1].t * dims[i + 1].n : 1;
    if (dims[i].t < inner) return false;
  }
  // Merge dimensions that are one block on both sides.
  std::vector<Dim> coalesced;
  for (size_t i = dims.size(); i-- > 0;) {  // from the innermost
    const Dim& d = dims[i];
    if (!coalesced.empty() && d.s == coalesced.back().s * coalesced.back().n &&
        d.t == coalesced.back().t * coalesced.back().n) {
      coalesced.back().n *= d.n;
    } else {
      coalesced.push_back(d);
    }
  }
  std::reverse(coalesced.begin(), coalesced.end());  // outermost first again
  // A run contiguous on both sides is moved as one vector.
  int64_t vec = 1;
  if (!coalesced.empty() && coalesced.back().s == 1 && coalesced.back().t == 1) {
    vec = coalesced.back().n;
    coalesced.pop_back();
  }
  // ATen's copy_ is as fast or faster without such a run (float32 transposes with one stride-1
  // side ran 1-4x faster there) and with runs of more than 32 bytes (0.7-1.0x of ATen's from 33
  // to 63 bytes); with a shorter run its inner loop moves only the run, where the tiles move
  // whole cache lines (2-5x faster).
  if (vec == 1 || vec * item > 32) return false;
  char* dst_base = static_cast<char*>(dst.data_ptr());
  const char* src_base = static_cast<const char*>(src.const_data_ptr());
  if (coalesced.empty()) {
    std::memcpy(dst_base, src_base, static_cast<size_t>(vec * item));
    return true;
  }
  // Tile the destination's innermost dimension q against the source's innermost p.
  const Dim q = coalesced.back();
  size_t p_at = coalesced.size() - 1;
  for (size_t i = 0; i + 1 < coalesced.size(); ++i)
    if (coalesced[i].s < coalesced[p_at].s) p_at = i;
  const bool tiled = p_at + 1 != coalesced.size();
  const Dim p = coalesced[p_at];
  std::vector<Dim> outer;
  for (size_t i = 0; i + 1 < coalesced.size(); ++i)
    if (!tiled || i != p_at) outer.push_back(coalesced[i]);
  const Dim* pp = tiled ? &p : nullptr;
  switch (item) {
    case 1: copy_dims<uint8_t>(dst_base, src_base, outer, pp, q, vec); break;
    case 2: copy_dims<uint16_t>(dst_base, src_base, outer, pp, q, vec); break;
    case 4: copy_dims<uint32_t>(dst_base, src_base, outer, pp, q, vec); break;
    case 8: copy_dims<uint64_t>(dst_base, src_base, outer, pp, q, vec); break;
    default: copy_dims<Bytes16>(dst_base, src_base, outer, pp, q, vec); break;
  }
  return true;
}

}  // namespace torch_gradops
