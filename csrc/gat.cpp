// Dispatcher for the fused GAT ops: schemas and the argument checks that every backend runs.
// Kernels: cpu/gat_cpu.cpp (CPU) and cuda/gat_cuda.cu (CUDA). All per-edge tensors are in
// CSC order; the Python wrapper (torch_gradops/gat.py) maps them from and to edge order.
#include <torch/library.h>

#include "checks.h"
#include "gat.h"

namespace torch_gradops {

void check_logit_dtype(const at::Tensor& t, at::ScalarType features, at::ScalarType logits, const char* name) {
  const auto d = t.scalar_type();
  TORCH_CHECK(d == features || d == gat_acc_type(features), name, " must have the dtype of x_src (", features, ")",
              features != gat_acc_type(features) ? " or float32" : "", ", got ", d);
  TORCH_CHECK(d == logits, name, " (", d, ") must have the dtype of a_src (", logits, ")");
}

void check_gat_forward_args(const at::Tensor& x_src, const at::Tensor& a_src, const at::Tensor& a_dst,
                            const c10::optional<at::Tensor>& edge_logits, const at::Tensor& indptr,
                            const at::Tensor& indices, const c10::optional<at::Tensor>& dropout_mask,
                            double dropout_scale) {
  check_floating(x_src, "x_src");
  check_dim(x_src, 3, "x_src");
  const int64_t num_src = x_src.size(0), heads = x_src.size(1);
  TORCH_CHECK(heads >= 1 && x_src.size(2) >= 1, "x_src must have at least one head and one channel, got shape ",
              x_src.sizes());
  check_shape(a_src, {num_src, heads}, "a_src");
  check_dim(a_dst, 2, "a_dst");
  TORCH_CHECK(a_dst.size(1) == heads, "a_dst must have ", heads, " heads (x_src.size(1)), got ",
              a_dst.size(1));
  check_index(indptr, "indptr");
  check_index(indices, "indices");
  TORCH_CHECK(indices.scalar_type() == indptr.scalar_type(), "indices and indptr must share one dtype");
  TORCH_CHECK(indptr.numel() == a_dst.size(0) + 1, "indptr must have num_dst + 1 = ", a_dst.size(0) + 1,
              " entries (a_dst.size(0) + 1), got ", indptr.numel());
  check_logit_dtype(a_src, x_src.scalar_type(), a_src.scalar_type(), "a_src");
  check_logit_dtype(a_dst, x_src.scalar_type(), a_src.scalar_type(), "a_dst");
  check_same_device(x_src, "x_src", a_src, "a_src");
  check_same_device(x_src, "x_src", a_dst, "a_dst");
  check_same_device(x_src, "x_src", indptr, "indptr");
  check_same_device(x_src, "x_src", indices, "indices");
  const int64_t E = indices.numel();
  // Checked here for every backend: the CUDA kernels have no destination to report it from (the
  // forward returned an uninitialised alpha and the backward's reverse-index assert killed the context).
  TORCH_CHECK(a_dst.size(0) > 0 || E == 0, "indices has ", E, " edges but a_dst has no destinations to hold them");
  TORCH_CHECK(num_src > 0 || E == 0, "indices has ", E, " edges but x_src has no sources for them");
  if (edge_logits.has_value()) {
    check_shape(*edge_logits, {E, heads}, "edge_logits");
    check_logit_dtype(*edge_logits, x_src.scalar_type(), a_src.scalar_type(), "edge_logits");
    check_same_device(x_src, "x_src", *edge_logits, "edge_logits");
  }
  if (dropout_mask.has_value()) {
    check_shape(*dropout_mask, {E, heads}, "dropout_mask");
    TORCH_CHECK(dropout_mask->scalar_type() == at::kBool, "dropout_mask must be a bool tensor, got ",
                dropout_mask->scalar_type());
    check_same_device(x_src, "x_src", *dropout_mask, "dropout_mask");
  }
  TORCH_CHECK(dropout_scale >= 1.0, "dropout_scale must be 1/(1-p) >= 1, got ", dropout_scale);
}

void check_gat_backward_args(const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_alpha,
                             const at::Tensor& out, const at::Tensor& lse, const at::Tensor& x_src,
                             const at::Tensor& a_dst, const at::Tensor& indices,
                             const at::Tensor& rev_indptr, const at::Tensor& rev_edge,
                             const at::Tensor& rev_dst) {
  const int64_t num_dst = a_dst.size(0), heads = x_src.size(1), channels = x_src.size(2);
  check_shape(grad_out, {num_dst, heads, channels}, "grad_out");
  check_shape(out, {num_dst, heads, channels}, "out");
  check_shape(lse, {num_dst, heads}, "lse");
  TORCH_CHECK(grad_out.scalar_type() == x_src.scalar_type(), "grad_out must have the dtype of x_src");
  TORCH_CHECK(out.scalar_type() == x_src.scalar_type(), "out must have the dtype of x_src");
  TORCH_CHECK(lse.scalar_type() == kLseType, "lse must be ", kLseType, " (what the forward returns), got ",
              lse.scalar_type());
  if (grad_alpha.has_value()) {
    check_shape(*grad_alpha, {indices.numel(), heads}, "grad_alpha");
    TORCH_CHECK(grad_alpha->scalar_type() == a_dst.scalar_type(), "grad_alpha must have alpha's dtype (",
                a_dst.scalar_type(), "), got ", grad_alpha->scalar_type());
    check_same_device(x_src, "x_src", *grad_alpha, "grad_alpha");
  }
  check_index(rev_indptr, "rev_indptr");
  check_index(rev_edge, "rev_edge");
  check_index(rev_dst, "rev_dst");
  TORCH_CHECK(rev_indptr.numel() == x_src.size(0) + 1, "rev_indptr must have num_src + 1 entries");
  TORCH_CHECK(rev_edge.numel() == indices.numel() && rev_dst.numel() == indices.numel(),
              "rev_edge and rev_dst must have one entry per edge");
  for (auto* p : {&rev_indptr, &rev_edge, &rev_dst}) {
    TORCH_CHECK(p->scalar_type() == indices.scalar_type(), "the reverse index must have the dtype of indices");
    check_same_device(x_src, "x_src", *p, "reverse index");
  }
  check_same_device(x_src, "x_src", grad_out, "grad_out");
  check_same_device(x_src, "x_src", out, "out");
  check_same_device(x_src, "x_src", lse, "lse");
}

namespace {
at::Tensor contiguous_or_undefined(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->contiguous() : at::Tensor();
}
}  // namespace

GatForwardArgs prepare_gat_forward(const at::Tensor& x_src, const at::Tensor& a_src,
                                   const at::Tensor& a_dst, const c10::optional<at::Tensor>& edge_logits,
                                   const at::Tensor& indptr, const at::Tensor& indices,
                                   const c10::optional<at::Tensor>& dropout_mask, double dropout_scale) {
  check_gat_forward_args(x_src, a_src, a_dst, edge_logits, indptr, indices, dropout_mask, dropout_scale);
  return {x_src.contiguous(), a_src.contiguous(), a_dst.contiguous(), contiguous_or_undefined(edge_logits),
          indptr.contiguous(), indices.contiguous(), contiguous_or_undefined(dropout_mask)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> allocate_gat_outputs(const GatForwardArgs& a, bool return_alpha) {
  const int64_t num_dst = a.a_dst.size(0), H = a.x_src.size(1), C = a.x_src.size(2);
  const auto opts = a.x_src.options();
  return {at::empty({num_dst, H, C}, opts),
          at::empty({num_dst, H}, opts.dtype(kLseType)),
          at::empty({return_alpha ? a.indices.numel() : 0, H}, a.a_src.options())};
}

GatBackwardArgs prepare_gat_backward(
    const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_alpha, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& x_src, const at::Tensor& a_src, const at::Tensor& a_dst,
    const c10::optional<at::Tensor>& edge_logits, const at::Tensor& indptr, const at::Tensor& indices,
    const at::Tensor& rev_indptr, const at::Tensor& rev_edge, const at::Tensor& rev_dst,
    const c10::optional<at::Tensor>& dropout_mask, double dropout_scale, std::array<bool, 4> output_mask) {
  GatBackwardArgs a;
  a.fwd = prepare_gat_forward(x_src, a_src, a_dst, edge_logits, indptr, indices, dropout_mask, dropout_scale);
  check_gat_backward_args(grad_out, grad_alpha, out, lse, x_src, a_dst, indices, rev_indptr, rev_edge, rev_dst);
  a.grad_out = grad_out.contiguous();
  a.grad_alpha = contiguous_or_undefined(grad_alpha);
  a.out = out.contiguous();
  a.lse = lse.contiguous();
  a.rev_indptr = rev_indptr.contiguous();
  a.rev_edge = rev_edge.contiguous();
  a.rev_dst = rev_dst.contiguous();
  a.want_x = output_mask[0];
  a.want_a_src = output_mask[1];
  a.want_a_dst = output_mask[2];
  a.want_edge_logits = output_mask[3] && edge_logits.has_value();
  return a;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> allocate_gat_gradients(const GatBackwardArgs& a) {
  const auto& f = a.fwd;
  // a skipped gradient is an empty tensor of its input's dtype (the logits' may differ from x_src's)
  auto empty = [](const at::Tensor& like) { return like.new_empty({0}); };
  return {a.want_x ? at::empty_like(f.x_src) : empty(f.x_src),
          a.want_a_src ? at::empty_like(f.a_src) : empty(f.a_src),
          a.want_a_dst ? at::empty_like(f.a_dst) : empty(f.a_dst),
          a.want_edge_logits ? at::empty({f.indices.numel(), f.x_src.size(1)}, f.a_src.options()) : empty(f.a_src)};
}

GatSpmmArgs prepare_gat_spmm(const at::Tensor& weight, const at::Tensor& values, const at::Tensor& indptr,
                             const at::Tensor& neighbors, const c10::optional<at::Tensor>& edge_ids) {
  check_floating(values, "values");
  check_dim(values, 3, "values");
  check_dim(weight, 2, "weight");
  TORCH_CHECK(weight.size(1) == values.size(1), "weight must have ", values.size(1),
              " heads (values.size(1)), got shape ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == values.scalar_type(), "weight (", weight.scalar_type(),
              ") must have the dtype of values (", values.scalar_type(), ")");
  check_index(indptr, "indptr");
  check_index(neighbors, "neighbors");
  TORCH_CHECK(indptr.numel() >= 1, "indptr must have num_rows + 1 >= 1 entries");
  TORCH_CHECK(indptr.numel() > 1 || neighbors.numel() == 0, "neighbors has ", neighbors.numel(),
              " edges but indptr has no rows to hold them");
  TORCH_CHECK(neighbors.scalar_type() == indptr.scalar_type(), "neighbors and indptr must share one dtype");
  TORCH_CHECK(neighbors.numel() == weight.size(0), "neighbors must have one entry per edge (weight.size(0) = ",
              weight.size(0), "), got ", neighbors.numel());
  TORCH_CHECK(values.size(0) > 0 || neighbors.numel() == 0, "neighbors has ", neighbors.numel(),
              " edges but values has no rows for them");
  check_same_device(values, "values", weight, "weight");
  check_same_device(values, "values", indptr, "indptr");
  check_same_device(values, "values", neighbors, "neighbors");
  if (edge_ids.has_value()) {
    check_index(*edge_ids, "edge_ids");
    TORCH_CHECK(edge_ids->scalar_type() == indptr.scalar_type(), "edge_ids and indptr must share one dtype");
    TORCH_CHECK(edge_ids->numel() == weight.size(0), "edge_ids must have one entry per edge (weight.size(0) = ",
                weight.size(0), "), got ", edge_ids->numel());
    check_same_device(values, "values", *edge_ids, "edge_ids");
  }
  return {weight.contiguous(), values.contiguous(), indptr.contiguous(), neighbors.contiguous(),
          contiguous_or_undefined(edge_ids)};
}

GatSddmmArgs prepare_gat_sddmm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& indptr,
                               const at::Tensor& indices) {
  check_floating(a, "a");
  check_dim(a, 3, "a");
  check_dim(b, 3, "b");
  TORCH_CHECK(b.size(1) == a.size(1) && b.size(2) == a.size(2), "b must have a's heads and channels (",
              a.size(1), ", ", a.size(2), "), got shape ", b.sizes());
  TORCH_CHECK(b.scalar_type() == a.scalar_type(), "b (", b.scalar_type(), ") must have the dtype of a (",
              a.scalar_type(), ")");
  check_index(indptr, "indptr");
  check_index(indices, "indices");
  TORCH_CHECK(indices.scalar_type() == indptr.scalar_type(), "indices and indptr must share one dtype");
  TORCH_CHECK(indptr.numel() == a.size(0) + 1, "indptr must have a.size(0) + 1 = ", a.size(0) + 1,
              " entries, got ", indptr.numel());
  TORCH_CHECK(a.size(0) > 0 || indices.numel() == 0, "indices has ", indices.numel(),
              " edges but a has no rows to hold them");
  TORCH_CHECK(b.size(0) > 0 || indices.numel() == 0, "indices has ", indices.numel(),
              " edges but b has no rows for them");
  check_same_device(a, "a", b, "b");
  check_same_device(a, "a", indptr, "indptr");
  check_same_device(a, "a", indices, "indices");
  return {a.contiguous(), b.contiguous(), indptr.contiguous(), indices.contiguous()};
}

}  // namespace torch_gradops

TORCH_LIBRARY_FRAGMENT(torch_gradops, m) {
  // out [num_dst,H,C], lse [num_dst,H] (float64 for every dtype), alpha [E,H] if return_alpha else [0,H].
  // The logits (a_src, a_dst, edge_logits) have x_src's dtype, or float32 for half x_src; alpha,
  // grad_alpha and the logits' gradients have theirs.
  m.def(
      "gat_forward(Tensor x_src, Tensor a_src, Tensor a_dst, Tensor? edge_logits, Tensor indptr, "
      "Tensor indices, Tensor? dropout_mask, float negative_slope, float dropout_scale, "
      "bool return_alpha) -> (Tensor, Tensor, Tensor)");
  // Gradients of x_src, a_src, a_dst, edge_logits (CSC order); an entry whose output_mask is
  // false comes back as an empty tensor and costs no work.
  m.def(
      "gat_backward(Tensor grad_out, Tensor? grad_alpha, Tensor out, Tensor lse, Tensor x_src, "
      "Tensor a_src, Tensor a_dst, Tensor? edge_logits, Tensor indptr, Tensor indices, "
      "Tensor rev_indptr, Tensor rev_edge, Tensor rev_dst, Tensor? dropout_mask, "
      "float negative_slope, float dropout_scale, bool[4] output_mask) -> (Tensor, Tensor, Tensor, Tensor)");
  // The two primitives the differentiable (double-backward and forward-mode) GAT paths are built
  // from; each one's derivatives are the two of them again, so every order stays O(E x H) extra.
  // Edge-weighted aggregation (SpMM): out [indptr.numel()-1, H, C],
  //   out[n] = sum_{k in indptr[n]..indptr[n+1]} weight[edge_ids[k] or k] * values[neighbors[k]].
  m.def("gat_spmm(Tensor weight, Tensor values, Tensor indptr, Tensor neighbors, Tensor? edge_ids) -> Tensor");
  // Per-edge dot products (SDDMM) in CSC order: out [E, H], out[e] = <a[row of e], b[indices[e]]>.
  m.def("gat_sddmm(Tensor a, Tensor b, Tensor indptr, Tensor indices) -> Tensor");
}
