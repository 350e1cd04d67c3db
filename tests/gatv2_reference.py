"""Plain-PyTorch GATv2 reference (index_select + scatter softmax, as PyG's GATv2Conv computes it).

It shares no code with torch_gradops: the softmax is PyG's ``torch_geometric.utils.softmax``.
"""
import torch
import torch.nn.functional as F
from torch_geometric.utils import softmax


def gatv2_reference(x_src, x_dst, att, edge_index, num_dst, negative_slope=0.2, edge_attr=None,
                    edge_weight=None, keep_mask=None, keep_scale=1.0):
    """``out [num_dst, H, C]`` and ``alpha [E, H]`` (after dropout), edges in the given order.

    ``edge_attr [E, K]`` with ``edge_weight [K, H, C]``, or ``edge_attr [E, H, C]`` already
    projected. ``keep_mask [E, H]`` (bool, original edge order) replays a dropout mask.
    """
    src, dst = edge_index[0].long(), edge_index[1].long()
    z = x_src.index_select(0, src) + x_dst.index_select(0, dst)
    if edge_attr is not None:
        if edge_weight is not None:
            heads, channels = edge_weight.shape[1:]
            z = z + (edge_attr @ edge_weight.reshape(edge_weight.size(0), -1)).view(-1, heads, channels)
        else:
            z = z + edge_attr
    scores = (F.leaky_relu(z, negative_slope) * att).sum(-1)
    alpha = softmax(scores, dst, num_nodes=num_dst)
    if keep_mask is not None:
        alpha = alpha * keep_mask.to(alpha.dtype) * keep_scale
    msg = alpha.unsqueeze(-1) * x_src.index_select(0, src)
    out = torch.zeros((num_dst,) + tuple(x_src.shape[1:]), dtype=x_src.dtype, device=x_src.device)
    return out.index_add(0, dst, msg), alpha
