"""The hardware and kernel limits that both validation (problem.py) and the launch plan
(plan.py) respect."""
from __future__ import annotations

MAX_GRID_Y = 65535              # gridDim.y: the main kernel's sequences, the step kernel's batch
THREADS_PER_BLOCK = 256         # rope.cu's kernels are built with __launch_bounds__(256)
MAX_TOKENS_PER_BLOCK = 64       # blockDim.z limit
SMEM_LIMIT = 16 * 1024          # computed angles: shared cos/sin rows per block
