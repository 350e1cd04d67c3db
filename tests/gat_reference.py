"""Plain-PyTorch GAT reference (index_select + scatter softmax, as PyG computes it).

It shares no code with torch_gradops: the softmax is PyG's ``torch_geometric.utils.softmax``.
"""
import torch
import torch.nn.functional as F
from torch_geometric.utils import softmax


def gat_reference(x_src, a_src, a_dst, edge_index, num_dst, negative_slope=0.2, edge_logits=None,
                  keep_mask=None, keep_scale=1.0):
    """``out [num_dst, H, C]`` and ``alpha [E, H]`` (after dropout), edges in the given order.

    ``keep_mask [E, H]`` (bool, original edge order) replays a dropout mask.
    """
    src, dst = edge_index[0].long(), edge_index[1].long()
    z = a_src.index_select(0, src) + a_dst.index_select(0, dst)
    if edge_logits is not None:
        z = z + edge_logits
    alpha = softmax(F.leaky_relu(z, negative_slope), dst, num_nodes=num_dst)
    if keep_mask is not None:
        alpha = alpha * keep_mask.to(alpha.dtype) * keep_scale
    msg = alpha.unsqueeze(-1) * x_src.index_select(0, src)
    out = torch.zeros((num_dst,) + tuple(x_src.shape[1:]), dtype=x_src.dtype, device=x_src.device)
    return out.index_add(0, dst, msg), alpha
