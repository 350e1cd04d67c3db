"""``python -m torch_gradops.demo``: the fused GAT op, GAT training on Cora and a sliced
tensor-network contraction, each checked against its plain-PyTorch peer (see ``__main__``).
One module per piece; nothing outside the demo imports it."""
