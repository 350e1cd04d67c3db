// Dispatcher for the fused GATv2 ops: schemas and the argument checks that every backend runs.
// Kernels: cpu/gatv2_cpu.cpp (CPU) and cuda/gatv2_cuda.cu (CUDA). All per-edge tensors are in
// CSC order; the Python wrapper (torch_gradops/gatv2.py) maps them from and to edge order.
#include <torch/library.h>

#include "checks.h"
#include "gatv2.h"

namespace torch_gradops {

void check_gatv2_forward_args(const at::Tensor& x_src, const at::Tensor& x_dst, const at::Tensor& att,
                              const c10::optional<at::Tensor>& edge_attr,
                              const c10::optional<at::Tensor>& edge_weight, const at::Tensor& indptr,
                              const at::Tensor& indices, const c10::optional<at::Tensor>& dropout_mask,
                              double dropout_scale, const c10::optional<at::Tensor>& edge_attr_rows) {
  check_floating(x_src, "x_src");
  check_dim(x_src, 3, "x_src");
  const int64_t heads = x_src.size(1), channels = x_src.size(2);
  TORCH_CHECK(heads >= 1 && channels >= 1, "x_src must have at least one head and one channel, got shape ",
              x_src.sizes());
  check_dim(x_dst, 3, "x_dst");
  TORCH_CHECK(x_dst.size(1) == heads && x_dst.size(2) == channels, "x_dst must have shape [num_dst, ", heads,
              ", ", channels, "] (the heads and channels of x_src), got ", x_dst.sizes());
  check_shape(att, {heads, channels}, "att");
  for (auto* p : {&x_dst, &att}) {
    TORCH_CHECK(p->scalar_type() == x_src.scalar_type(), (p == &x_dst ? "x_dst" : "att"),
                " must have the dtype of x_src (", x_src.scalar_type(), "), got ", p->scalar_type());
  }
  check_index(indptr, "indptr");
  check_index(indices, "indices");
  TORCH_CHECK(indices.scalar_type() == indptr.scalar_type(), "indices and indptr must share one dtype");
  TORCH_CHECK(indptr.numel() == x_dst.size(0) + 1, "indptr must have num_dst + 1 = ", x_dst.size(0) + 1,
              " entries (x_dst.size(0) + 1), got ", indptr.numel());
  check_same_device(x_src, "x_src", x_dst, "x_dst");
  check_same_device(x_src, "x_src", att, "att");
  check_same_device(x_src, "x_src", indptr, "indptr");
  check_same_device(x_src, "x_src", indices, "indices");
  const int64_t E = indices.numel();
  // Checked here for every backend: the CUDA kernels have no destination to report it from.
  TORCH_CHECK(x_dst.size(0) > 0 || E == 0, "indices has ", E, " edges but x_dst has no destinations to hold them");
  TORCH_CHECK(x_src.size(0) > 0 || E == 0, "indices has ", E, " edges but x_src has no sources for them");
  TORCH_CHECK(!edge_weight.has_value() || edge_attr.has_value(), "edge_weight was given without edge_attr");
  if (edge_attr.has_value()) {
    const at::Tensor& ea = *edge_attr;
    TORCH_CHECK(ea.scalar_type() == x_src.scalar_type(), "edge_attr must have the dtype of x_src (",
                x_src.scalar_type(), "), got ", ea.scalar_type());
    check_same_device(x_src, "x_src", ea, "edge_attr");
    // Its rows: one per CSC position, or any number read through edge_attr_rows.
    const int64_t rows = edge_attr_rows.has_value() && ea.dim() > 0 ? ea.size(0) : E;
    if (edge_weight.has_value()) {
      check_dim(ea, 2, "edge_attr (with edge_weight)");
      TORCH_CHECK(edge_attr_rows.has_value() || ea.size(0) == E, "edge_attr must have one row per edge (", E,
                  "), got ", ea.size(0));
      check_shape(*edge_weight, {ea.size(1), heads, channels}, "edge_weight");
      TORCH_CHECK(edge_weight->scalar_type() == x_src.scalar_type(), "edge_weight must have the dtype of x_src (",
                  x_src.scalar_type(), "), got ", edge_weight->scalar_type());
      check_same_device(x_src, "x_src", *edge_weight, "edge_weight");
    } else {
      check_shape(ea, {rows, heads, channels}, "edge_attr (already projected, no edge_weight)");
    }
    TORCH_CHECK(rows > 0 || E == 0, "edge_attr has no rows for the ", E, " edges to read");
  }
  if (edge_attr_rows.has_value()) {
    const at::Tensor& r = *edge_attr_rows;
    TORCH_CHECK(edge_attr.has_value(), "edge_attr_rows was given without edge_attr");
    check_index(r, "edge_attr_rows");
    TORCH_CHECK(r.scalar_type() == indices.scalar_type(), "edge_attr_rows and indices must share one dtype");
    TORCH_CHECK(r.numel() == E, "edge_attr_rows must have one entry per edge (", E, "), got ", r.numel());
    check_same_device(x_src, "x_src", r, "edge_attr_rows");
  }
  if (dropout_mask.has_value()) {
    check_shape(*dropout_mask, {E, heads}, "dropout_mask");
    TORCH_CHECK(dropout_mask->scalar_type() == at::kBool, "dropout_mask must be a bool tensor, got ",
                dropout_mask->scalar_type());
    check_same_device(x_src, "x_src", *dropout_mask, "dropout_mask");
  }
  TORCH_CHECK(dropout_scale >= 1.0, "dropout_scale must be 1/(1-p) >= 1, got ", dropout_scale);
}

namespace {
at::Tensor contiguous_or_undefined(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->contiguous() : at::Tensor();
}
}  // namespace

Gatv2ForwardArgs prepare_gatv2_forward(const at::Tensor& x_src, const at::Tensor& x_dst, const at::Tensor& att,
                                       const c10::optional<at::Tensor>& edge_attr,
                                       const c10::optional<at::Tensor>& edge_weight, const at::Tensor& indptr,
                                       const at::Tensor& indices, const c10::optional<at::Tensor>& dropout_mask,
                                       double dropout_scale, const c10::optional<at::Tensor>& edge_attr_rows) {
  check_gatv2_forward_args(x_src, x_dst, att, edge_attr, edge_weight, indptr, indices, dropout_mask,
                           dropout_scale, edge_attr_rows);
  Gatv2ForwardArgs a{x_src.contiguous(),
                     x_dst.contiguous(),
                     att.contiguous(),
                     contiguous_or_undefined(edge_attr),
                     contiguous_or_undefined(edge_weight),
                     indptr.contiguous(),
                     indices.contiguous(),
                     contiguous_or_undefined(dropout_mask),
                     contiguous_or_undefined(edge_attr_rows)};
  if (a.edge_weight.defined()) {
    a.edge_mode = Gatv2EdgeMode::kProject;
    a.edge_dim = a.edge_attr.size(1);
  } else if (a.edge_attr.defined()) {
    a.edge_mode = Gatv2EdgeMode::kDirect;
  }
  return a;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> allocate_gatv2_outputs(const Gatv2ForwardArgs& a, bool return_alpha) {
  const int64_t num_dst = a.x_dst.size(0), H = a.x_src.size(1), C = a.x_src.size(2);
  const auto opts = a.x_src.options();
  return {at::empty({num_dst, H, C}, opts),
          at::empty({num_dst, H}, opts.dtype(kLseType)),
          at::empty({return_alpha ? a.indices.numel() : 0, H}, opts)};
}

Gatv2BackwardArgs prepare_gatv2_backward(
    const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_alpha, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& x_src, const at::Tensor& x_dst, const at::Tensor& att,
    const c10::optional<at::Tensor>& edge_attr, const c10::optional<at::Tensor>& edge_weight,
    const at::Tensor& indptr, const at::Tensor& indices, const at::Tensor& rev_indptr, const at::Tensor& rev_edge,
    const at::Tensor& rev_dst, const c10::optional<at::Tensor>& dropout_mask, double dropout_scale,
    std::array<bool, 5> output_mask, const c10::optional<at::Tensor>& edge_attr_rows) {
  Gatv2BackwardArgs a;
  a.fwd = prepare_gatv2_forward(x_src, x_dst, att, edge_attr, edge_weight, indptr, indices, dropout_mask,
                                dropout_scale, edge_attr_rows);
  // The same checks as GAT's backward (x_dst gives the destination count GAT takes from a_dst).
  check_gat_backward_args(grad_out, grad_alpha, out, lse, x_src, x_dst, indices, rev_indptr, rev_edge, rev_dst);
  a.grad_out = grad_out.contiguous();
  a.grad_alpha = contiguous_or_undefined(grad_alpha);
  a.out = out.contiguous();
  a.lse = lse.contiguous();
  a.rev_indptr = rev_indptr.contiguous();
  a.rev_edge = rev_edge.contiguous();
  a.rev_dst = rev_dst.contiguous();
  a.want_x_src = output_mask[0];
  a.want_x_dst = output_mask[1];
  a.want_att = output_mask[2];
  a.want_edge_attr = output_mask[3] && a.fwd.edge_mode != Gatv2EdgeMode::kNone;
  a.want_edge_weight = output_mask[4] && a.fwd.edge_mode == Gatv2EdgeMode::kProject;
  return a;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> allocate_gatv2_gradients(
    const Gatv2BackwardArgs& a) {
  const auto& f = a.fwd;
  auto empty = [&] { return f.x_src.new_empty({0}); };
  // Every row is written once when each is read once; read through edge_attr_rows with other
  // row counts, some are read by no edge and get zeros. (Rows named twice are refused where the
  // gradient is wanted: the CPU backward checks on the host, the CUDA one asserts on the device.)
  auto edge_attr_grad = [&] {
    const bool all_written = !f.edge_attr_rows.defined() || f.edge_attr.size(0) == f.indices.numel();
    return all_written ? at::empty_like(f.edge_attr) : at::zeros_like(f.edge_attr);
  };
  return {a.want_x_src ? at::empty_like(f.x_src) : empty(), a.want_x_dst ? at::empty_like(f.x_dst) : empty(),
          a.want_att ? at::empty_like(f.att) : empty(), a.want_edge_attr ? edge_attr_grad() : empty(),
          a.want_edge_weight ? at::empty_like(f.edge_weight) : empty()};
}

}  // namespace torch_gradops

TORCH_LIBRARY_FRAGMENT(torch_gradops, m) {
  // out [num_dst,H,C], lse [num_dst,H] (float64 for every dtype), alpha [E,H] if return_alpha else [0,H].
  // edge_attr is [R,K] with edge_weight [K,H,C], or [R,H,C] (already projected) without it: R = E
  // rows in CSC order, or any R with edge_attr_rows [E] naming the row each CSC position reads
  // (distinct rows where edge_attr's gradient is wanted).
  m.def(
      "gatv2_forward(Tensor x_src, Tensor x_dst, Tensor att, Tensor? edge_attr, Tensor? edge_weight, "
      "Tensor indptr, Tensor indices, Tensor? dropout_mask, float negative_slope, float dropout_scale, "
      "bool return_alpha, Tensor? edge_attr_rows=None) -> (Tensor, Tensor, Tensor)");
  // Gradients of x_src, x_dst, att, edge_attr (edge_attr's shape and row order), edge_weight; an
  // entry whose output_mask is false (or whose input is absent) comes back as an empty tensor and
  // costs no work.
  m.def(
      "gatv2_backward(Tensor grad_out, Tensor? grad_alpha, Tensor out, Tensor lse, Tensor x_src, "
      "Tensor x_dst, Tensor att, Tensor? edge_attr, Tensor? edge_weight, Tensor indptr, Tensor indices, "
      "Tensor rev_indptr, Tensor rev_edge, Tensor rev_dst, Tensor? dropout_mask, float negative_slope, "
      "float dropout_scale, bool[5] output_mask, Tensor? edge_attr_rows=None) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}
