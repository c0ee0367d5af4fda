"""Plots (matplotlib, the [plot] extra): the tree of a microbatch."""
from __future__ import annotations

import numpy as np


def segment_sharing(mb) -> np.ndarray:
    """[S] number of samples whose path runs through each segment."""
    seg = mb.layout.segment_ids.numpy()
    count = np.zeros(mb.layout.num_segments, dtype=np.int64)
    for sid in mb.sample_ids:
        count[np.unique(seg[mb.sample_rows(sid).numpy()])] += 1
    return count


def plot_microbatch_tree(mb, path: str, *, title: str | None = None) -> None:
    """Draw each segment as a bar from its first to its last depth, leaves spread vertically,
    colour = number of samples sharing it; a line joins each child to its parent's end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L = mb.layout
    real = L.segment_parent.numpy()[: L.num_segments - L.num_padding]  # padding segments are not drawn
    S = len(real)
    off = L.segment_offsets.numpy()
    pos = L.position_ids.numpy()
    d0 = pos[off[:S]]
    d1 = d0 + (off[1: S + 1] - off[:S])
    level = L.segment_level.numpy()[:S]
    is_leaf = np.ones(S, bool)
    is_leaf[real[real >= 0]] = False
    y = np.zeros(S)
    y[is_leaf] = np.arange(is_leaf.sum())  # preorder = leaf order top to bottom
    acc = np.where(is_leaf, y, 0.0)
    n = is_leaf.astype(float)
    for lv in range(int(level.max(initial=0)), 0, -1):  # children's mean y -> parent
        segs = np.nonzero(level == lv)[0]
        np.add.at(acc, real[segs], np.where(is_leaf[segs], y[segs], acc[segs] / np.maximum(n[segs], 1)))
        np.add.at(n, real[segs], 1)
    y = np.where(is_leaf, y, acc / np.maximum(n, 1))
    share = segment_sharing(mb)[:S]
    fig, ax = plt.subplots(figsize=(10, max(3, 0.25 * is_leaf.sum() + 1)))
    cmap = plt.get_cmap("viridis")
    norm = matplotlib.colors.LogNorm(vmin=1, vmax=max(2, share.max()))
    for s in range(S):
        ax.plot([d0[s], d1[s]], [y[s], y[s]], lw=4, color=cmap(norm(max(share[s], 1))), solid_capstyle="butt")
        if real[s] >= 0:
            p = real[s]
            ax.plot([d1[p], d0[s]], [y[p], y[s]], lw=0.8, color="0.6")
    sm = matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap)
    fig.colorbar(sm, ax=ax, label="samples sharing the segment")
    ax.invert_yaxis()
    ax.set_xlabel("depth (position on the root path)")
    ax.set_yticks([])
    st = mb.stats
    ax.set_title(title or f"{st.num_samples} samples, {st.tree_tokens} tree rows vs {st.flat_tokens} flat "
                          f"(ratio {st.tree_token_ratio:.2f}), {st.num_segments} segments")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
