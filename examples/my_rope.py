"""Your own RoPE as a row of compare.py, in plain torch (README.md, section compare.py, shows it).

Run: ``python compare.py --suite smoke --impl examples.my_rope:rope_half``. The function takes the
canonical inputs (ports/peers/user.py documents them) and returns the rotated tensors; ``rope_impl``
declares what it supports, and every other case is refused with the reason.
"""
import torch

from ports.peers.user import rope_impl


@rope_impl(styles=["rotate_half"], layouts=["bshd", "thd"], backward=True, devices=["cuda", "cpu"])
def rope_half(q, k, cos, sin, positions, *, style, layout, rotary_dim):
    c, s = (t[positions].unsqueeze(-2).float() for t in (cos, sin))  # each token's row, all heads
    def rotate(x):  # the first rotary_dim channels; the rest pass through
        x1, x2 = x[..., :rotary_dim].float().chunk(2, dim=-1)
        y = torch.cat([x1, x2], -1) * c + torch.cat([-x2, x1], -1) * s
        return torch.cat([y.to(x.dtype), x[..., rotary_dim:]], dim=-1)
    return rotate(q), None if k is None else rotate(k)
