"""Your own RoPE as a row of the study, in plain torch (README: "Your own kernel as a row").

The function takes the canonical inputs (ports/peers/user.py documents them) and returns the
rotated tensors; ``rope_impl`` declares what it supports, and the rest is refused with a reason.
"""
import torch

from ports.peers.user import rope_impl


@rope_impl(styles=["rotate_half"], layouts=["bshd", "thd"], dtypes=["fp32", "fp16", "bf16"],
           backward=True, devices=["cuda", "cpu"])
def rope_half(q, k, cos, sin, positions, *, style, layout, rotary_dim):
    """Plain torch rotate-half RoPE: gather the token's cos/sin rows, rotate the first R channels."""
    c = cos[positions].unsqueeze(-2).float()  # [b, s, 1, R] (thd: [t, 1, R])
    s = sin[positions].unsqueeze(-2).float()

    def rotate(x):
        r, rest = x[..., :rotary_dim].float(), x[..., rotary_dim:]
        x1, x2 = r.chunk(2, dim=-1)
        y = r * c + torch.cat([-x2, x1], dim=-1) * s
        return torch.cat([y.to(x.dtype), rest], dim=-1)

    return rotate(q), None if k is None else rotate(k)
